#include "layer-planner.h"

#include "cache-policy.h"
#include "cache-routing.h"

#include <algorithm>
#include <stdexcept>
#include <unordered_map>

int waves_needed(int n_expert, int k, int64_t n_tokens, int high_slots, bool has_expert_bias) {
    if (has_expert_bias) return 1;
    const int64_t most = std::min<int64_t>(n_expert, n_tokens * k);
    return (int) ((most + high_slots - 1) / high_slots);
}

bool wave_shape::pipelined(int64_t n_tokens) const {
    if (coop || slots < 2) return false;
    if (waves_needed(n_expert, k, n_tokens, slots, has_expert_bias) > 1) return true;
    const int64_t distinct = std::min<int64_t>(n_expert, n_tokens * k);
    return has_low && !has_expert_bias && needs_most_experts(n_tokens, k, n_expert) && 2 * distinct > slots + low_slots;
}

layer_plan plan_layer(const int32_t * ids, const float * weights, int64_t n_tokens, int k, int n_expert,
                      const plan_rules & rules, int n_waves, int high_slots,
                      const std::function<bool(int, expert_precision)> & served) {
    layer_plan plan;
    plan.ids.assign(ids, ids + n_tokens * k);
    std::vector<float> routed(weights, weights + n_tokens * k), rescaled;
    if (rules.cache_routing > 0 && rules.probs) {
        rescaled = route_to_cache(plan.ids.data(), routed.data(), n_tokens, k, rules.probs, n_expert, rules.cache_routing,
                                  rules.weights_normalized, [&](int e) { return served(e, expert_precision::high); });
    }
    plan.dropped.assign((size_t) n_tokens * k, 0);
    if (rules.stand_ins) {
        const int changed = stand_in(plan.ids.data(), plan.dropped.data(), routed.data(), n_tokens, k, *rules.stand_ins,
                                     [&](int e) { return served(e, expert_precision::high); });
        plan.stand_in_drops = (int) std::count(plan.dropped.begin(), plan.dropped.end(), 1);
        plan.stand_in_swaps = changed - plan.stand_in_drops;
    }
    ids = plan.ids.data();
    weights = routed.data();
    const precision_params & precision = rules.precision;
    const bool all_high = !precision.use_low && !precision.use_skip;
    plan.demand.assign((size_t) n_tokens * k, expert_precision::high);
    std::vector<expert_demand> wanted;
    std::vector<int64_t> uses;  // selections per wanted expert
    std::vector<int> index_of(std::max(n_expert, 0), -1);  // expert -> its place in wanted
    std::vector<double> scores(k);
    std::vector<int> rank(k);
    for (int64_t t = 0; t < n_tokens; t++) {
        expert_precision * demand = &plan.demand[t * k];
        if (!all_high) choose_precisions(weights + t * k, k, precision, demand);
        if (rules.keep > 0 && rules.keep < k) {
            selection_scores(weights + t * k, k, scores.data(), rank.data());
            for (int r = rules.keep; r < k; r++) { plan.dropped[t * k + rank[r]] = 1; demand[rank[r]] = expert_precision::skip; }
        }
        for (int i = 0; i < k; i++) {
            const int e = ids[t * k + i];
            if (e < 0 || e >= n_expert) {
                plan.error = "router chose expert " + std::to_string(e) + " out of " + std::to_string(n_expert);
                return plan;
            }
            if (plan.dropped[t * k + i]) { demand[i] = expert_precision::skip; continue; }
            if (rules.fixed) demand[i] = rules.fixed[e];
            if (index_of[e] < 0) { index_of[e] = (int) wanted.size(); wanted.emplace_back(e, demand[i]); uses.push_back(0); }
            else wanted[index_of[e]].second = std::max(wanted[index_of[e]].second, demand[i]);
            uses[index_of[e]]++;
        }
    }
    plan.scale.assign((size_t) n_tokens * k, 1.0f);
    for (int64_t t = 0; t < n_tokens; t++) {
        double all = 0, kept = 0;
        for (int i = 0; i < k; i++) {
            all += weights[t * k + i];
            kept += plan.dropped[t * k + i] ? 0.0 : weights[t * k + i];
        }
        const bool renormalized = rules.keep > 0 && rules.weights_normalized && kept > 0;
        for (int i = 0; i < k; i++) {
            plan.scale[t * k + i] = (float) ((renormalized ? all / kept : 1.0) * (rescaled.empty() ? 1.0f : rescaled[t * k + i]));
        }
    }
    if (n_tokens > 1 && rules.prefill_low_share > 0) {
        // Fate: popular experts first; the coldest, up to the share of selections, in LOW
        std::vector<size_t> order(wanted.size());
        for (size_t i = 0; i < order.size(); i++) order[i] = i;
        std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return uses[a] > uses[b]; });
        int64_t total = 0, cold = 0;
        for (int64_t u : uses) total += u;
        std::vector<expert_demand> by_popularity;
        for (size_t i = order.size(); i-- > 0;) {
            expert_demand & d = wanted[order[i]];
            cold += uses[order[i]];
            if ((double) cold > rules.prefill_low_share * total) break;
            if (!rules.fixed && d.second == expert_precision::high) d.second = expert_precision::low;
        }
        for (size_t i : order) by_popularity.push_back(wanted[i]);
        wanted = std::move(by_popularity);
    }
    if (n_waves > 1) {
        std::stable_partition(wanted.begin(), wanted.end(), [&](const expert_demand & e) { return served(e.first, e.second); });
    }
    plan.waves.assign(std::max(1, n_waves), {});
    const size_t per_wave = n_waves <= 1 ? wanted.size() : (size_t) high_slots;
    for (size_t i = 0; i < wanted.size(); i++) plan.waves[i / per_wave].push_back(wanted[i]);
    return plan;
}

plan_rules layer_rules::of(int il, int keep, const float * probs) const {
    plan_rules rules;
    rules.precision = precision;
    rules.fixed = fixed.empty() || fixed[il].empty() ? nullptr : fixed[il].data();
    rules.prefill_low_share = decode_batch ? 0 : prefill_low_share;
    rules.keep = keep;
    rules.weights_normalized = weights_normalized[il];
    rules.cache_routing = cache_routing;
    rules.probs = probs;
    rules.stand_ins = stand_ins.empty() || stand_ins[il].n_expert == 0 ? nullptr : &stand_ins[il];
    return rules;
}

std::vector<std::vector<expert_precision>> static_precision_map(const std::map<int, std::vector<int>> & low,
                                                                const std::vector<int> & layers, int n_layers, int n_expert) {
    std::vector<std::vector<expert_precision>> fixed(n_layers);
    for (int il : layers) fixed[il].assign(n_expert, expert_precision::high);
    for (const auto & [il, experts] : low) {
        if (il < 0 || il >= n_layers || fixed[il].empty()) {
            throw std::invalid_argument("precision map: layer " + std::to_string(il) + " has no experts");
        }
        for (int e : experts) {
            if (e < 0 || e >= n_expert) {
                throw std::invalid_argument("precision map: layer " + std::to_string(il) + " has no expert " + std::to_string(e));
            }
            fixed[il][e] = expert_precision::low;
        }
    }
    return fixed;
}

std::vector<int> tokens_of(const layer_plan & plan, const std::vector<expert_demand> & wave) {
    std::unordered_map<int, int> count;
    for (size_t j = 0; j < plan.ids.size(); j++) {
        if (!plan.dropped[j]) count[plan.ids[j]]++;
    }
    std::vector<int> out;
    for (const auto & d : wave) out.push_back(count[d.first]);
    return out;
}

#include "cache-fill.h"

#include "expert-residency.h"

#include <chrono>
#include <stdexcept>

std::vector<std::pair<int, int>> fill_order(const expert_layout & layout, const layer_rules & rules,
                                            const std::map<int, std::vector<int>> & ranking) {
    const int n_expert = layout.n_expert;
    std::map<int, std::vector<int>> order;  // per il
    for (const auto & l : layout.layers) {
        std::vector<bool> listed(n_expert, false);
        auto it = ranking.find(l.il);
        for (int e : it == ranking.end() ? std::vector<int>() : it->second) {
            if (e < 0 || e >= n_expert || listed[e]) throw std::invalid_argument("fill ranking: bad expert id");
            listed[e] = true;
            order[l.il].push_back(e);
        }
        for (int e = 0; e < n_expert; e++) if (!listed[e]) order[l.il].push_back(e);
    }
    std::vector<std::pair<int, int>> out;
    for (int g = 0; g < (int) layout.groups.size(); g++) {
        for (int i = 0; i < n_expert; i++) {
            for (const auto & l : layout.layers) {
                const int e = order[l.il][i];
                if (l.group == g && rules.fixed_or(l.il, e, expert_precision::high) == expert_precision::high) out.emplace_back(l.il, e);
            }
        }
    }
    return out;
}

expert_fill_stats fill_cache(expert_cache & cache, const expert_layout & layout, const tier_pools & pools, expert_reader & reader,
                             const std::vector<std::pair<int, int>> & order, const std::function<bool()> & interrupted) {
    const auto t0 = std::chrono::steady_clock::now();
    expert_fill_stats out;
    std::vector<expert_read> reads;
    for (const auto & [il, e] : order) {
        const moe_layer_layout & l = *layout.layer_at(il);
        const expert_cache::placement slot = cache.reserve(l.group, il, e, expert_precision::high, /*evict*/ false);
        if (!slot.load) continue;  // the group's tier is full
        for (expert_read & rd : reader.reads_of(l, e, expert_precision::high, pools, slot.slot)) reads.push_back(std::move(rd));
        out.experts++;
    }
    expert_layer_stats st;
    for (size_t begin = 0; begin < reads.size();) {
        if (interrupted && interrupted()) {
            cache.forget_all();
            throw fill_interrupted();
        }
        size_t end = begin;
        for (uint64_t bytes = 0; end < reads.size() && bytes < FILL_CHUNK_BYTES; end++) bytes += reads[end].size;
        const std::string error = reader.read_all(std::vector<expert_read>(reads.begin() + begin, reads.begin() + end), st);
        if (!error.empty()) {
            cache.forget_all();
            throw std::runtime_error(error);
        }
        begin = end;
    }
    out.bytes_read = st.bytes_read;
    out.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    return out;
}

expert_fill_stats fill_host_tier(host_tier & host, const expert_layout & layout, expert_reader & reader,
                                 const std::function<bool()> & interrupted) {
    expert_fill_stats filled;
    if (!host.holds_all) return filled;
    const auto t0 = std::chrono::steady_clock::now();
    // LOW first: a HIGH copy already there would count as serving the LOW demand
    std::vector<expert_precision> precisions = { expert_precision::high };
    if (layout.has_low) precisions.insert(precisions.begin(), expert_precision::low);
    for (const moe_layer_layout & l : layout.layers) {
        std::vector<expert_read> reads;
        for (expert_precision p : precisions) {
            for (int e = 0; e < layout.n_expert; e++) {
                const expert_cache::placement slot = host.cache.reserve(l.group, l.il, e, p, /*evict*/ false);
                if (!slot.load) continue;  // there already
                filled.experts++;
                for (expert_read & r : reader.reads_of(l, e, p, host.pools, -1, &host.pools, slot.slot, false, host.cpu_copies.get())) {
                    reads.push_back(std::move(r));
                }
            }
        }
        expert_layer_stats st;
        const std::string error = reader.read_all(std::move(reads), st);
        filled.bytes_read += st.bytes_read;
        if (!error.empty()) {
            host.forget();
            throw std::runtime_error(error);
        }
        if (interrupted && interrupted()) {
            host.forget();
            throw fill_interrupted();
        }
    }
    filled.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    return filled;
}

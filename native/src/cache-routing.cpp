#include "cache-routing.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace {

struct candidate {
    int expert;
    double score;  // the logit with the cache's bonus
    int row;       // the selection's row, -1: a cached expert the router did not choose
};

}  // namespace

std::vector<float> route_to_cache(int32_t * ids, float * weights, int64_t n_tokens, int k, const float * probs,
                                  int n_expert, double lambda, bool normalized, const std::function<bool(int)> & cached) {
    std::vector<float> scale((size_t) n_tokens * k, 1.0f);
    std::vector<candidate> candidates;
    std::vector<uint8_t> selected(n_expert);
    for (int64_t t = 0; t < n_tokens; t++) {
        const float * p = probs + t * n_expert;
        int32_t * id = ids + t * k;
        // an id out of range is the planner's error to report: the token is left as routed
        if (std::any_of(id, id + k, [&](int32_t e) { return e < 0 || e >= n_expert; })) continue;
        double lo = std::numeric_limits<double>::infinity(), hi = -lo;
        for (int e = 0; e < n_expert; e++) {  // an expert of probability 0 (underflow) has no logit left
            if (p[e] <= 0) continue;
            lo = std::min(lo, std::log((double) p[e]));
            hi = std::max(hi, std::log((double) p[e]));
        }
        const double bonus = hi > lo ? lambda * (hi - lo) : 0.0;
        const auto score = [&](int e) { return std::log((double) p[e]) + (cached(e) ? bonus : 0.0); };
        candidates.clear();
        std::fill(selected.begin(), selected.end(), 0);
        for (int i = 0; i < k; i++) {
            selected[id[i]] = 1;
            candidates.push_back({ id[i], p[id[i]] > 0 ? score(id[i]) : std::numeric_limits<double>::infinity(), i });
        }
        for (int e = 0; e < n_expert; e++) {
            if (!selected[e] && p[e] > 0 && cached(e)) candidates.push_back({ e, score(e), -1 });
        }
        // the top k by the biased logits; on a tie the router's own choice stays
        std::stable_sort(candidates.begin(), candidates.end(),
                         [](const candidate & a, const candidate & b) { return a.score > b.score; });
        std::vector<int> freed, taken;  // rows of dropped selections; experts taking them
        for (size_t c = 0; c < candidates.size(); c++) {
            if (c >= (size_t) k && candidates[c].row >= 0) freed.push_back(candidates[c].row);
            if (c < (size_t) k && candidates[c].row < 0) taken.push_back(candidates[c].expert);
        }
        if (taken.empty()) continue;
        std::sort(freed.begin(), freed.end());
        double old_sum = 0, new_sum = 0;
        std::vector<int32_t> old(id, id + k);
        for (size_t j = 0; j < taken.size(); j++) id[freed[j]] = taken[j];
        for (int i = 0; i < k; i++) { old_sum += p[old[i]]; new_sum += p[id[i]]; }
        for (int i = 0; i < k; i++) {
            const double own = id[i] == old[i] ? 1.0 : (double) p[id[i]] / p[old[i]];
            const double ratio = own * (normalized ? old_sum / new_sum : 1.0);
            scale[t * k + i] = (float) ratio;
            weights[t * k + i] = (float) (weights[t * k + i] * ratio);
        }
    }
    return scale;
}

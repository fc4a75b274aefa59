#include "cache-standin.h"

#include <algorithm>
#include <cmath>

int stand_in(int32_t * ids, const float * weights, int64_t n_tokens, int k, const stand_in_table & table,
             const std::function<bool(int)> & cached) {
    const int n = table.n_expert;
    std::vector<int> held;  // the cached experts, asked once
    for (int c = 0; c < n; c++) if (cached(c)) held.push_back(c);
    int swaps = 0;
    for (int64_t t = 0; t < n_tokens; t++) {
        int32_t * id = ids + t * k;
        // an id out of range is the planner's error to report: the token is left as routed
        if (std::any_of(id, id + k, [&](int32_t e) { return e < 0 || e >= n; })) continue;
        for (int i = 0; i < k; i++) {
            const int e = id[i];
            if (cached(e)) continue;
            const float w = std::fabs(weights[t * k + i]);
            int best = -1;
            double best_cost = 0;
            for (int c : held) {
                if (std::find(id, id + k, c) != id + k) continue;  // the token has it already
                const double cost = w * table.cost[(size_t) e * n + c];
                if (cost <= table.tau && (best < 0 || cost < best_cost)) best = c, best_cost = cost;
            }
            if (best >= 0) id[i] = best, swaps++;
        }
    }
    return swaps;
}

#include "cache-standin.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

std::vector<stand_in_table> stand_in_tables(const std::map<int, stand_in_costs> & layers, const std::vector<int> & moe_layers,
                                            int n_layers, int n_expert) {
    std::vector<stand_in_table> tables(n_layers);
    for (const auto & [il, table] : layers) {
        const auto & [cost, drop, tau] = table;
        if (std::find(moe_layers.begin(), moe_layers.end(), il) == moe_layers.end()) {
            throw std::invalid_argument("stand-ins: layer " + std::to_string(il) + " has no experts");
        }
        if (cost.size() != (size_t) n_expert * n_expert) {
            throw std::invalid_argument("stand-ins: layer " + std::to_string(il) + " has " + std::to_string(cost.size()) +
                                        " costs, not " + std::to_string(n_expert) + " x " + std::to_string(n_expert));
        }
        if (!drop.empty() && drop.size() != (size_t) n_expert) {
            throw std::invalid_argument("stand-ins: layer " + std::to_string(il) + " has " + std::to_string(drop.size()) +
                                        " drop costs, not " + std::to_string(n_expert));
        }
        tables[il] = { n_expert, cost, drop, tau };
    }
    return tables;
}

int stand_in(int32_t * ids, uint8_t * dropped, const float * weights, int64_t n_tokens, int k, const stand_in_table & table,
             const std::function<bool(int)> & cached) {
    const int n = table.n_expert;
    std::vector<int> held;  // the cached experts, asked once
    for (int c = 0; c < n; c++) if (cached(c)) held.push_back(c);
    int changed = 0;
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
            const double drop = table.drop.empty() ? INFINITY : w * table.drop[e];
            if (drop <= table.tau && (best < 0 || drop < best_cost)) dropped[t * k + i] = 1, changed++;
            else if (best >= 0) id[i] = best, changed++;
        }
    }
    return changed;
}

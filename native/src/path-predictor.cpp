#include "path-predictor.h"

#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <string>

void path_predictor::add(int layer, const std::vector<int> & prev2, const std::vector<int> & prev1, std::vector<float> probs) {
    if ((int) probs.size() != n_expert_) {
        throw std::invalid_argument("path statistics: layer " + std::to_string(layer) + " has " + std::to_string(probs.size()) +
                                    " probabilities for " + std::to_string(n_expert_) + " experts");
    }
    key k = { prev2, prev1 };
    std::sort(k.first.begin(), k.first.end());
    std::sort(k.second.begin(), k.second.end());
    tables_[layer][k] = std::move(probs);
}

const std::vector<float> * path_predictor::lookup(int layer, std::vector<int> prev2, std::vector<int> prev1) const {
    auto table = tables_.find(layer);
    if (table == tables_.end()) return nullptr;
    std::sort(prev2.begin(), prev2.end());
    std::sort(prev1.begin(), prev1.end());
    for (const key & k : { key{ prev2, prev1 }, key{ {}, prev1 }, key{ {}, {} } }) {
        auto it = table->second.find(k);
        if (it != table->second.end()) return &it->second;
    }
    return nullptr;
}

std::vector<int> most_probable(const std::vector<float> & probs, int n) {
    std::vector<int> ids(probs.size());
    std::iota(ids.begin(), ids.end(), 0);
    std::stable_sort(ids.begin(), ids.end(), [&](int a, int b) { return probs[a] > probs[b]; });
    ids.resize(std::min<size_t>(ids.size(), (size_t) std::max(0, n)));
    while (!ids.empty() && probs[ids.back()] <= 0) ids.pop_back();
    return ids;
}

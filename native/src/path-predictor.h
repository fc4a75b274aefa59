// EdgeMoE's expert predictor (EdgeMoE sec. 3.3.2): expert activations of consecutive layers are
// correlated, so the experts a token activated at the two MoE layers before layer L_j give the
// probability of each expert at L_j. The table is learned offline from a calibration trace
// (pyedgemoe/calibration/paths.py); here it is looked up with the same fallback: the key of both
// layers before, else of the one before, else the layer's marginal.
#pragma once

#include <map>
#include <vector>

class path_predictor {
public:
    explicit path_predictor(int n_expert) : n_expert_(n_expert) {}

    // One table entry: at `layer`, given the (sorted) sets prev2 at L_{j-2} and prev1 at L_{j-1}
    // ({} for a level not in the key), each expert's activation probability. Throws
    // std::invalid_argument for a row of other than n_expert probabilities.
    void add(int layer, const std::vector<int> & prev2, const std::vector<int> & prev1, std::vector<float> probs);
    bool empty() const { return tables_.empty(); }

    // The probabilities at layer for a token that activated prev2 and prev1 (any order) at the two
    // MoE layers before it, from the most specific key the table has; null if the layer has none.
    const std::vector<float> * lookup(int layer, std::vector<int> prev2, std::vector<int> prev1) const;

private:
    using key = std::pair<std::vector<int>, std::vector<int>>;
    int n_expert_;
    std::map<int, std::map<key, std::vector<float>>> tables_;
};

// The n most probable experts of probs (ties: lower id), none with probability 0.
std::vector<int> most_probable(const std::vector<float> & probs, int n);

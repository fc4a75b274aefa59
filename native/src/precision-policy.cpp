#include "precision-policy.h"

#include <algorithm>
#include <numeric>
#include <vector>

void selection_scores(const float * w, int n, double * scores_out, int * rank_out) {
    std::vector<int> rank(n);
    std::iota(rank.begin(), rank.end(), 0);
    std::stable_sort(rank.begin(), rank.end(), [&](int a, int b) { return w[a] > w[b]; });
    double total = 0;
    for (int i = 0; i < n; i++) total += w[i];
    double score = 0;  // s_i: normalized weight of the selections ranked above
    for (int r = 0; r < n; r++) {
        const int i = rank[r];
        scores_out[i] = score;
        if (rank_out) rank_out[r] = i;
        score += total > 0 ? w[i] / total : 0.0;
    }
}

void choose_precisions(const float * w, int n, const precision_params & params, expert_precision * out) {
    std::vector<double> score(n);
    std::vector<int> rank(n);
    selection_scores(w, n, score.data(), rank.data());
    for (int r = 0; r < n; r++) {
        const int i = rank[r];
        expert_precision p = expert_precision::high;
        if (r > 0 && score[i] > params.t1) p = score[i] > params.t2 ? expert_precision::skip : expert_precision::low;
        if (p == expert_precision::skip && !params.use_skip) p = expert_precision::low;
        if (p == expert_precision::low && !params.use_low) p = expert_precision::high;
        out[i] = p;
    }
}

const char * expert_precision_name(expert_precision p) {
    switch (p) {
        case expert_precision::high: return "high";
        case expert_precision::low:  return "low";
        default:                     return "skip";
    }
}

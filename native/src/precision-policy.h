// Which precision an expert selection gets on a cache miss: HOBBIT's token-level dynamic loading
// (HOBBIT sec. 3.2, eq. 2). A policy is data (thresholds, switches) plus one decision function.
#pragma once

#include <cstdint>

// Ordered: a cached copy of a higher precision serves a lower demand.
enum class expert_precision : int8_t { skip = 0, low = 1, high = 2 };

// The defaults are the options' (expert-options.h).
struct precision_params {
    double t1;       // HIGH while the score s_i <= t1
    double t2;       // LOW while t1 < s_i <= t2, SKIP above
    bool use_low;    // false: what would be LOW is HIGH
    bool use_skip;   // false: what would be SKIP is LOW (or HIGH without LOW)
};

// Each of one token's n selections' score from their routing weights w (any positive scale;
// normalized here): ranked by weight (ties: earlier position first), s_0 = 0 and s_i = the sum of
// the normalized weights ranked above i. rank_out (optional): the selections in rank order.
void selection_scores(const float * w, int n, double * scores_out, int * rank_out = nullptr);

// The demand for each of one token's n selections: by its score, the top-1 always HIGH.
void choose_precisions(const float * w, int n, const precision_params & params, expert_precision * out);

const char * expert_precision_name(expert_precision p);

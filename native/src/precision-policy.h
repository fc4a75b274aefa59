// Which precision an expert selection gets on a cache miss: HOBBIT's token-level dynamic loading
// (HOBBIT sec. 3.2, eq. 2). A policy is data (thresholds, switches) plus one decision function.
#pragma once

#include <cstdint>

// Ordered: a cached copy of a higher precision serves a lower demand.
enum class expert_precision : int8_t { skip = 0, low = 1, high = 2 };

struct precision_params {
    double t1 = 0.6;         // HIGH while the score s_i <= t1
    double t2 = 0.9;         // LOW while t1 < s_i <= t2, SKIP above
    bool  use_low  = false;  // false: what would be LOW is HIGH
    bool  use_skip = false;  // false: what would be SKIP is LOW (or HIGH without LOW)
};

// The demand for each of one token's n selections, given their routing weights w (any positive
// scale; normalized here). Ranked by weight (ties: earlier position first), s_0 = 0 and
// s_i = sum of the normalized weights ranked above i; the top-1 selection is always HIGH.
void choose_precisions(const float * w, int n, const precision_params & params, expert_precision * out);

const char * expert_precision_name(expert_precision p);

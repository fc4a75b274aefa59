// Cache-aware routing: Cache-Prior of "Mixture of Cache-Conditional Experts for Efficient Mobile
// Device Inference" (Skliar et al., arXiv 2412.00099, sec. 4). Before top-k, the router's logits of
// the experts the cache holds get a bonus λ·Δ, Δ the spread of the token's logits (max - min), so a
// cached expert whose score is close to an uncached one's takes its place. The chosen experts keep
// their own probabilities as weights, normalized over the new choice where the model normalizes its
// top-k. Training-free and lossy (λ = 0: the router's own choice). A pure function of one layer's
// routing and what is cached: the runtime calls it before planning the layer, tests call it directly.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

// ids, weights: [n_tokens][k], the router's selections and the graph's routing weights, rewritten in
// place: a dropped selection's row takes a cached expert, its weight that expert's (the model's
// normalization over the new choice). probs: [n_tokens][n_expert], the router's probabilities the
// graph takes its weights from; their logarithms are the logits up to a per-token constant (softmax),
// which neither the ranking nor Δ sees. normalized: the model normalizes its top-k weights.
// cached(e): a copy of expert e serves it now. Returns each selection's weight over the graph's
// (1 where unchanged). A selection of probability 0 (underflow) stays: its weight cannot be rescaled;
// Δ is the spread of the positive probabilities' logarithms.
std::vector<float> route_to_cache(int32_t * ids, float * weights, int64_t n_tokens, int k, const float * probs,
                                  int n_expert, double lambda, bool normalized, const std::function<bool(int)> & cached);

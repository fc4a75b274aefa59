// A MoE layer's routing as its op receives it: the expert ids always, the routing weights only
// where something reads them. On a device each src of the op is one more copy to the host (and a
// synchronization) a layer; the weights are read by mixed precision and skips, MoBiLE's little
// pass, cache routing, stand-ins and a routing trace.
#pragma once

#include "layer-planner.h"

#include <cstdint>
#include <vector>

struct ggml_tensor;

// whether the op takes the routing weights; big_little: MoBiLE's little pass may run; tracing: a
// routing trace is recorded (it and stand-ins are switched on at run time: moe_graph_changed)
bool reads_weights(const layer_rules & rules, bool big_little, bool tracing);

struct layer_routing {
    std::vector<int32_t> ids;   // [n_tokens][k]
    std::vector<float> weights; // [n_tokens][k]; 0 where the op was not given them (nothing reads them)
};
// ids [k, n_tokens] (I32), weights [1, k, n_tokens] (F32) or null
layer_routing read_routing(const ggml_tensor * ids, const ggml_tensor * weights);

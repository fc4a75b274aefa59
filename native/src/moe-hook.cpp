#include "moe-hook.h"

#include "llama-context.h"
#include "llama-graph.h"

#include <algorithm>
#include <mutex>
#include <unordered_map>

namespace {

struct hooked_layer {
    moe_pass_builder * builder;
    int il;
};

std::mutex g_mutex;
std::unordered_map<const ggml_tensor *, hooked_layer> g_layers;  // by any stacked tensor
std::unordered_map<const moe_pass_builder *, uint32_t> g_extra_nodes;  // by builder

// llama.cpp reserves the most nodes any live builder adds (call with g_mutex held)
void update_extra_nodes() {
    uint32_t most = 0;
    for (const auto & [builder, n] : g_extra_nodes) most = std::max(most, n);
    llama_moe_expert_extra_nodes = most;
}

// the layer whose passes the current thread is building (pass > 0 sees our pools, not the model's tensors)
thread_local const hooked_layer * t_building = nullptr;

bool hook(ggml_context * ctx, int il, int pass, ggml_tensor * moe_input, ggml_tensor * weights, ggml_tensor * previous,
          llama_moe_expert_pass * p) {
    if (pass == 0) {
        const ggml_tensor * key = p->down_exps ? p->down_exps : (p->gate_up_exps ? p->gate_up_exps : p->up_exps);
        std::lock_guard<std::mutex> lock(g_mutex);
        auto it = g_layers.find(key);
        t_building = it == g_layers.end() ? nullptr : &it->second;
    }
    if (!t_building) return false;
    GGML_ASSERT(t_building->il == il || il < 0);
    return t_building->builder->build_pass(t_building->il, ctx, pass, moe_input, weights, previous, p);
}

}  // namespace

moe_hook_registration::moe_hook_registration(moe_pass_builder & builder,
                                             const std::vector<std::pair<const ggml_tensor *, int>> & tensors,
                                             uint32_t extra_nodes)
    : builder_(&builder) {
    std::lock_guard<std::mutex> lock(g_mutex);
    for (const auto & [t, il] : tensors) g_layers[t] = { builder_, il };
    g_extra_nodes[builder_] = extra_nodes;
    update_extra_nodes();
    llama_moe_expert_hook = &hook;
}

moe_hook_registration::~moe_hook_registration() {
    std::lock_guard<std::mutex> lock(g_mutex);
    for (auto it = g_layers.begin(); it != g_layers.end();) {
        if (it->second.builder == builder_) it = g_layers.erase(it); else ++it;
    }
    g_extra_nodes.erase(builder_);
    update_extra_nodes();
}

void moe_graph_changed() { llama_moe_expert_graph_epoch++; }

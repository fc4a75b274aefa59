#include "moe-hook.h"

#include "expert-residency.h"

#include "llama-graph.h"

#include <mutex>
#include <unordered_map>

namespace {

std::mutex g_mutex;
std::unordered_map<const ggml_tensor *, expert_residency::layer *> g_layers;  // by any stacked tensor

int hook(ggml_context * ctx, int il, ggml_tensor * moe_input, ggml_tensor * weights, llama_moe_expert_pass * passes) {
    const llama_moe_expert_pass & p = passes[0];
    const ggml_tensor * key = p.down_exps ? p.down_exps : (p.gate_up_exps ? p.gate_up_exps : p.up_exps);
    expert_residency::layer * l = nullptr;
    {
        std::lock_guard<std::mutex> lock(g_mutex);
        auto it = g_layers.find(key);
        if (it == g_layers.end()) return 1;
        l = it->second;
    }
    GGML_ASSERT(l->il == il || il < 0);
    return l->owner->build_layer(*l, ctx, moe_input, weights, passes);
}

}  // namespace

void moe_hook_register(expert_residency * residency) {
    std::lock_guard<std::mutex> lock(g_mutex);
    for (const auto & l : residency->layers()) {
        for (const ggml_tensor * t : l->stacked) {
            if (t) g_layers[t] = l.get();
        }
    }
    llama_moe_expert_hook = &hook;
}

void moe_hook_unregister(expert_residency * residency) {
    std::lock_guard<std::mutex> lock(g_mutex);
    for (auto it = g_layers.begin(); it != g_layers.end();) {
        if (it->second->owner == residency) it = g_layers.erase(it); else ++it;
    }
}

#include "moe-hook.h"

#include "expert-residency.h"

#include "llama-graph.h"

#include <mutex>
#include <unordered_map>

namespace {

std::mutex g_mutex;
std::unordered_map<const ggml_tensor *, expert_residency::layer *> g_layers;  // by any stacked tensor

void hook(ggml_context * ctx, int il, ggml_tensor ** up, ggml_tensor ** gate, ggml_tensor ** down,
          ggml_tensor ** gate_up, ggml_tensor ** ids) {
    const ggml_tensor * key = *down ? *down : (*gate_up ? *gate_up : *up);
    expert_residency::layer * l = nullptr;
    {
        std::lock_guard<std::mutex> lock(g_mutex);
        auto it = g_layers.find(key);
        if (it == g_layers.end()) return;
        l = it->second;
    }
    GGML_ASSERT(l->il == il || il < 0);
    l->owner->build_layer(*l, ctx, up, gate, down, gate_up, ids);
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

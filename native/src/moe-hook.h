// The only part of the layer that patched llama.cpp calls (patch 0002: llama_moe_expert_hook in
// build_moe_ffn). A process-wide registry maps a model's stacked expert tensors to the builder
// that serves their layer; tensors of other models pass through untouched.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

struct ggml_context;
struct ggml_tensor;
struct llama_moe_expert_pass;

// What the hook asks of the owner of a model's experts while a graph is built.
struct moe_pass_builder {
    virtual ~moe_pass_builder() = default;
    // Fills in pass `pass` of layer il's expert FFN and returns true, or false when there is none
    // (the contract of llama_moe_expert_hook_t in patch 0002).
    virtual bool build_pass(int il, ggml_context * ctx, int pass, ggml_tensor * moe_input, ggml_tensor * weights,
                            ggml_tensor * previous, llama_moe_expert_pass * p) = 0;
};

// While it lives, the hook sends the layers whose stacked expert tensors are given (each with its
// layer) to builder; extra_nodes: the most graph nodes its passes add to a graph (llama.cpp reserves
// the largest of the live registrations').
class moe_hook_registration {
public:
    moe_hook_registration(moe_pass_builder & builder, const std::vector<std::pair<const ggml_tensor *, int>> & tensors,
                          uint32_t extra_nodes);
    ~moe_hook_registration();
    moe_hook_registration(const moe_hook_registration &) = delete;
    moe_hook_registration & operator=(const moe_hook_registration &) = delete;

private:
    moe_pass_builder * builder_;
};

// What a builder puts in a graph changed (its op reads another tensor): llama.cpp builds the next
// ubatch's graph anew rather than reuse one of the same shape (patch 0002's graph epoch).
void moe_graph_changed();

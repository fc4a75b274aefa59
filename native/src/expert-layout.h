// Where a model's routed experts are: per MoE layer its stacked expert tensors (the model's
// on-demand tensors) and the file and offset of their HIGH copies and, with mixed precision, of
// their LOW copies (a GGUF split into shards: gguf-shards.h); and the groups of layers whose
// experts have the same shapes and the same device (they share slot pools).
#pragma once

#include "expert-format.h"
#include "slot-pool.h"

#include <array>
#include <cstdint>
#include <string>
#include <vector>

struct llama_model;

struct moe_layer_layout {
    int il = -1;
    int group = -1;                                         // index into expert_layout::groups
    std::array<const ggml_tensor *, PROJ_COUNT> stacked{};  // the model's tensors (null: no such projection)
    struct file_place {
        int file = 0;         // index into expert_layout::high_files / low_files
        uint64_t offset = 0;  // of expert 0's copy in that file (expert e's follows e copies later)
    };
    std::array<file_place, PROJ_COUNT> high_at{};  // where expert 0's HIGH copy is
    std::array<file_place, PROJ_COUNT> low_at{};   // its LOW copy, in the LOW source
};

// Layers whose experts have the same types and shapes in both precisions, on the same device.
struct expert_group {
    expert_shapes high, low;  // low: all absent without LOW copies
    int n_layers = 0;
    int home = 0;             // the device of its layers: an index into the devices the layout was given
};

struct expert_layout {
    // The stacked expert tensors of model, loaded from path with experts on demand, and, with
    // want_low (and top-k > 1: the top-1 is always HIGH), their LOW copies: low_from's standard
    // tensors, or path's own LOW copies when low_from is "". Throws std::runtime_error naming what
    // is missing or unsupported. devices: those the model's layers are on (-dev); a layer's group
    // is homed on its layer's device, on the first where its layer is on none of them (the CPU).
    expert_layout(const llama_model * model, const std::string & path, bool want_low, const std::string & low_from,
                  const std::vector<ggml_backend_dev_t> & devices = {});

    std::vector<moe_layer_layout> layers;  // ascending il
    std::vector<expert_group> groups;
    int n_expert = 0, n_expert_used = 0;
    int n_layers = 0;  // the last MoE layer's il + 1
    bool has_low = false;
    bool has_expert_bias = false;  // *_exps.bias tensors, which the FFN adds by expert id to every row
    // why the FFN needs the router's own choice of experts ("" where another choice computes as well):
    // tensors it indexes by expert id (biases, per-expert scales), or weights applied before it
    std::string fixed_routing;
    std::string low_source;        // the file of the LOW copies ("" without; a split GGUF's first shard)
    std::vector<std::string> high_files, low_files;  // the files (shards) of the HIGH and LOW copies
    uint64_t high_bytes = 0, low_bytes = 0;  // of all experts, per precision

    const moe_layer_layout * layer_at(int il) const;  // null for a layer without experts
    std::vector<int> moe_layers() const;                // the MoE layers' il, ascending
    std::vector<int> group_of_layers() const;           // per il: its group (-1: a layer without experts)
    std::vector<std::vector<int>> layers_of_groups() const;  // per group: its MoE layers' il, ascending
    // the MoE layer after l (one of layers), or null for the last
    const moe_layer_layout * after(const moe_layer_layout & l) const {
        return &l + 1 == layers.data() + layers.size() ? nullptr : &l + 1;
    }
};

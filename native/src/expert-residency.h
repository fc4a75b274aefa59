// The expert-residency layer of one model: experts stay in the GGUF file; a byte-budgeted cache of
// them lives in slot pools; the custom op in each MoE layer makes sure the experts a ubatch routes
// to are in slots (loading misses synchronously) and hands mul_mat_id their slot ids.
#pragma once

#include "cache-policy.h"
#include "expert-store.h"
#include "loader.h"
#include "slot-pool.h"
#include "stats.h"

#include <array>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <mutex>
#include <string>
#include <vector>

struct llama_model;

struct expert_residency_params {
    uint64_t    budget_bytes = 0;
    expert_io   io = expert_io::direct;
    int         io_threads = 1;
    std::string cache_policy = "lru";
};

// A budget below the minimum (per group of same-shaped layers, one token's top-k experts).
struct expert_budget_error : std::invalid_argument {
    using std::invalid_argument::invalid_argument;
};

class expert_residency {
public:
    // One MoE layer: where its experts are in the file and which pool group caches them.
    struct layer {
        expert_residency * owner = nullptr;
        int il = -1;
        int group = -1;
        std::array<const ggml_tensor *, PROJ_COUNT> stacked{};  // the model's (on-demand) tensors
        std::array<uint64_t, PROJ_COUNT> file_offset{};         // of expert 0
    };

    // Finds the stacked expert tensors of model (loaded from path with experts on demand), sizes
    // and allocates the pools for the budget. Throws expert_budget_error (the minimum in the
    // message) when the budget is below the minimum, std::runtime_error on other failures.
    expert_residency(llama_model * model, const std::string & path, const expert_residency_params & params);
    ~expert_residency();

    // called by the hook while a graph is built: swaps tensors and ids for layer il
    void build_layer(layer & l, ggml_context * ctx, ggml_tensor ** up, ggml_tensor ** gate, ggml_tensor ** down,
                     ggml_tensor ** gate_up, ggml_tensor ** ids);
    // the custom op: ids [n_used, n_tokens] (expert ids) -> dst (slot ids), loading misses
    void place_experts(layer & l, const ggml_tensor * ids, ggml_tensor * dst);

    // the first load error since the last call ("" if none); the cache is emptied after an error
    std::string take_error();

    uint64_t budget_bytes() const { return budget_bytes_; }
    uint64_t pool_bytes() const;
    uint64_t minimum_bytes() const { return minimum_bytes_; }
    uint64_t expert_bytes() const { return expert_bytes_total_; }
    int      n_expert() const { return n_expert_; }
    int      n_expert_used() const { return n_expert_used_; }
    // most tokens per ubatch whose experts are sure to fit one layer's share of slots; 0 = no limit
    int      max_ubatch_tokens() const { return max_ubatch_tokens_; }
    expert_io io() const { return store_->io(); }
    const char * policy_name() const { return policies_.empty() ? "" : policies_[0]->name(); }
    int      io_threads() const { return io_threads_; }

    std::vector<std::pair<int, expert_layer_stats>> layer_stats() const;  // (il, counters)
    uint64_t resident_experts() const;
    void     reset_stats();

    const std::vector<std::unique_ptr<layer>> & layers() const { return layers_; }

private:
    void load_misses(const layer & l, const std::vector<std::pair<int, int>> & slot_expert, expert_layer_stats & st);

    std::unique_ptr<expert_store> store_;
    std::unique_ptr<loader_threads> loaders_;                 // io_threads - 1 workers + the op's thread
    std::vector<std::unique_ptr<layer>> layers_;
    std::vector<std::unique_ptr<slot_pool>> pools_;            // per group
    std::vector<std::unique_ptr<cache_policy>> policies_;      // per group
    std::vector<expert_layer_stats> stats_;                    // per il
    mutable std::mutex mutex_;                                 // stats_ and error_
    std::string error_;
    bool failed_ = false;
    uint64_t budget_bytes_ = 0, minimum_bytes_ = 0, expert_bytes_total_ = 0;
    int n_expert_ = 0, n_expert_used_ = 0, max_ubatch_tokens_ = 0, io_threads_ = 1;
};

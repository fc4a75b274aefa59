// The expert-residency layer of one model: experts stay in the GGUF file; a byte-budgeted cache of
// them lives in slot pools, in HIGH and (with mixed precision) LOW precision; the custom op in each
// MoE layer decides each selection's precision (precision-policy.h), makes sure the experts a
// ubatch routes to are in slots (loading misses synchronously) and hands mul_mat_id slot ids, one
// id tensor per precision pass.
#pragma once

#include "cache-policy.h"
#include "expert-cache.h"
#include "expert-store.h"
#include "loader.h"
#include "precision-policy.h"
#include "predictor.h"
#include "prefetcher.h"
#include "slot-pool.h"
#include "stats.h"

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <map>
#include <vector>

struct llama_model;

struct expert_residency_params {
    uint64_t    budget_bytes = 0;
    double      low_fraction = 0.25;      // share of the budget for the LOW tier (with precision.use_low)
    expert_io   io = expert_io::direct;
    int         io_threads = 1;
    std::string cache_policy = "lru";
    policy_weights cache_weights = kDefaultHobbitWeights;  // for the "hobbit" policy
    precision_params precision;          // all HIGH unless use_low / use_skip
    bool        low_serves_high = true;  // a cached LOW copy serves a HIGH demand (else reload HIGH)
    std::string low_from;                // LOW copies from this standard GGUF; "" = the model's *.lowbit
    std::string prefetch = "none";       // none, hobbit (HOBBIT sec. 3.3) or fate (Fate's over-prefetch)
    int         prefetch_depth = 2;      // p: MoE layers ahead the predictor looks
    double      fate_percentile = 0.75;  // fate: also prefetch experts whose predicted probability is in the
    int         fate_extra = -1;         //   top (1 - this) of the next layer's, at most fate_extra more (-1: k)
};

// A budget below the minimum (per group of same-shaped layers, one token's top-k experts).
struct expert_budget_error : std::invalid_argument {
    using std::invalid_argument::invalid_argument;
};

// One decode step's routing at one layer, for calibration: ubatch index, layer, and per token the
// top-k expert ids and routing weights.
struct routing_trace {
    std::vector<int32_t> ubatch, layer;  // per (token, layer) record
    std::vector<int32_t> ids;            // n_expert_used per record
    std::vector<float>   weights;        // n_expert_used per record
    std::vector<int32_t> predicted;      // n_expert_used per record: the predictor's guess one layer
                                         // earlier (-1: none, e.g. the first MoE layer)
};

class expert_residency {
public:
    struct layer;
    struct wave_op {  // one wave's custom op in a layer's graph
        layer * l;
        int wave;
    };
    // One MoE layer: where its experts are in the file(s) and which pool group caches them.
    struct layer {
        expert_residency * owner = nullptr;
        int il = -1;
        int group = -1;
        std::array<const ggml_tensor *, PROJ_COUNT> stacked{};  // the model's (on-demand) tensors
        std::array<uint64_t, PROJ_COUNT> file_offset{};         // HIGH copy of expert 0
        std::array<uint64_t, PROJ_COUNT> low_offset{};          // LOW copy of expert 0 (in the LOW store)
        std::vector<wave_op> wave_ops;                   // the custom ops' userdata, per wave
        // while its graph is built (build_pass)
        ggml_tensor * building_ids = nullptr, * building_slot_ids = nullptr;
        int building_waves = 0;
    };


    // Finds the stacked expert tensors of model (loaded from path with experts on demand) and, for
    // mixed precision, their LOW copies; sizes and allocates the pools for the budget. Throws
    // expert_budget_error (the minimum in the message) when the budget is below the minimum,
    // std::runtime_error on other failures.
    expert_residency(llama_model * model, const std::string & path, const expert_residency_params & params);
    ~expert_residency();

    // called by the hook while a graph is built (patch 0002): fills in pass `pass` of layer l's
    // expert FFN and returns true, or false when there is none. A ubatch runs n_waves(l, n_tokens)
    // waves of one pass per precision; `previous` (the sum of the passes before) orders the waves.
    bool build_pass(layer & l, ggml_context * ctx, int pass, ggml_tensor * moe_input, ggml_tensor * weights,
                    ggml_tensor * previous, struct llama_moe_expert_pass * p);
    // the custom op of a wave: ids [n_used, n_tokens] (expert ids), weights and (wave 0, with
    // prediction) the predicted router logits of the layers ahead -> dst [n_used, n_tokens,
    // n_passes] (slot ids per precision pass, -1 where a pass does not compute a selection, or
    // another wave does), loading misses; after wave 0, predictions and prefetches
    void place_experts(layer & l, int wave, const ggml_tensor * ids, const ggml_tensor * weights,
                       const ggml_tensor * predicted, ggml_tensor * dst);
    // Before the first token: reads HIGH copies into the free slots of the HIGH tier (the LOW tier
    // fills as LOW demands come: a LOW copy read ahead would serve HIGH demands in LOW). A group's
    // slots go round-robin over its layers, so each layer gets about the same number; each layer's
    // experts come in ranking[il]'s order (most routed first; ids missing from it follow by id).
    // Throws std::runtime_error on a read error, after emptying the cache.
    expert_fill_stats fill(const std::map<int, std::vector<int>> & ranking);
    const expert_fill_stats & fill_stats() const { return fill_stats_; }
    // the first load error since the last call ("" if none); the cache is emptied after an error
    std::string take_error();
    // a new sequence (the KV cache was cleared): the policies' per-sequence records restart
    void start_sequence();

    uint64_t budget_bytes() const { return budget_bytes_; }
    uint64_t pool_bytes(expert_precision p) const;
    int      pool_slots(expert_precision p) const;  // summed over groups
    uint64_t minimum_bytes() const { return minimum_bytes_; }
    uint64_t expert_bytes() const { return expert_bytes_total_; }
    uint64_t low_expert_bytes() const { return low_expert_bytes_total_; }
    int      n_expert() const { return n_expert_; }
    int      n_expert_used() const { return n_expert_used_; }
    int      n_layers() const { return n_layers_; }
    // most tokens per ubatch whose experts are sure to fit one layer's share of slots; 0 = no limit
    int      max_ubatch_tokens() const { return max_ubatch_tokens_; }
    expert_io io() const { return store_->io(); }
    const char * policy_name() const { return cache_->policy_name(); }
    int      io_threads() const { return io_threads_; }
    bool     mixed_precision() const { return cache_->has_low(); }
    const precision_params & precision() const { return params_.precision; }
    const std::string & low_source() const { return low_source_; }

    std::vector<std::pair<int, expert_layer_stats>> layer_stats() const;  // (il, counters)
    std::vector<std::pair<int, expert_prefetch_stats>> prefetch_stats() const;  // (il, counters)
    double   prefetch_busy_ms() const;  // wall time with prefetch reads in flight
    std::vector<expert_prediction_stats> prediction_stats() const;  // per depth 1..p
    const std::string & prefetch_mode() const { return params_.prefetch; }
    int prefetch_depth() const { return predictor_ ? predictor_->depth() : 0; }
    uint64_t resident_experts() const;
    void     reset_stats();

    void set_tracing(bool on);
    routing_trace take_trace();

    const std::vector<std::unique_ptr<layer>> & layers() const { return layers_; }

private:
    // (expert, precision) of a cached copy: a pin or a read in flight is about this
    using cached_copy = std::pair<expert_key, expert_precision>;
    struct cached_copy_hash {
        size_t operator()(const cached_copy & c) const { return std::hash<expert_key>()(c.first) * 3 + (size_t) c.second; }
    };

    void fail(const std::string & why, ggml_tensor * dst);
    // waves of experts one ubatch needs at most in layer l: its distinct experts over the HIGH tier
    int n_waves(const layer & l, int64_t n_tokens) const;
    // wave 0 of a layer: settles the layer before (pins, prefetches, predictions), decides the
    // selections' precisions and splits the distinct experts into waves (wave_plan_)
    bool begin_layer(const layer & l, const ggml_tensor * ids, const ggml_tensor * weights, ggml_tensor * dst);
    // places, loads and pins one wave's experts and writes their slot ids; false after a failure
    bool serve_wave(const layer & l, int wave, const ggml_tensor * ids, ggml_tensor * dst,
                    std::chrono::steady_clock::time_point t0);
    // whether a copy of (il, expert) that serves `demand` is cached, and in which tier
    bool serving_tier(int il, int expert, expert_precision demand, expert_precision * tier) const;
    // reads on the loader threads; the first error ("" if none)
    std::string read_all(const std::vector<expert_read> & reads, expert_layer_stats & st);
    std::vector<expert_read> reads_of(const layer & l, int expert, expert_precision precision, int slot) const;
    // after a layer's experts are placed: predictions of the layers ahead, prefetches (one token)
    void predict_and_prefetch(const layer & l, const ggml_tensor * predicted, int64_t n_tokens);
    void count_prediction(const layer & l, const ggml_tensor * ids);
    void collect_finished_prefetches();
    void drop_prefetches();  // cancels queued reads, waits for the running one, frees their slots
    void record_trace(const layer & l, const ggml_tensor * ids, const ggml_tensor * weights);

    expert_residency_params params_;
    std::unique_ptr<expert_store> store_, low_store_;
    std::unique_ptr<loader_threads> loaders_;                 // io_threads - 1 workers + the op's thread
    std::vector<std::unique_ptr<layer>> layers_;
    std::vector<std::unique_ptr<slot_pool>> high_pools_, low_pools_;  // per group
    std::unique_ptr<expert_cache> cache_;
    std::unique_ptr<expert_predictor> predictor_;              // with prefetch or tracing
    std::vector<int> group_of_;                                // per il, -1: not a MoE layer
    std::vector<const layer *> layer_at_;                      // per il, null: not a MoE layer
    std::vector<expert_layer_stats> stats_;                    // per il
    std::vector<expert_prefetch_stats> prefetch_stats_;        // per il (the layer prefetched for)
    std::vector<expert_prediction_stats> prediction_stats_;    // per depth - 1
    // op thread only: reads in flight, pins, predictions waiting for their layer
    std::unordered_map<cached_copy, std::shared_ptr<prefetch_job>, cached_copy_hash> in_flight_;
    std::unordered_set<cached_copy, cached_copy_hash> prefetched_unused_;
    std::map<int, std::vector<cached_copy>> predicted_pins_;   // by target layer
    std::vector<cached_copy> current_pins_;                    // the experts the running wave uses
    std::vector<std::vector<std::pair<int, expert_precision>>> wave_plan_;  // the running layer's waves
    std::map<int, std::vector<std::vector<int32_t>>> predictions_;  // by target layer: [depth-1][token*k]
    mutable std::mutex mutex_;                                 // stats_, trace_ and error_
    std::string error_;
    bool failed_ = false;
    std::atomic<bool> tracing_{false};
    routing_trace trace_;
    expert_fill_stats fill_stats_;
    int32_t ubatch_index_ = 0;
    std::string low_source_;
    uint64_t budget_bytes_ = 0, minimum_bytes_ = 0, expert_bytes_total_ = 0, low_expert_bytes_total_ = 0;
    int n_expert_ = 0, n_expert_used_ = 0, n_layers_ = 0, first_il_ = 0, max_ubatch_tokens_ = 0, io_threads_ = 1;
    bool has_expert_bias_ = false;
    std::unique_ptr<prefetcher> prefetcher_;  // last: stopped first, before the pools it writes to
};

// The expert-residency layer of one model, the front the bindings use: experts stay in the GGUF
// file; a byte-budgeted cache of them lives in slot pools, in HIGH and (with mixed precision) LOW
// precision. In each MoE layer a custom op plans the ubatch's experts (layer-planner.h), makes
// sure they are in slots (loading misses, claiming prefetches) and hands mul_mat_id slot ids.
// The parts: expert-layout (where experts are), expert-budget (slots per tier and group, the
// pools), expert-reads (bytes into slots), expert-cache (which slot holds what), layer-planner
// (demands and waves), tier-passes (the passes of a wave and their slot ids), prefetch-strategy
// (what to read ahead, a file per strategy), prefetch-coordinator (pins and reads in flight),
// cache-fill, host-tier, routing-recorder (prediction telemetry, traces), moe-hook (how llama.cpp
// reaches us). expert-residency.cpp wires them.
//
// With a GPU (modes gpu and coop, HOBBIT sec. 4) the pools are in the device's memory and a host
// tier of RAM (its own cache, both precisions, LRU) sits between the file and the device.
// gpu: a device miss is uploaded, from the host tier when there, else read into it first. coop: a
// device miss is computed on the CPU from its host copy, in passes of their own; the device cache
// changes only by fill and prefetch.
#pragma once

#include "cache-standin.h"
#include "expert-options.h"
#include "stats.h"

#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

struct llama_model;

// Where the experts' memory is: the ggml devices of the device pools (none: host memory, mode cpu)
// and the host tier's byte budget (0: none; uploads then go through a staging buffer).
struct expert_device_config {
    // the devices the model's layers are on (-dev A,B): each layer's experts are cached on its
    // layer's device (on the first, for a layer on the CPU); the host tier is the first's
    std::vector<std::string> devices;
    uint64_t host_bytes = 0;
    int n_threads = 1;    // the CPU's threads, for --mode auto's measurement
    bool repack = true;   // host pools repack as the model's weights do (its use_extra_bufts)
};

// What a residency is, once built (the options in effect aside).
struct expert_residency_info {
    uint64_t budget_bytes = 0, minimum_bytes = 0;
    uint64_t high_pool_bytes = 0, low_pool_bytes = 0;
    int high_slots = 0, low_slots = 0;        // summed over groups
    uint64_t expert_bytes = 0, low_expert_bytes = 0;
    int n_expert = 0, n_expert_used = 0, n_layers = 0;
    int max_ubatch_tokens = 0;                // most tokens per ubatch (expert biases); 0 = no limit
    expert_io io = expert_io::direct;         // in effect (O_DIRECT falls back where refused)
    bool mixed_precision = false;
    std::string low_source;
    int predictor_depth = 0;                  // layers the predictor looks ahead (0: no predictor)
    std::vector<std::pair<std::string, uint64_t>> device_pool_bytes;  // per device of the pools (none: host memory)
    uint64_t host_pool_bytes = 0;             // the host tier
    int host_high_slots = 0, host_low_slots = 0;
    std::string mode_reason;                  // --mode auto: what it measured and chose
};

// The fill reads in chunks of this many bytes, asking between them whether to stop (Ctrl-C).
constexpr uint64_t FILL_CHUNK_BYTES = 8ull << 20;  // a few ms of an NVMe drive
struct fill_interrupted : std::exception {
    const char * what() const noexcept override { return "the expert cache fill was interrupted"; }
};

class expert_residency {
public:
    // Finds model's stacked expert tensors (loaded from path with experts on demand) and, for
    // mixed precision, their LOW copies; sizes and allocates the pools for budget_bytes. With
    // trace_routing the predictor runs even without prefetch, for calibration's traces. Throws
    // expert_budget_error (the minimum in the message) when the budget is below the minimum or
    // more than the device has free, std::invalid_argument for bad options, std::runtime_error on
    // other failures.
    expert_residency(llama_model * model, const std::string & path, uint64_t budget_bytes,
                     const expert_options & options, bool trace_routing, const expert_device_config & device = {});
    ~expert_residency();

    // Before the first token: reads HIGH copies into the free slots of the HIGH tier (the LOW tier
    // fills as LOW demands come: a LOW copy read ahead would serve HIGH demands in LOW). A group's
    // slots go round-robin over its layers; each layer's experts come in ranking[il]'s order (most
    // routed first; ids missing from it follow by id). Throws std::runtime_error on a read error,
    // after emptying the cache.
    // interrupted() is asked between reads of FILL_CHUNK_BYTES: true stops the fill (the cache
    // is emptied) and it throws fill_interrupted.
    expert_fill_stats fill(const std::map<int, std::vector<int>> & ranking,
                           const std::function<bool()> & interrupted = {});
    // Before the first token, where the host tier holds every expert copy: reads them all into it
    // (fill_host_tier, cache-fill.h; interrupted as for fill). Nothing without a host tier.
    expert_fill_stats fill_host(const std::function<bool()> & interrupted = {});
    // The same fill in the background: it starts now and goes on, io_threads reads at a time, as
    // the layers of the prompt and of the next tokens run (fill_stats counts what it has read).
    void fill_in_background(const std::map<int, std::vector<int>> & ranking);
    const expert_fill_stats & fill_stats() const;
    // the first load error since the last call ("" if none); the cache is emptied after an error
    std::string take_error();
    // a new sequence (the KV cache was cleared): the policies' per-sequence records restart
    void start_sequence();

    const expert_options & options() const;  // in effect
    const expert_residency_info & info() const;
    std::vector<std::pair<int, expert_layer_stats>> layer_stats() const;       // (il, counters)
    std::vector<std::pair<int, expert_prefetch_stats>> prefetch_stats() const;  // (il, counters)
    double prefetch_busy_ms() const;  // wall time with prefetch reads in flight
    prefetch_phase decode_prefetch() const;  // reading, held or stopped for good (stats.h)
    std::vector<expert_prediction_stats> prediction_stats() const;  // per depth 1..p
    double link_share() const;  // split: the share of a decode token's misses uploaded now (link-balance.h); else 0
    uint64_t resident_experts() const;
    void reset_stats();

    void set_tracing(bool on, bool inputs = false);
    routing_trace take_trace();

    // EdgeMoE's static precision map: the experts listed (per il) only ever in LOW, the others only
    // in HIGH (used while options().static_precision). Empties the cache. Throws
    // std::invalid_argument without LOW copies or for an expert that does not exist.
    void set_precision_map(const std::map<int, std::vector<int>> & low);
    // The calibrated stand-ins (cache-standin.h) per MoE layer: its costs, drop costs and tau.
    void set_stand_ins(const std::map<int, stand_in_costs> & layers);
    // EdgeMoE's path statistics (prefetch edgemoe): (layer, prev2, prev1, probabilities) entries
    // of path-predictor.h. Throws std::invalid_argument for a row of the wrong length.
    using path_entry = std::tuple<int, std::vector<int>, std::vector<int>, std::vector<float>>;
    void set_path_statistics(const std::vector<path_entry> & entries);
    // MoBiLE: while on, a decode token (a one-token ubatch) computes only its top-k/2 experts,
    // renormalized where the model normalizes its top-k weights
    void set_little(bool on);
    // while on, a batch of several tokens is decode steps (several sequences', or a speculative guess
    // checked), not a prompt's: the prompt's rule (prefill_low_share) does not apply to it
    void set_decode_batch(bool on);
    // MoBiLE's fallback: prefetches the whole top-k that the last little token's routers chose, in
    // every layer, for the big pass that redoes it; returns how many (expert, layer) were asked for
    int prefetch_big();

    struct impl;

private:
    std::unique_ptr<impl> impl_;
};

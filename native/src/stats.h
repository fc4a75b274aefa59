// Expert-residency counters, per layer: what the cache saw and what it cost.
#pragma once

#include <cstdint>
#include <vector>

struct expert_layer_stats {
    // distinct experts a ubatch needed in this layer: hits + misses + skipped
    uint64_t requests    = 0;
    uint64_t hits        = 0;  // served from the cache (hits_high + hits_low)
    uint64_t misses      = 0;  // read from storage (loads_high + loads_low)
    uint64_t skipped     = 0;  // not cached and unimportant enough to skip (HOBBIT's SKIP)
    uint64_t hits_high   = 0, hits_low = 0;
    uint64_t loads_high  = 0, loads_low = 0;
    // token selections (token x top-k) by the precision that served them
    uint64_t selections_high = 0, selections_low = 0, selections_skip = 0;
    uint64_t bytes_read  = 0;  // bytes read from storage (after rounding out for O_DIRECT)
    uint64_t bytes_read_low = 0;  // of those, LOW copies' bytes
    double   load_ms     = 0;  // wall time with this layer's reads in flight
    double   stall_ms    = 0;  // wall time the compute waited for this layer's loads
    double   op_ms       = 0;  // wall time of this layer's op up to its slot ids (planning and loads)
    // the device tier (gpu and coop modes): misses served by the host tier or read into it,
    // experts uploaded to the device, and (coop) experts computed on the CPU from the host tier
    uint64_t host_hits = 0, host_loads = 0;
    uint64_t uploads = 0, bytes_uploaded = 0;
    double   upload_ms   = 0;  // summed over the uploads (several run at once)
    double   upload_wait_ms = 0;  // split: how long the device's passes waited for the queued uploads (after the CPU's pass, ms)
    double   queue_ms    = 0;     // split: the time its uploads took to queue on the device's stream (the driver's calls, on a thread of their own beside the CPU's passes, ms)
    double   cpu_pass_ms = 0;     // coop, split: from the op's slot ids to the device's plan (before split's wait): the CPU's passes, the masks (ms)
    uint64_t cpu_experts = 0;
    uint64_t stand_in_swaps = 0, stand_in_drops = 0;  // missed selections a cached stand-in served, or left out (stand_in)

    void add(const expert_layer_stats & o) {
        requests += o.requests; hits += o.hits; misses += o.misses; skipped += o.skipped;
        hits_high += o.hits_high; hits_low += o.hits_low; loads_high += o.loads_high; loads_low += o.loads_low;
        selections_high += o.selections_high; selections_low += o.selections_low; selections_skip += o.selections_skip;
        bytes_read += o.bytes_read; bytes_read_low += o.bytes_read_low; load_ms += o.load_ms; stall_ms += o.stall_ms; op_ms += o.op_ms;
        host_hits += o.host_hits; host_loads += o.host_loads;
        uploads += o.uploads; bytes_uploaded += o.bytes_uploaded; upload_ms += o.upload_ms; cpu_experts += o.cpu_experts;
        upload_wait_ms += o.upload_wait_ms; queue_ms += o.queue_ms; cpu_pass_ms += o.cpu_pass_ms;
        stand_in_swaps += o.stand_in_swaps; stand_in_drops += o.stand_in_drops;
    }
};

// What filling the cache at load read (expert_residency::fill).
struct expert_fill_stats {
    uint64_t experts = 0, bytes_read = 0;
    double   ms = 0;  // wall time of the fill
};

// How well the predictor guessed the experts of the layer `depth` MoE layers ahead (HOBBIT
// sec. 3.3), counted per token when that layer ran: top-1 right, and overlap of the predicted
// top-k with the real top-k (precision = overlap / predicted, recall = overlap / actual).
struct expert_prediction_stats {
    uint64_t tokens = 0, top1_correct = 0, overlap = 0, predicted = 0, actual = 0;
};

// What prefetching did, per target layer: experts read ahead of use, and whether they were used
// before being evicted.
// Decode prefetching: reading, held (its trial's windows without it: prefetch-trial.cpp) or
// stopped for good (it cost more reads than it saved, or was not faster: prefetch-meter.h).
enum class prefetch_phase { reading, held, stopped };

struct expert_prefetch_stats {
    uint64_t issued = 0, used = 0, wasted = 0, bytes_read = 0, bytes_read_low = 0, bytes_uploaded = 0;
    uint64_t late = 0;       // of those used, not started when their layer came (it read them itself)
    uint64_t displaced = 0;  // on-demand misses of experts a prefetch had evicted (prefetch-meter.h)
    uint64_t declined = 0;   // predictions not read: their rank costs more reads than it saves
    uint64_t given_back = 0; // not begun when their layer came, where the CPU computes misses (prefetch_coordinator::give_back)
    double   load_ms = 0;    // summed over the jobs (several run at once: see prefetcher::busy_ms)
    double   upload_ms = 0;  // of those, uploading to the device
};

// The routing of MoE layers, for calibration: one record per (token, layer): the ubatch's index,
// the layer, and the token's top-k expert ids and routing weights.
struct routing_trace {
    std::vector<int32_t> ubatch, layer;  // per record
    std::vector<int32_t> ids;            // n_expert_used per record
    std::vector<float>   weights;        // n_expert_used per record
    std::vector<int32_t> predicted;      // n_expert_used per record: the predictor's guess one layer
                                         // earlier (-1: none, e.g. the first MoE layer)
    std::vector<float>   inputs;         // input_width per record, while tracing inputs: the layer's input
    int64_t input_width = 0;
};

// Expert-residency counters, per layer: what the cache saw and what it cost.
#pragma once

#include <cstdint>

struct expert_layer_stats {
    uint64_t requests   = 0;  // distinct experts a ubatch needed in this layer (hits + misses)
    uint64_t hits       = 0;
    uint64_t misses     = 0;
    uint64_t bytes_read = 0;  // bytes read from storage (after rounding out for O_DIRECT)
    double   load_ms    = 0;  // summed over reads (across io threads)
    double   stall_ms   = 0;  // wall time the compute waited for this layer's loads

    void add(const expert_layer_stats & o) {
        requests += o.requests; hits += o.hits; misses += o.misses;
        bytes_read += o.bytes_read; load_ms += o.load_ms; stall_ms += o.stall_ms;
    }
};

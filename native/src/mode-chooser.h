// --mode auto: GPU-centric or CPU-GPU cooperative, from two rates measured at load. A miss costs
// the GPU-centric mode an upload of the expert; it costs the cooperative mode the CPU's pass over
// the expert's bytes (a decode token multiplies each weight once, so the CPU streams them). The
// faster of the two, in bytes per second, serves the misses.
#pragma once

#include "expert-options.h"

#include <string>

class slot_pool;

struct mode_choice {
    compute_mode mode = compute_mode::gpu;
    double upload_gbps = 0;  // host (the host tier's pinned memory, if any) -> device, one expert projection at a time
    double cpu_gbps = 0;     // the CPU's matrix-vector product over an expert projection (0: not measured)
    std::string reason;      // one line for stderr
};

// device: the device pools (their slot 0 is overwritten: call before the cache is filled);
// host: the host tier's HIGH pools, or nullptr when there is none (then coop cannot run).
mode_choice choose_mode(const slot_pool & device, const slot_pool * host, int n_threads);

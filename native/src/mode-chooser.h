// --mode auto: GPU-centric, CPU-GPU cooperative or split, from rates measured at load. A miss costs
// the GPU-centric mode an upload of the expert; it costs the cooperative mode the CPU's pass over
// the expert's bytes (a decode token multiplies each weight once, so the CPU streams them); split
// divides the misses between the two at once, the CPU's share computed from the pinned layout an
// upload needs, or from the CPU's where the host tier keeps both (host-tier.h). The fastest, in bytes
// per second, serves the misses: split where the two together beat the faster alone by SPLIT_MARGIN.
#pragma once

#include "expert-options.h"

#include "ggml-backend.h"

#include <string>

class slot_pool;

struct mode_choice {
    compute_mode mode = compute_mode::gpu;
    double upload_gbps = 0;  // host (the host tier's pinned memory, if any: a layer's misses queued at once) -> device
    double cpu_gbps = 0;     // the CPU's matrix-vector products over a layer's misses, from memory, in coop's layout (0: not measured)
    double cpu_split_gbps = 0;  // the same over the layout split's CPU computes from (0: not measured)
    double link_share = -1;  // split: the share of a decode token's misses uploaded (split_share's rule)
    std::string reason;      // one line for stderr
};

// device: the device pools of dev (their first slots are overwritten: call before the cache is filled);
// host_bytes: the host tier's budget (0: none, and coop and split cannot run); repack: coop's host
// tier would be repacked (the model's CPU weights are); split_repacked: split's host tier would keep
// both layouts (host_layouts_of), its CPU computing from coop's. Each rate is timed from experts laid
// out as that mode's host tier would hold them, allocated here (the CPU's: up to 256 MiB, within
// host_bytes, so that it reads them from memory).
mode_choice choose_mode(const slot_pool & device, ggml_backend_dev_t dev, uint64_t host_bytes, bool repack, bool split_repacked,
                        int n_threads);

// --mode split: the share of a decode token's misses to upload, the rest computed by the CPU meanwhile from
// the host tier (the pinned layout an upload needs, or the repacked one where split_repacked).
// options.link_share where given (auto sets it when it chooses split), else so that both end
// together: upload rate / (upload rate + the CPU's rate over its layout), timed as above, and
// reason says so (one line for stderr). 0 in other modes.
double split_share(const expert_options & options, const slot_pool & device, ggml_backend_dev_t dev, uint64_t host_bytes,
                   int n_threads, bool split_repacked, std::string * reason);

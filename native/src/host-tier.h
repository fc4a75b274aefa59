// The host tier (modes gpu and coop, HOBBIT sec. 4): pinned RAM between the GGUF and the device's
// expert cache, holding copies of experts in both precisions under its own byte budget, evicted
// least recently used. A device miss is uploaded from it (gpu) or computed from it on the CPU
// (coop); what it lacks is read into it first.
#pragma once

#include "expert-budget.h"
#include "expert-cache.h"
#include "prefetch-coordinator.h"
#include "slot-pool.h"

#include "ggml-backend.h"

#include <memory>
#include <vector>

struct host_tier {
    // Throws expert_budget_error (with the minimum) below one layer's top-k experts.
    host_tier(const expert_layout & layout, uint64_t budget_bytes, double low_share, ggml_backend_dev_t device);

    const slot_pool & pool(int group, expert_precision p) const { return pools.pool(group, p); }
    uint64_t bytes() const { return pools.bytes(expert_precision::high) + pools.bytes(expert_precision::low); }
    // The copies of the device's loads (in their order) that serve them from here, pinned: a load
    // found here or read into a slot reserved for it (load true); slot -1 where none (the host
    // tier has too few slots for the wave, or only a HIGH copy for a LOW load): read it directly.
    std::vector<expert_cache::placement> copies_for(int group, int il, const std::vector<const expert_cache::placement *> & loads);
    // a read failed: no pins, every slot free (they may hold partial data)
    void forget() {
        pins.forget();
        cache.forget_all();
    }

    expert_budget budget;
    tier_pools pools;  // in the device's pinned host memory where it has some
    expert_cache cache;
    pin_set pins;  // the copies the running wave reads or computes (hard pins)
};

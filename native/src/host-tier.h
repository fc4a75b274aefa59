// The host tier (modes gpu and coop, HOBBIT sec. 4): RAM between the GGUF and the device's expert
// cache, holding copies of experts in both precisions under its own byte budget, evicted least
// recently used. A device miss is uploaded from it (gpu: the device's pinned memory, from which
// uploads are direct) or computed from it on the CPU (coop: laid out for the CPU's kernels, i.e.
// repacked where the model's CPU weights would be, as stock llama.cpp's `-ot exps=CPU` does; such
// a copy cannot be uploaded, and in coop none is). Split does both: where the CPU's weights are
// repacked and the budget holds every copy twice, each slot is kept in both layouts (the pinned
// one uploaded, the repacked one computed from); else in the pinned one, which the CPU computes
// from at the plain kernels' rate. What it lacks is read into it first.
#pragma once

#include "expert-budget.h"
#include "expert-cache.h"
#include "prefetch-coordinator.h"
#include "slot-pool.h"

#include "ggml-backend.h"

#include <memory>
#include <vector>

// the device's pinned host memory, else the CPU's
ggml_backend_buffer_type_t pinned_or_host(ggml_backend_dev_t device);

enum class host_layouts { pinned, cpu, both };  // gpu's; coop's; split's where the CPU's weights repack

// the layouts of a mode's host tier (mode: gpu, coop or split): both where split's CPU would
// compute from repacked copies (repack, and the HIGH copies' types repack on this CPU) and
// budget_bytes holds every expert copy twice
host_layouts host_layouts_of(compute_mode mode, bool repack, const expert_layout & layout, uint64_t budget_bytes);

struct host_tier {
    // Throws expert_budget_error (with the minimum) below one layer's top-k experts. layouts: coop's
    // (repacked if repack), gpu's, or both (the budget shared by the two).
    host_tier(const expert_layout & layout, uint64_t budget_bytes, double low_share, ggml_backend_dev_t device,
              host_layouts layouts, bool repack);

    const slot_pool & pool(int group, expert_precision p) const { return pools.pool(group, p); }
    // the copies the CPU computes from: the second layout where there is one
    const tier_pools & cpu_pools() const { return cpu_copies ? *cpu_copies : pools; }
    uint64_t bytes() const;
    void lock_in_memory() {
        pools.lock_in_memory();
        if (cpu_copies) cpu_copies->lock_in_memory();
    }
    // The copies of the device's loads (in their order) that serve them from here, pinned: a load
    // found here or read into a slot reserved for it (load true); slot -1 where none (the host
    // tier has too few slots for the wave, or only a HIGH copy for a LOW load): read it directly.
    std::vector<expert_cache::placement> copies_for(int group, int il, const std::vector<const expert_cache::placement *> & loads);
    // The slot of an uploadable copy (the file's layout) of expert e of layer il where this tier holds
    // every copy and so never evicts (the slot stays the expert's while a prefetch uploads from
    // it), else -1. Prefetches upload from here instead of reading the file again.
    int stable_slot(const moe_layer_layout & l, int e, expert_precision p) const;
    // The most distinct experts a wave of group may take (coop, split), device_slots the device
    // pool's: coop's misses take host slots alone (its hits are cached already); split's uploads
    // take the device's too.
    int wave_slots(int group, compute_mode mode, int device_slots) const;
    // a read failed: no pins, every slot free (they may hold partial data)
    void forget() {
        pins.forget();
        cache.forget_all();
    }

    expert_budget budget;
    bool holds_all = false;   // every expert copy (the budget's slots are the experts of each group)
    bool uploadable = false;  // its pools hold the file's layout (pinned in gpu and split; coop's where nothing repacks)
    tier_pools pools;  // gpu, split: in the device's pinned host memory where it has some; coop: the CPU's
    std::unique_ptr<tier_pools> cpu_copies;  // both layouts: the same slots laid out for the CPU
    expert_cache cache;
    pin_set pins;  // the copies the running wave reads or computes (hard pins)
};

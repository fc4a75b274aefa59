#include "host-tier.h"

#include "layer-planner.h"

#include <algorithm>
#include <unordered_map>

ggml_backend_buffer_type_t pinned_or_host(ggml_backend_dev_t device) {
    ggml_backend_buffer_type_t buft = ggml_backend_dev_host_buffer_type(device);
    return buft ? buft : ggml_backend_cpu_buffer_type();
}

host_layouts host_layouts_of(compute_mode mode, bool repack, const expert_layout & layout, uint64_t budget_bytes) {
    if (mode == compute_mode::coop) return host_layouts::cpu;
    bool repacks = false;  // a second layout only where it differs
    for (const expert_group & g : layout.groups) {
        for (const expert_matrix_shape & s : g.high) repacks = repacks || (s.present && cpu_repacks(s.type, s.ne0, s.ne1, 2));
    }
    const bool both = mode == compute_mode::split && repack && repacks && budget_bytes / 2 >= layout.high_bytes + layout.low_bytes;
    return both ? host_layouts::both : host_layouts::pinned;
}

host_tier::host_tier(const expert_layout & layout, uint64_t budget_bytes, double low_share, ggml_backend_dev_t device,
                     host_layouts layouts, bool repack)
    : budget(layout, layouts == host_layouts::both ? budget_bytes / 2 : budget_bytes, low_share, "host cache"),
      // coop: plain host pools (buft null), repacked as the model's CPU weights are; gpu, split: pinned
      pools(layout, budget, std::vector<ggml_backend_buffer_type_t>(layout.groups.size(), layouts == host_layouts::cpu ? nullptr : pinned_or_host(device)),
            layouts == host_layouts::cpu && repack),
      cpu_copies(layouts == host_layouts::both ? std::make_unique<tier_pools>(layout, budget, std::vector<ggml_backend_buffer_type_t>(layout.groups.size(), nullptr), true)
                                               : nullptr),
      cache({ budget.high_slots, budget.low_slots, cache_policy_kind::lru, kEqualHobbitWeights, /*low_serves_high*/ false,
              layout.n_layers }),
      pins(cache, /*hard*/ true) {
    // coop's pools are plain host memory where the CPU does not repack the type: the file's layout too
    uploadable = true;
    for (size_t g = 0; g < layout.groups.size(); g++) {
        for (const expert_precision p : { expert_precision::high, expert_precision::low }) {
            if (p == expert_precision::low && !layout.has_low) continue;
            for (int q = 0; q < PROJ_COUNT; q++) {
                const slot_pool & pool = pools.pool((int) g, p);
                uploadable = uploadable && (!pool.shapes()[q].present || pool.slot_data((expert_projection) q, 0));
            }
        }
    }
    holds_all = true;
    for (size_t g = 0; g < layout.groups.size(); g++) {
        const int experts = layout.groups[g].n_layers * layout.n_expert;
        holds_all = holds_all && budget.high_slots[g] >= experts && (budget.low_slots.empty() || budget.low_slots[g] >= experts);
    }
}

int host_tier::stable_slot(const moe_layer_layout & l, int e, expert_precision p) const {
    return holds_all && uploadable ? cache.tier(l.group, p).find(make_expert_key(l.il, e)) : -1;
}

int host_tier::wave_slots(int group, compute_mode mode, int device_slots) const {
    const int host_slots = budget.high_slots[group];
    return mode == compute_mode::coop ? host_slots : std::min(device_slots, host_slots);
}

uint64_t host_tier::bytes() const {
    auto of = [](const tier_pools & p) { return p.bytes(expert_precision::high) + p.bytes(expert_precision::low); };
    return of(pools) + (cpu_copies ? of(*cpu_copies) : 0);
}

std::vector<expert_cache::placement> host_tier::copies_for(int group, int il,
                                                           const std::vector<const expert_cache::placement *> & loads) {
    std::vector<expert_demand> wanted;
    for (const auto * p : loads) wanted.emplace_back(p->expert, p->precision);
    std::vector<expert_cache::placement> placed;
    try {
        placed = cache.place(group, il, wanted);
    } catch (const std::exception &) {
        // too few host slots for this wave's loads: they go straight to the device
        return std::vector<expert_cache::placement>(loads.size(), expert_cache::placement{ -1, expert_precision::skip, -1, false });
    }
    std::unordered_map<int, const expert_cache::placement *> by_expert;
    for (const auto & p : placed) by_expert[p.expert] = &p;
    std::vector<expert_cache::placement> out;
    for (const auto * d : loads) {
        expert_cache::placement h = *by_expert.at(d->expert);
        const expert_key key = make_expert_key(il, d->expert);
        if (h.precision != d->precision) {
            // a HIGH copy serving a LOW demand cannot fill a LOW device slot: the LOW copy where
            // this tier has one too, else read that one directly
            const int low_slot = cache.tier(group, d->precision).find(key);
            h = { d->expert, low_slot >= 0 ? d->precision : expert_precision::skip, low_slot, false };
        }
        if (h.slot >= 0) pins.add({ key, h.precision });
        out.push_back(h);
    }
    return out;
}

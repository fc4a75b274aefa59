// The expert cache's bookkeeping, without memory or I/O: per pool group a HIGH tier and (with low
// precision) a LOW tier of slots, what each slot holds, one eviction policy per tier, and the
// clock the policies read. The residency layer asks it where a layer's experts are served and
// then reads the loads into the slots; calibration replays a routing trace through the same code.
#pragma once

#include "cache-policy.h"
#include "precision-policy.h"

#include <functional>
#include <memory>
#include <utility>
#include <vector>

// Which expert each slot of one tier holds.
class slot_table {
public:
    explicit slot_table(int n_slots = 0);
    int  n_slots() const { return (int) key_of_slot_.size(); }
    int  n_used() const { return n_used_; }
    int  find(expert_key key) const;      // its slot, or -1
    int  take_free_slot();                // a free slot, or -1
    void assign(int slot, expert_key key);
    expert_key release(int slot);         // frees the slot, returns the expert it held
    void release_all();

private:
    std::vector<expert_key> key_of_slot_;
    std::vector<int> free_slots_;
    struct slot_ref { int slot = -1; };
    expert_table<slot_ref> slot_of_;
    int n_used_ = 0;
};

struct expert_cache_config {
    std::vector<int> high_slots;          // per group
    std::vector<int> low_slots;           // per group; empty or 0: no LOW tier
    cache_policy_kind policy;
    hobbit_weights weights;               // for cache_policy_kind::hobbit
    bool low_serves_high;                 // a cached LOW copy serves a HIGH demand (else: load HIGH)
    int n_layers;                         // layers of the model (the FLD term's L)
    std::vector<std::vector<int>> group_layers;  // per group its MoE layers (for the fate policy)
    int n_expert = 0;                     // experts per layer (for the fate policy)
    int fate_shallow = -1;                // the fate policy's shallow layers (-1: its default)
    int n_expert_used = 0;                // experts per token (for the fate policy's default)
};

class expert_cache {
public:
    // Where one needed expert is served: skip (slot -1), or a tier's slot, to be read first if load.
    // A load may have evicted another expert of the tier (evicted: its key).
    struct placement {
        int expert;
        expert_precision precision;
        int slot;
        bool load;
        bool has_evicted = false;
        expert_key evicted = 0;
    };

    explicit expert_cache(const expert_cache_config & config);
    expert_cache(const expert_cache &) = delete;
    expert_cache & operator=(const expert_cache &) = delete;

    // The experts layer il (of pool group `group`) needs now, each with its demand (distinct
    // experts). A cached HIGH copy serves any demand; a cached LOW copy serves LOW and SKIP (and
    // HIGH if low_serves_high); otherwise SKIP is skipped and LOW/HIGH are loaded into a free or
    // evicted slot of their tier (unpinned first, soft-pinned if need be; a LOW demand the LOW
    // tier has no room for gets a HIGH copy). None of the experts
    // passed is evicted by this call. Throws std::runtime_error when a tier has fewer evictable
    // slots than the loads need; the slots it took are then given back (evictions stay).
    std::vector<placement> place(int group, int il, const std::vector<std::pair<int, expert_precision>> & wanted);

    // A slot for expert e of layer il in `precision` ahead of its use (a prefetch): none (slot -1,
    // load false) if a copy that serves this demand is cached or no slot can be evicted (with
    // evict false: no slot is free). The policy sees an insertion, not a use.
    placement reserve(int group, int il, int e, expert_precision precision, bool evict = true);

    // A pinned expert is not evicted. Hard pins (experts in use, reads in flight) always hold; soft
    // pins (predicted experts, until their layer runs) give way when an on-demand load finds no
    // other slot, never for a prefetch. Pins count: each pin needs its unpin.
    void pin(expert_key key, expert_precision precision, bool hard);
    void unpin(expert_key key, expert_precision precision, bool hard);
    // The one serving rule: the cached copy of (il, expert) that serves `demand` (a HIGH copy serves
    // any demand; a LOW copy serves LOW and SKIP, and HIGH if low_serves_high): its tier (high or
    // low), or skip when none is cached.
    expert_precision serving_tier(int group, expert_key key, expert_precision demand) const;

    // frees the slot of a reserved expert whose read was cancelled
    void discard(int group, expert_key key, expert_precision precision);

    // a ubatch of n tokens enters the model (at its first MoE layer)
    void advance_tokens(uint64_t n) {
        clock_.token += n;
        clock_.sweep = needs_most_experts((int64_t) n, config_.n_expert_used, config_.n_expert);
    }
    void start_sequence();       // the policies' per-sequence records and the token clock restart
    void forget_all();  // slots may hold partial data (a failed read): every slot free, no pins

    bool has_low() const { return has_low_; }
    const slot_table & tier(int group, expert_precision p) const { return tiers_[index(group, p)].slots; }
    const char * policy_name() const { return tiers_[0].policy->name(); }
    const cache_clock & clock() const { return clock_; }
    uint64_t sequences() const { return sequences_; }  // started so far
    const expert_cache_config & config() const { return config_; }
    uint64_t resident_experts() const;
    size_t n_slots() const;  // of every tier and group

private:
    struct tier_state {
        slot_table slots;
        cache_tier_shape shape;
        std::unique_ptr<cache_policy> policy;
    };
    size_t index(int group, expert_precision p) const { return 2 * (size_t) group + (p == expert_precision::low ? 1 : 0); }
    bool pinned(expert_key key, expert_precision p, bool hard_only) const;
    // a free slot of t, else the policy's victim among unpinned keys for which evictable(key)
    // (in a sweep, of the layers the ubatch has passed first; with soft_pins_give_way,
    // soft-pinned ones last); -1 if none
    int free_or_evict(tier_state & t, expert_precision p, expert_key incoming, const std::function<bool(expert_key)> & evictable,
                      bool soft_pins_give_way, placement & out);

    expert_cache_config config_;
    std::vector<tier_state> tiers_;  // [group][high, low]
    expert_table<int> hard_pins_[2], soft_pins_[2];  // [high, low]: each expert's pins
    cache_clock clock_;
    uint64_t sequences_ = 0;
    bool has_low_ = false;
};

// What decode prefetching earns and what it costs, measured as it runs, per rank (a prediction's
// place in the list a strategy hands over: 0 its likeliest). A prefetch read, or being read, when
// its layer used it took (some of) a read off the critical path (one not started took none: the
// layer read it itself); one evicted unused was a read for nothing; one whose slot held a
// cached expert that was then missed on demand before it could have aged out (a ghost of it
// outlived fewer evictions than the cache has slots) caused a read. A rank keeps being prefetched
// while it takes more reads off the critical path than it adds, judged once
// PREFETCH_RANK_JUDGED_AFTER of its prefetches settled, so guesses that mostly miss (random routing,
// a strategy's extra experts) or that the compute is too short to hide stop costing bytes.
#pragma once

#include "cache-policy.h"

#include <cstdint>
#include <deque>
#include <unordered_map>
#include <vector>

constexpr uint64_t PREFETCH_RANK_JUDGED_AFTER = 32;

class prefetch_meter {
public:
    // ghost_slots: how many evictions a displaced expert's ghost outlives (the cache's slots)
    explicit prefetch_meter(size_t ghost_slots) : ghost_slots_(ghost_slots) {}

    // a prefetch of rank `rank` was issued; it evicted `displaced` (has_displaced) for its slot
    void issued(int rank, bool has_displaced, expert_key displaced);
    void used(int rank, bool ahead) { at(rank).used++; at(rank).ahead += ahead; }
    void wasted(int rank) { at(rank).wasted++; }
    // an on-demand placement of key: missed (a load) or found cached; true: a miss a prefetch caused
    bool demanded(expert_key key, bool missed);
    // any eviction: ghosts age by one
    void evicted();

    bool worth(int rank) const;
    bool useless() const { return !worth(0); }  // not even the likeliest guesses pay

private:
    struct outcome {
        uint64_t used = 0, ahead = 0, wasted = 0, displaced = 0;
    };
    outcome & at(int rank);

    std::vector<outcome> ranks_;
    size_t ghost_slots_;
    uint64_t evictions_ = 0;
    struct ghost {
        int rank;
        uint64_t at_eviction;  // evictions_ when it was displaced
    };
    std::unordered_map<expert_key, ghost> ghosts_;
    std::deque<expert_key> ghost_order_;  // oldest first (keys may repeat; a stale one is skipped)
};

// Whether decode prefetching reads more bytes than the same run would without it, counted
// exactly: a shadow of the expert cache (the same code, policy and slots, no data) is handed every
// on-demand placement and every read that is not a judged guess (the fill, a prefill's read-ahead),
// so its loads are those of the run without decode prefetching; the run's own are its on-demand
// loads plus its judged guesses' reads, each a HIGH load 1 and a LOW load its byte ratio.
// A used guess replaces a miss's read one for one, so only the guesses evicted unused and the
// misses of experts they displaced (cascades included) count against it. Used where read times
// may not judge prefetching (LOW copies or skips: the tokens would depend on them), it stops
// prefetching once the run has read more than its shadow, judged at every layer after
// PREFETCH_LEDGER_JUDGED_AFTER guesses: in practice at the first layer that did not use its guess.
#pragma once

#include "expert-cache.h"

#include <cstdint>
#include <unordered_map>
#include <utility>
#include <vector>

constexpr uint64_t PREFETCH_LEDGER_JUDGED_AFTER = 8;

class prefetch_ledger {
public:
    // low_cost: a LOW expert's bytes over a HIGH one's
    prefetch_ledger(const expert_cache & cache, double low_cost);

    // the run placed layer il's wanted experts as `placed`: the shadow places them too, and the
    // guesses read for il are judged from here on
    void placed(int group, int il, const std::vector<std::pair<int, expert_precision>> & wanted,
                const std::vector<expert_cache::placement> & placed);
    // a read the run asks for without prefetching too (the fill: evict false, into a free slot
    // only); run_read: the run read it (it was not cached there)
    void mirrored(int group, int il, int e, expert_precision p, bool evict, bool run_read);
    // a judged guess for layer il is read, or (cancelled) not after all
    void guessed(int il, expert_precision p) { run_ += cost(p); pending_[il] += cost(p); guesses_++; }
    void cancelled(int il, expert_precision p) {
        run_ -= cost(p);
        guesses_--;
        if (auto it = pending_.find(il); it != pending_.end()) it->second -= cost(p);  // its layer is still to run
    }

    // The run has read more than its shadow, not counting the guesses whose layer has not run yet
    // (a guess costs its read at once, its shadow's miss comes when the layer it was read for runs).
    bool costs() const { return costs_; }

private:
    double cost(expert_precision p) const { return p == expert_precision::low ? low_cost_ : 1.0; }
    void follow_clock();  // the shadow's sequence and tokens catch up with the run's

    const expert_cache & real_;
    expert_cache shadow_cache_;
    double low_cost_;
    double run_ = 0, shadow_ = 0;            // loads, in HIGH experts
    std::unordered_map<int, double> pending_;  // by layer: its guesses' reads, until it runs
    uint64_t guesses_ = 0;
    bool costs_ = false;
    bool lost_ = false;  // the shadow could not follow (a placement it cannot make): judges nothing
};

#include "prefetch-meter.h"

prefetch_meter::outcome & prefetch_meter::at(int rank) {
    if ((size_t) rank >= ranks_.size()) ranks_.resize(rank + 1);
    return ranks_[rank];
}

void prefetch_meter::issued(int rank, bool has_displaced, expert_key displaced) {
    if (!has_displaced) return;
    ghosts_[displaced] = { rank, evictions_ };
    ghost_order_.push_back(displaced);
}

void prefetch_meter::evicted() {
    evictions_++;
    while (!ghost_order_.empty()) {
        auto it = ghosts_.find(ghost_order_.front());
        if (it != ghosts_.end() && it->second.at_eviction + ghost_slots_ > evictions_) break;  // still young
        if (it != ghosts_.end()) ghosts_.erase(it);
        ghost_order_.pop_front();
    }
}

bool prefetch_meter::demanded(expert_key key, bool missed) {
    auto it = ghosts_.find(key);
    if (it == ghosts_.end()) return false;
    if (missed) at(it->second.rank).displaced++;
    ghosts_.erase(it);
    return missed;
}

bool prefetch_meter::worth(int rank) const {
    if ((size_t) rank >= ranks_.size()) return true;
    const outcome & o = ranks_[rank];
    return o.used + o.wasted < PREFETCH_RANK_JUDGED_AFTER || o.ahead > o.wasted + o.displaced;
}

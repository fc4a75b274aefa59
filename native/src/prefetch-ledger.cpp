#include "prefetch-ledger.h"

#include <stdexcept>

prefetch_ledger::prefetch_ledger(const expert_cache & cache, double low_cost)
    : real_(cache), shadow_cache_(cache.config()), low_cost_(low_cost) {}

void prefetch_ledger::follow_clock() {
    while (shadow_cache_.sequences() < real_.sequences()) shadow_cache_.start_sequence();
    const uint64_t token = real_.clock().token, shadow_token = shadow_cache_.clock().token;
    if (token > shadow_token) shadow_cache_.advance_tokens(token - shadow_token);
}

void prefetch_ledger::placed(int group, int il, const std::vector<std::pair<int, expert_precision>> & wanted,
                             const std::vector<expert_cache::placement> & placed) {
    if (lost_) return;
    for (const auto & p : placed) run_ += p.load ? cost(p.precision) : 0.0;
    follow_clock();
    try {
        for (const auto & p : shadow_cache_.place(group, il, wanted)) shadow_ += p.load ? cost(p.precision) : 0.0;
    } catch (const std::runtime_error &) {
        lost_ = true;
        return;
    }
    pending_.erase(il);
    double pending = 0;
    for (const auto & [layer, reads] : pending_) pending += reads;
    costs_ = costs_ || (guesses_ >= PREFETCH_LEDGER_JUDGED_AFTER && run_ - pending > shadow_ + 1e-9);
}

void prefetch_ledger::mirrored(int group, int il, int e, expert_precision p, bool evict, bool run_read) {
    if (lost_) return;
    run_ += run_read ? cost(p) : 0.0;
    follow_clock();
    if (shadow_cache_.reserve(group, il, e, p, evict).load) shadow_ += cost(p);
}

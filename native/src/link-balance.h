// Mode split: the share of a decode token's misses uploaded while the CPU computes the others
// (tier_passes::divide), so that both end together: the link's rate over the sum of the two rates.
// The rates timed at load (split_share, mode-chooser.h) give the first share. A running decode's
// rates move with the machine's other work and the threads a request gets (pyedgemoe/threads.py),
// so each decode layer refines them from what it took, in experts per ms, moving averages:
//   the CPU's: its misses over the time from the uploads' handing over to the wait after its
//     passes (its fixed costs in a layer counted in, as the balance needs them);
//   the link's: where the device waited for the uploads (the link ended last), the uploads over
//     that time and the wait; where it did not, the link took at most the CPU's time, so its rate
//     is at least the uploads over it, and where that is more than the average it moves the average.
// A wait is never shorter than the synchronization's own cost (the driver's calls, in a sandbox
// too): the least wait seen, up to kMostSyncMs, is taken for that and not for the link's lateness,
// which would otherwise send the share toward the CPU layer after layer.
// A share given (--link-share) stays as it is.
#pragma once

#include <algorithm>
#include <atomic>

class link_balance {
public:
    link_balance() = default;
    // adapts: refine share (clamped to keep both sides measured) as above, else keep it
    link_balance(double share, bool adapts)
        : share_(adapts ? std::clamp(share, kLeast, 1 - kLeast) : share), state_{ adapts } {}
    link_balance(const link_balance & o) { *this = o; }
    link_balance & operator=(const link_balance & o) {  // the atomic share is not copyable by itself
        share_ = o.share(), state_ = o.state_;
        return *this;
    }

    double share() const { return share_.load(std::memory_order_relaxed); }  // also read by stats()
    // a decode wave's misses divided (one token each): uploaded, computed on the CPU
    void divided(int uploaded, int on_cpu) {
        if (state_.adapts) state_.wave = { uploaded, on_cpu };
    }
    // that wave's uploads arrived: cpu_ms from their handing over to the wait, wait_ms the wait
    void arrived(double cpu_ms, double wait_ms) {
        auto & st = state_;
        const pending wave = st.wave;
        st.wave = {};
        if (wave.uploaded <= 0) return;  // nothing waited for: no synchronization, the link unseen
        st.sync_ms = std::min(st.sync_ms, wait_ms);
        if (wave.on_cpu == 0 || cpu_ms <= 0) return;  // the CPU idle: its rate unseen
        average(st.cpu, wave.on_cpu / cpu_ms);
        const double s = share();
        if (st.link < 0) st.link = st.cpu * s / (1 - s);  // the rates at load's ratio
        const double late_ms = wait_ms - std::min(st.sync_ms, kMostSyncMs);
        const double seen = wave.uploaded / (cpu_ms + std::max(0.0, late_ms));  // where it ended first: at least this
        if (late_ms > kLateMs || seen > st.link) average(st.link, seen);
        share_ = std::clamp(st.link / (st.link + st.cpu), kLeast, 1 - kLeast);
    }

private:
    static constexpr double kWeight = 0.2;       // of a layer's rate in its average
    static constexpr double kLateMs = 0.02;      // lateness within this is a synchronization's jitter
    static constexpr double kMostSyncMs = 0.05;  // the most a synchronization of arrived uploads is taken to cost
    static constexpr double kLeast = 0.05;       // each side keeps a share, so that its rate stays measured
    static void average(double & mean, double x) { mean = mean < 0 ? x : (1 - kWeight) * mean + kWeight * x; }

    struct pending {
        int uploaded = -1, on_cpu = 0;  // -1: no decode wave divided since the last arrival
    };
    std::atomic<double> share_{0};
    struct {
        bool adapts = false;
        pending wave;
        double link = -1, cpu = -1;  // experts per ms (-1: not measured yet)
        double sync_ms = 1e9;        // the least wait seen
    } state_;
};

// Fate's transfer bound (Fate sec. 4.3, decode): a layer's prefetch can hide as many expert reads
// as fit in the compute between two MoE layers. Fate measures both times offline; here they are
// measured as the run goes (moving averages of the time between one layer's op ending and the
// next one's starting, and of an on-demand read per expert).
#pragma once

#include <chrono>
#include <cstdint>

class overlap_meter {
public:
    using clock = std::chrono::steady_clock;

    // a MoE layer's op starts / ends, in the ubatch-th ubatch (gaps across ubatches are not compute)
    void layer_began(clock::time_point now, int32_t ubatch) {
        if (ended_ubatch_ == ubatch) average(compute_ms_, std::chrono::duration<double, std::milli>(now - ended_).count());
    }
    void layer_ended(clock::time_point now, int32_t ubatch) { ended_ = now; ended_ubatch_ = ubatch; }
    // n experts read on demand in ms (wall time, reads in flight together)
    void experts_read(int n, double ms) { if (n > 0) average(read_ms_, ms / n); }

    // expert reads the compute between two layers hides (Fate's N_max); -1 until both are measured
    int hidden_experts() const {
        if (compute_ms_ < 0 || read_ms_ <= 0) return -1;
        return (int) (compute_ms_ / read_ms_);
    }

private:
    static void average(double & mean, double x) { mean = mean < 0 ? x : 0.9 * mean + 0.1 * x; }
    double compute_ms_ = -1, read_ms_ = -1;
    clock::time_point ended_;
    int32_t ended_ubatch_ = -1;
};

// Whether decode prefetching makes tokens faster, tried on the run itself: prefetching reads more
// bytes than the misses it replaces (its guesses that miss, the cached experts it evicts), so it
// stays on only where it buys a speed-up larger than the run's own spread. After a warm-up window,
// the decode runs PREFETCH_TRIAL_PAIRS pairs of windows of PREFETCH_TRIAL_TOKENS tokens, one with
// the decode prefetcher's reads and one without (which comes first alternates, so a cache still
// warming favours neither); prefetching stays on for good only if in every pair the window with it
// had the shorter median token time, else it stops for good (a sign test: a prefetcher that does
// not help passes it once in 2^PAIRS). Lossless only (the coordinator's `timed`): with LOW copies or
// skips a measured time must not decide what is cached, since the tokens would follow it.
#include "prefetch-strategy.h"

#include "expert-layout.h"
#include "prefetch-coordinator.h"

#include <algorithm>

namespace {

constexpr int PREFETCH_TRIAL_TOKENS = 4;
constexpr int PREFETCH_TRIAL_PAIRS = 4;

class prefetch_trial final : public prefetch_strategy {
public:
    explicit prefetch_trial(const prefetch_env & env) : env_(env) {}

    const char * name() const override { return "trial"; }

    // a decode token's time: from its ubatch's first MoE layer to the next ubatch's
    void on_ubatch() override {
        const clock::time_point now = clock::now();
        if (decoding_ && started_) token_time(std::chrono::duration<double>(now - last_).count());
        last_ = now;
        started_ = true;
        decoding_ = false;
    }
    void after_wave(const served_wave & w) override {
        if (&w.layer == &env_.layout.layers.front() && w.wave == 0) decoding_ = w.n_tokens == 1;
    }

private:
    void token_time(double seconds) {
        if (done_) return;
        window_.push_back(seconds);
        if ((int) window_.size() < PREFETCH_TRIAL_TOKENS) return;
        std::nth_element(window_.begin(), window_.begin() + window_.size() / 2, window_.end());
        const double median = window_[window_.size() / 2];
        window_.clear();
        if (windows_++ > 0) (prefetching_ ? with_ : without_).push_back(median);  // the first: warm-up
        if ((int) without_.size() == PREFETCH_TRIAL_PAIRS && (int) with_.size() == PREFETCH_TRIAL_PAIRS) return decide();
        // pairs alternate which comes first: on,off  off,on  on,off ...
        const int pair = (int) std::min(with_.size(), without_.size());
        const bool second_of_pair = with_.size() != without_.size();
        prefetching_ = second_of_pair ? !prefetching_ : pair % 2 == 0;
        env_.coordinator.hold_judged(!prefetching_);
    }
    void decide() {
        done_ = true;
        env_.coordinator.hold_judged(false);
        for (int i = 0; i < PREFETCH_TRIAL_PAIRS; i++) {
            if (with_[i] >= without_[i]) return env_.coordinator.stop_judged();
        }
    }

    prefetch_env env_;
    clock::time_point last_;
    bool started_ = false, decoding_ = false, done_ = false, prefetching_ = true;
    int windows_ = 0;
    std::vector<double> window_, with_, without_;  // median token times of the windows with and without
};

}  // namespace

std::unique_ptr<prefetch_strategy> make_prefetch_trial(const prefetch_env & env) {
    return std::make_unique<prefetch_trial>(env);
}

#include "loader.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>

loader_threads::loader_threads(int n_threads) {
    for (int i = 1; i < n_threads; i++) workers_.emplace_back(&loader_threads::worker_main, this, i);
}

loader_threads::~loader_threads() {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        stop_ = true;
    }
    wake_.notify_all();
    for (auto & t : workers_) t.join();
}

void loader_threads::run(int n, const std::function<void(int)> & fn) {
    if (n > n_threads()) n = n_threads();
    if (n <= 1) {
        fn(0);
        return;
    }
    {
        std::lock_guard<std::mutex> lock(mutex_);
        fn_ = &fn;
        n_active_ = n;
        n_running_ = n - 1;
        generation_++;
    }
    wake_.notify_all();
    fn(0);
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [&] { return n_running_ == 0; });
    fn_ = nullptr;
}

void loader_threads::worker_main(int index) {
    uint64_t seen = 0;
    for (;;) {
        const std::function<void(int)> * fn = nullptr;
        {
            std::unique_lock<std::mutex> lock(mutex_);
            wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
            if (stop_) return;
            seen = generation_;
            if (index >= n_active_) continue;  // not needed in this batch
            fn = fn_;
        }
        (*fn)(index);
        {
            std::lock_guard<std::mutex> lock(mutex_);
            if (--n_running_ == 0) done_.notify_one();
        }
    }
}

loader_threads::read_result loader_threads::read_all(std::vector<expert_read> reads) {
    std::sort(reads.begin(), reads.end(), [](const expert_read & a, const expert_read & b) {
        return std::make_pair(a.store, a.offset) < std::make_pair(b.store, b.offset);
    });
    const int n = std::min<int>(n_threads(), (int) reads.size());
    std::atomic<size_t> next{0};
    std::vector<read_outcome> moved(n);
    std::vector<std::string> errors(n);
    const auto t0 = std::chrono::steady_clock::now();
    run(n, [&](int t) {
        for (size_t j; (j = next.fetch_add(1)) < reads.size();) {
            try {
                moved[t].add(reads[j].run());
            } catch (const std::exception & ex) {
                errors[t] = ex.what();
                next = reads.size();  // the others stop too
                return;
            }
        }
    });
    read_result out;
    out.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    for (int t = 0; t < n; t++) {
        if (out.error.empty()) out.error = errors[t];
        out.moved.add(moved[t]);
    }
    return out;
}

// Loader threads: a fixed set of workers, created once per model, that run one batch of expert
// reads at a time together with the calling thread. A layer's misses used to start and join
// fresh std::threads per call (~50-100 us each, more than a small O_DIRECT read) and could not
// keep several reads in flight cheaply; small reads are latency-bound (measured here: 16 KiB
// O_DIRECT reads 0.11 GB/s at queue depth 1, 0.26 GB/s at 4; docs/expert-residency.md).
#pragma once

#include "expert-store.h"

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

class loader_threads {
public:
    explicit loader_threads(int n_threads);  // n_threads - 1 workers; the caller is thread 0
    ~loader_threads();
    loader_threads(const loader_threads &) = delete;
    loader_threads & operator=(const loader_threads &) = delete;

    int n_threads() const { return (int) workers_.size() + 1; }

    // What one batch of reads did: bytes from storage and uploaded, wall time, the first error ("" if none).
    struct read_result {
        read_outcome moved;
        double ms = 0;
        std::string error;
    };
    // Reads the batch in file order (one forward sweep per file), each thread taking the next
    // read, so several stay in flight (small reads are latency-bound); an error stops the others.
    read_result read_all(std::vector<expert_read> reads);

    // Runs fn(thread_index) on threads 0 .. n-1 (n <= n_threads(); 0 is the caller) and returns
    // when all have returned. One batch at a time (the graph runs layers one after another).
    void run(int n, const std::function<void(int)> & fn);

private:
    void worker_main(int index);

    std::vector<std::thread> workers_;
    std::mutex mutex_;
    std::condition_variable wake_, done_;
    const std::function<void(int)> * fn_ = nullptr;
    uint64_t generation_ = 0;
    int n_active_ = 0;   // threads 1 .. n_active_-1 take part in the current batch
    int n_running_ = 0;  // workers of the current batch not finished yet
    bool stop_ = false;
};

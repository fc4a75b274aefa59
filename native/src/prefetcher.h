// The prefetch loader: background threads that read predicted experts into the slots reserved
// for them while the graph computes other layers (HOBBIT sec. 3.3). On-demand loads come first:
// while the compute waits for one (pause .. resume) no thread starts a new read, so a prefetch
// delays an on-demand load by at most the reads already in flight (reads are not interruptible,
// as HOBBIT notes for cudaMemcpy). A job the compute needs before it started is handed to the
// compute's own loaders (claim).
#pragma once

#include "cache-policy.h"
#include "expert-store.h"
#include "precision-policy.h"

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

struct prefetch_job {
    expert_key key;
    expert_precision precision;
    bool fill = false;  // the cache's fill, in the background (prefetch_coordinator::start_fill)
    std::vector<expert_read> reads;
    // filled by whoever ran it
    read_outcome moved;
    double ms = 0;
    std::string error;
};

class prefetcher {
public:
    // n_threads jobs in flight at once (as many as the on-demand loaders keep)
    explicit prefetcher(int n_threads);
    ~prefetcher();  // finishes the reads in flight, drops queued jobs
    prefetcher(const prefetcher &) = delete;
    prefetcher & operator=(const prefetcher &) = delete;

    void submit(std::shared_ptr<prefetch_job> job);
    // The compute needs this job now: if it has not started it leaves the queue and is returned
    // (the caller reads it); if it is running, waits for it and returns null.
    std::shared_ptr<prefetch_job> claim(const std::shared_ptr<prefetch_job> & job);
    void pause();   // an on-demand load starts
    void resume();  // it ended
    // jobs finished since the last call (read by the threads), with their errors
    std::vector<std::shared_ptr<prefetch_job>> take_finished();
    // waits until every queued job has run (the caller has no load paused)
    void wait_idle();
    // waits until no job runs, dropping queued jobs; returns them
    std::vector<std::shared_ptr<prefetch_job>> cancel_all();
    // wall time with at least one prefetch read in flight (the jobs' ms overlap), since the reset
    double busy_ms();
    void reset_busy_ms();

private:
    void thread_main();
    bool running(const std::shared_ptr<prefetch_job> & job) const;

    std::mutex mutex_;
    std::condition_variable wake_, done_;
    std::deque<std::shared_ptr<prefetch_job>> queue_;
    std::vector<std::shared_ptr<prefetch_job>> running_;
    std::vector<std::shared_ptr<prefetch_job>> finished_;
    int paused_ = 0;
    int reading_ = 0;  // reads in flight
    double busy_ms_ = 0;
    std::chrono::steady_clock::time_point busy_since_;
    bool stop_ = false;
    std::vector<std::thread> threads_;  // last: they start once everything above is constructed
};

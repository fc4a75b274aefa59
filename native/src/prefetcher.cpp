#include "prefetcher.h"

#include <algorithm>
#include <chrono>

void run_prefetch_job(prefetch_job & job) {
    const auto t0 = std::chrono::steady_clock::now();
    for (const prefetch_read & r : job.reads) {
        try {
            job.bytes += r.store->read_range(r.offset, r.size, r.dst);
        } catch (const std::exception & ex) {
            job.error = "cannot read " + r.what + " (file offset " + std::to_string(r.offset) + ") from " +
                        r.store->path() + ": " + ex.what();
            break;
        }
    }
    job.ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

prefetcher::prefetcher() : thread_(&prefetcher::thread_main, this) {}

prefetcher::~prefetcher() {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        stop_ = true;
        queue_.clear();
    }
    wake_.notify_all();
    thread_.join();
}

void prefetcher::submit(std::shared_ptr<prefetch_job> job) {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        queue_.push_back(std::move(job));
    }
    wake_.notify_all();
}

std::shared_ptr<prefetch_job> prefetcher::claim(const std::shared_ptr<prefetch_job> & job) {
    std::unique_lock<std::mutex> lock(mutex_);
    auto it = std::find(queue_.begin(), queue_.end(), job);
    if (it != queue_.end()) {
        queue_.erase(it);
        return job;
    }
    done_.wait(lock, [&] { return running_ != job; });
    return nullptr;
}

void prefetcher::pause() {
    std::lock_guard<std::mutex> lock(mutex_);
    paused_++;
}

void prefetcher::resume() {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        paused_--;
    }
    wake_.notify_all();
}

std::vector<std::shared_ptr<prefetch_job>> prefetcher::take_finished() {
    std::lock_guard<std::mutex> lock(mutex_);
    return std::move(finished_);
}

std::vector<std::shared_ptr<prefetch_job>> prefetcher::cancel_all() {
    std::unique_lock<std::mutex> lock(mutex_);
    std::vector<std::shared_ptr<prefetch_job>> dropped(queue_.begin(), queue_.end());
    queue_.clear();
    done_.wait(lock, [&] { return !running_; });
    return dropped;
}

void prefetcher::thread_main() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
        wake_.wait(lock, [&] { return stop_ || (paused_ == 0 && !queue_.empty()); });
        if (stop_) return;
        running_ = queue_.front();
        queue_.pop_front();
        prefetch_job & job = *running_;
        lock.unlock();
        // one read at a time, and none while an on-demand load waits
        for (size_t i = 0; i < job.reads.size() && job.error.empty(); i++) {
            {
                std::unique_lock<std::mutex> wait_lock(mutex_);
                wake_.wait(wait_lock, [&] { return stop_ || paused_ == 0; });
                if (stop_) break;
            }
            prefetch_job one = { job.key, job.precision, { job.reads[i] } };
            run_prefetch_job(one);
            job.bytes += one.bytes;
            job.ms += one.ms;
            job.error = one.error;
        }
        lock.lock();
        finished_.push_back(std::move(running_));
        running_.reset();
        done_.notify_all();
    }
}

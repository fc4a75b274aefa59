#include "prefetcher.h"

#include <algorithm>
#include <chrono>

prefetcher::prefetcher(int n_threads) {
    for (int i = 0; i < std::max(1, n_threads); i++) threads_.emplace_back(&prefetcher::thread_main, this);
}

prefetcher::~prefetcher() {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        stop_ = true;
        queue_.clear();
    }
    wake_.notify_all();
    for (auto & t : threads_) t.join();
}

void prefetcher::submit(std::shared_ptr<prefetch_job> job) {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        queue_.push_back(std::move(job));
    }
    wake_.notify_all();
}

bool prefetcher::running(const std::shared_ptr<prefetch_job> & job) const {
    return std::find(running_.begin(), running_.end(), job) != running_.end();
}

std::shared_ptr<prefetch_job> prefetcher::claim(const std::shared_ptr<prefetch_job> & job) {
    std::unique_lock<std::mutex> lock(mutex_);
    auto it = std::find(queue_.begin(), queue_.end(), job);
    if (it != queue_.end()) {
        queue_.erase(it);
        return job;
    }
    done_.wait(lock, [&] { return !running(job); });
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

void prefetcher::wait_idle() {
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [&] { return queue_.empty() && running_.empty(); });
}

std::vector<std::shared_ptr<prefetch_job>> prefetcher::cancel_all() {
    std::unique_lock<std::mutex> lock(mutex_);
    std::vector<std::shared_ptr<prefetch_job>> dropped(queue_.begin(), queue_.end());
    queue_.clear();
    done_.wait(lock, [&] { return running_.empty(); });
    return dropped;
}

double prefetcher::busy_ms() {
    std::lock_guard<std::mutex> lock(mutex_);
    return busy_ms_;
}

void prefetcher::reset_busy_ms() {
    std::lock_guard<std::mutex> lock(mutex_);
    busy_ms_ = 0;
    busy_since_ = std::chrono::steady_clock::now();  // a read in flight counts from now
}

void prefetcher::thread_main() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
        wake_.wait(lock, [&] { return stop_ || (paused_ == 0 && !queue_.empty()); });
        if (stop_) return;
        std::shared_ptr<prefetch_job> job = queue_.front();
        queue_.pop_front();
        running_.push_back(job);
        // one read at a time per thread, and none starts while an on-demand load waits
        for (const expert_read & r : job->reads) {
            wake_.wait(lock, [&] { return stop_ || paused_ == 0; });
            if (stop_) break;
            const auto t0 = std::chrono::steady_clock::now();
            if (reading_++ == 0) busy_since_ = t0;
            lock.unlock();
            try {
                job->moved.add(r.run());
            } catch (const std::exception & ex) {
                job->error = ex.what();
            }
            const auto t1 = std::chrono::steady_clock::now();
            job->ms += std::chrono::duration<double, std::milli>(t1 - t0).count();
            lock.lock();
            if (--reading_ == 0) busy_ms_ += std::chrono::duration<double, std::milli>(t1 - busy_since_).count();
            if (!job->error.empty()) break;
        }
        running_.erase(std::find(running_.begin(), running_.end(), job));
        finished_.push_back(std::move(job));
        done_.notify_all();
    }
}

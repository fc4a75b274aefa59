#include "upload-queue.h"

#include <chrono>

upload_queue::~upload_queue() {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        stop_ = true;
    }
    wake_.notify_one();
    if (thread_.joinable()) thread_.join();
}

void upload_queue::push(std::vector<upload> batch) {
    if (batch.empty()) return;
    {
        std::lock_guard<std::mutex> lock(mutex_);
        pending_.insert(pending_.end(), batch.begin(), batch.end());
        if (!thread_.joinable()) thread_ = std::thread([this] { thread_main(); });
    }
    wake_.notify_one();
}

double upload_queue::finish() {
    std::set<ggml_backend_t> streams;
    double ms;
    {
        std::unique_lock<std::mutex> lock(mutex_);
        idle_.wait(lock, [this] { return pending_.empty() && !busy_; });
        streams.swap(streams_);
        ms = queue_ms_;
        queue_ms_ = 0;
    }
    for (ggml_backend_t stream : streams) ggml_backend_synchronize(stream);
    return ms;
}

void upload_queue::thread_main() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
        wake_.wait(lock, [this] { return stop_ || !pending_.empty(); });
        if (pending_.empty()) return;  // stop_, with nothing left to queue
        std::vector<upload> batch;
        batch.swap(pending_);
        busy_ = true;
        lock.unlock();
        const auto t0 = std::chrono::steady_clock::now();
        for (const upload & u : batch) ggml_backend_tensor_set_async(u.stream, u.view, u.src, 0, u.size);
        const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        lock.lock();
        for (const upload & u : batch) streams_.insert(u.stream);
        queue_ms_ += ms;
        busy_ = false;
        if (pending_.empty()) idle_.notify_all();
    }
}

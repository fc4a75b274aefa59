#include "upload-queue.h"

#include <chrono>

upload_queue::~upload_queue() { close(); }

void upload_queue::close() {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        stop_ = true;
    }
    wake_.notify_one();
    if (thread_.joinable()) thread_.join();
    for (auto & [stream, event] : events_) if (event) ggml_backend_event_free(event);
    events_.clear();
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
    std::vector<std::pair<ggml_backend_t, ggml_backend_event_t>> streams;
    double ms;
    {
        std::unique_lock<std::mutex> lock(mutex_);
        idle_.wait(lock, [this] { return pending_.empty() && !busy_; });
        for (ggml_backend_t stream : streams_) streams.emplace_back(stream, events_.at(stream));  // the thread's, idle now
        streams_.clear();
        ms = queue_ms_;
        queue_ms_ = 0;
    }
    for (auto [stream, event] : streams) {
        // the event first: ggml's Vulkan backend recycles an event's resources only there
        if (event) ggml_backend_event_synchronize(event);
        ggml_backend_synchronize(stream);
    }
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
        std::set<ggml_backend_t> streams;
        for (const upload & u : batch) {
            ggml_backend_tensor_set_async(u.stream, u.view, u.src, 0, u.size);
            streams.insert(u.stream);
        }
        for (ggml_backend_t stream : streams) {  // sets the copies going where the backend holds them (Vulkan)
            auto it = events_.find(stream);
            if (it == events_.end()) it = events_.emplace(stream, ggml_backend_event_new(ggml_backend_get_device(stream))).first;
            if (it->second) ggml_backend_event_record(it->second, stream);
        }
        const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        lock.lock();
        streams_.insert(streams.begin(), streams.end());
        queue_ms_ += ms;
        busy_ = false;
        if (pending_.empty()) idle_.notify_all();
    }
}

// split's uploads (expert-reads.h), queued on their devices' streams by a thread of their own. The
// driver's calls that queue them (three an expert, about 450 a Qwen3-30B-A3B token at 25 %) took
// the layer's op some 3.6 ms a token on an H200 (docs/gpu.md, the third GPU session), and the
// CPU's passes began only after them; on this thread they run beside those passes. After each
// batch the thread records an event on each stream: ggml's Vulkan backend holds queued copies in a
// command buffer until then (or until the stream is synchronized), CUDA's start at once.
#pragma once

#include "ggml-backend.h"

#include <condition_variable>
#include <cstddef>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

class upload_queue {
public:
    struct upload {
        ggml_backend_t stream;  // the device's upload stream
        ggml_tensor * view;     // the device slot's view
        const void * src;       // pinned host memory (a host slot), untouched until finish()
        size_t size;
    };
    upload_queue() = default;
    ~upload_queue();
    upload_queue(const upload_queue &) = delete;
    upload_queue & operator=(const upload_queue &) = delete;

    // hands the uploads to the thread (started on first use) and returns at once
    void push(std::vector<upload> batch);
    // returns once everything pushed is queued and has arrived on its device; the ms the thread
    // spent queuing it since the last finish (0: nothing was pushed)
    double finish();
    // stops the thread and frees the events: before the streams they were recorded on go
    void close();

private:
    void thread_main();

    std::thread thread_;
    std::mutex mutex_;
    std::condition_variable wake_, idle_;
    std::vector<upload> pending_;
    bool busy_ = false, stop_ = false;
    double queue_ms_ = 0;
    std::set<ggml_backend_t> streams_;  // with uploads queued since the last finish
    std::map<ggml_backend_t, ggml_backend_event_t> events_;  // the thread's, per stream (null: the backend has none)
};

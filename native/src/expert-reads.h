// Reading experts into slots: which bytes of which file (the GGUF's HIGH copies, the LOW copies'
// source) go into which slot's memory, read on the loader threads and counted per layer.
#pragma once

#include "expert-budget.h"
#include "expert-layout.h"
#include "expert-store.h"
#include "loader.h"
#include "stats.h"
#include "upload-queue.h"

#include "ggml-backend.h"

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

class expert_reader {
public:
    // files: the GGUF of the HIGH copies (its shards: expert_layout::high_files); io_threads reads
    // in flight at once
    expert_reader(const std::vector<std::string> & files, expert_io io, int io_threads);
    void open_low(const std::vector<std::string> & files, expert_io io);  // the LOW copies' (low_files)
    expert_io io() const { return stores_[0]->io(); }                    // in effect

    // The reads that fill slot `slot` of pools (-1: none) with expert `expert` of layer l in
    // precision p, through slot host_slot of host (-1: none; in_host: it holds the expert already),
    // and of host_cpu (a host tier's second layout, host-tier.h) where given.
    std::vector<expert_read> reads_of(const moe_layer_layout & l, int expert, expert_precision p, const tier_pools & pools,
                                      int slot, const tier_pools * host = nullptr, int host_slot = -1, bool in_host = false,
                                      const tier_pools * host_cpu = nullptr) const;
    // Runs reads, several in flight, and counts them in st; returns the first error ("" if none).
    // queue_uploads: the uploads from host slots (pinned memory) are handed, once the reads are
    // done, to a thread that queues them on their device's own stream (upload-queue.h), and left in
    // flight for wait_uploads (mode split: they cross the link while the CPU computes its share of
    // the misses).
    std::string read_all(std::vector<expert_read> reads, expert_layer_stats & st, bool queue_uploads = false);
    struct uploads_arrived {
        double since_handed_ms = 0;  // from their handing over to the wait, before it waits
        double queue_ms = 0;         // the thread's time queuing them (the driver's calls)
    };
    // every upload handed over has arrived (all zero: none in flight)
    uploads_arrived wait_uploads();
    // hold(true) as uploads are handed over with none in flight, hold(false) once they have arrived:
    // split's prefetcher waits meanwhile, so that the next layer's guesses do not slow the uploads
    // the device's pass waits for
    void on_uploads(std::function<void(bool)> hold) { hold_ = std::move(hold); }
    ~expert_reader();

private:
    std::vector<std::unique_ptr<expert_store>> stores_, low_stores_;  // per file (shard)
    loader_threads loaders_;  // io_threads - 1 workers + the calling thread
    std::map<ggml_backend_dev_t, ggml_backend_t> upload_streams_;  // per device, made on first use (null: none)
    upload_queue uploads_;
    bool in_flight_ = false;                                       // uploads handed over since the last wait
    std::chrono::steady_clock::time_point handed_at_;              // when the last were handed over
    std::function<void(bool)> hold_;

    ggml_backend_t upload_stream(ggml_backend_dev_t device);
};

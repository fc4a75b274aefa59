// Reads experts' bytes from the GGUF file: O_DIRECT (ranges rounded out to 4 KiB into aligned
// buffers; the page cache does not silently hold the model), pread, or a private mmap.
#pragma once

#include "expert-options.h"

#include <cstdint>
#include <string>
#include <vector>

class expert_store {
public:
    // Opens path for reads in the requested mode. O_DIRECT falls back to buffered reads where the
    // filesystem refuses it (tmpfs); io() says which mode is in effect.
    expert_store(const std::string & path, expert_io requested);
    ~expert_store();
    expert_store(const expert_store &) = delete;
    expert_store & operator=(const expert_store &) = delete;

    // Copies the file's bytes [offset, offset + size) to dst. Returns the bytes read from storage
    // (with O_DIRECT, the 4 KiB-rounded range). Throws std::runtime_error on a short read, an I/O
    // error, or a file that was truncated or written in place since it was opened (size or
    // modification time changed: its bytes may belong to another model). A file replaced by a new
    // one (a rename over the path) is not seen: the open file keeps the old bytes, which still
    // match the loaded model. Safe to call from several threads at once.
    uint64_t read_range(uint64_t offset, uint64_t size, void * dst) const;

    expert_io io() const { return io_; }
    const std::string & path() const { return path_; }

    // Throws std::runtime_error where the file was truncated or written in place since it was
    // opened (read_range checks this after every read).
    void check_unchanged() const;

    static constexpr uint64_t kDirectAlignment = 4096;

private:
    std::string path_;
    expert_io   io_;
    int         fd_ = -1;
    void *      map_ = nullptr;
    uint64_t    map_bytes_ = 0;
    uint64_t    size_at_open_ = 0;
    int64_t     mtime_ns_at_open_ = 0;
};

struct ggml_tensor;

// What one expert_read did.
struct read_outcome {
    uint64_t bytes_read = 0;      // from storage (with O_DIRECT, the 4 KiB-rounded range)
    uint64_t bytes_read_low = 0;  // of those, LOW copies' bytes
    uint64_t bytes_uploaded = 0;  // written into device memory
    double   upload_ms = 0;

    void add(const read_outcome & o) {
        bytes_read += o.bytes_read; bytes_read_low += o.bytes_read_low;
        bytes_uploaded += o.bytes_uploaded; upload_ms += o.upload_ms;
    }
};

// One read of one projection of one expert into its slot.
struct expert_read {
    const expert_store * store;
    uint64_t offset, size;
    void * dst;        // host memory for the bytes (a host slot); nullptr: a staging buffer
    std::string what;  // for an error message: which expert, projection and layer
    // a slot written through its view (slot-pool.h: repacked, or in a device's memory): the bytes
    // go from dst (or the staging buffer) into it with ggml_backend_tensor_set
    ggml_tensor * view = nullptr;
    // a host tier in both layouts (host-tier.h): the slot's copy for the CPU, written from dst once
    // the bytes are read into it
    ggml_tensor * cpu_view = nullptr;
    bool in_dst = false;  // the bytes are in dst already (a host-tier hit): only the write through view
    bool low = false;     // a LOW copy (its bytes are counted apart)
    bool queued = false;  // the write through view is queued by the caller (expert_reader::read_all), not run here

    // an upload from a host slot (dst) into a device's memory: one the caller may queue
    bool uploads_from_dst() const;
    // Throws std::runtime_error naming what, the file offset and the file.
    read_outcome run() const;
};

#include "expert-store.h"

#include "ggml-backend.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>

namespace {

std::string errno_text(int err) { return std::string(strerror(err)); }

std::string range_text(uint64_t offset, uint64_t size) {
    return "bytes [" + std::to_string(offset) + ", " + std::to_string(offset + size) + ")";
}

// pread until size bytes arrived, EOF, or an error. Returns the bytes read.
uint64_t pread_full(int fd, void * dst, uint64_t size, uint64_t offset) {
    uint64_t done = 0;
    while (done < size) {
        ssize_t n = pread(fd, (char *) dst + done, size - done, (off_t) (offset + done));
        if (n < 0) {
            if (errno == EINTR) continue;
            throw std::runtime_error("read error at " + range_text(offset, size) + ": " + errno_text(errno));
        }
        if (n == 0) break;
        done += (uint64_t) n;
    }
    return done;
}

// One aligned bounce buffer per thread, grown on demand (O_DIRECT needs aligned memory).
struct aligned_buffer {
    void * data = nullptr;
    uint64_t bytes = 0;
    ~aligned_buffer() { free(data); }
    void * reserve(uint64_t need) {
        if (need > bytes) {
            free(data);
            data = nullptr;
            bytes = 0;
            if (posix_memalign(&data, expert_store::kDirectAlignment, need) != 0) throw std::bad_alloc();
            bytes = need;
        }
        return data;
    }
};

// A direct read whose range or destination is not aligned (llama.cpp's GGUFs align tensors to 32
// bytes) goes through a bounce buffer in pieces of this many bytes (a multiple of the alignment):
// a buffer the size of an expert (60 MiB for Mixtral's Q8_0) on each loader thread was memory no
// budget counted, and ended runs under a memory limit.
constexpr uint64_t kBounceBytes = 1ull << 20;

}  // namespace

expert_store::expert_store(const std::string & path, expert_io requested) : path_(path), io_(requested) {
    if (io_ == expert_io::direct) {
        fd_ = open(path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
        if (fd_ < 0 && errno == EINVAL) io_ = expert_io::buffered;  // the filesystem has no O_DIRECT
    }
    if (fd_ < 0) fd_ = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) throw std::runtime_error("cannot open " + path + ": " + errno_text(errno));
    struct stat st {};
    if (fstat(fd_, &st) != 0) {
        close(fd_);
        throw std::runtime_error("cannot stat " + path + ": " + errno_text(errno));
    }
    size_at_open_ = (uint64_t) st.st_size;
    mtime_ns_at_open_ = (int64_t) st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec;
    if (io_ == expert_io::mmap) {
        map_bytes_ = (uint64_t) st.st_size;
        map_ = mmap(nullptr, map_bytes_, PROT_READ, MAP_SHARED, fd_, 0);
        if (map_ == MAP_FAILED) {
            map_ = nullptr;
            close(fd_);
            throw std::runtime_error("cannot mmap " + path + ": " + errno_text(errno));
        }
        posix_madvise(map_, map_bytes_, POSIX_MADV_RANDOM);  // no read-ahead into other experts
    }
}

expert_store::~expert_store() {
    if (map_) munmap(map_, map_bytes_);
    if (fd_ >= 0) close(fd_);
}

void expert_store::check_unchanged() const {
    struct stat st {};
    if (fstat(fd_, &st) != 0) throw std::runtime_error("cannot stat " + path_ + ": " + errno_text(errno));
    const int64_t mtime_ns = (int64_t) st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec;
    if ((uint64_t) st.st_size == size_at_open_ && mtime_ns == mtime_ns_at_open_) return;
    if ((uint64_t) st.st_size < size_at_open_) {
        throw std::runtime_error("the file was truncated while running (" + std::to_string(size_at_open_) + " -> " +
                                 std::to_string((uint64_t) st.st_size) + " bytes)");
    }
    throw std::runtime_error("the file was modified while running (written in place): its experts no longer "
                             "match the loaded model; load the model again");
}

uint64_t expert_store::read_range(uint64_t offset, uint64_t size, void * dst) const {
    switch (io_) {
        case expert_io::buffered: {
            uint64_t got = pread_full(fd_, dst, size, offset);
            if (got != size) {
                throw std::runtime_error("short read at " + range_text(offset, size) + ": got " +
                                         std::to_string(got) + " bytes (file truncated?)");
            }
            check_unchanged();  // after the read: a change during it is caught too
            return size;
        }
        case expert_io::direct: {
            const uint64_t begin = offset & ~(kDirectAlignment - 1);
            const uint64_t end   = (offset + size + kDirectAlignment - 1) & ~(kDirectAlignment - 1);
            if (begin == offset && end == offset + size && (uintptr_t) dst % kDirectAlignment == 0) {
                // aligned at both ends (page-aligned slots, 4 KiB-aligned GGUF): straight into dst,
                // no bounce copy (a copy of every expert costs CPU time the compute threads need)
                if (pread_full(fd_, dst, size, offset) != size) {
                    throw std::runtime_error("short read at " + range_text(offset, size) + " (file truncated?)");
                }
                check_unchanged();
                return size;
            }
            thread_local aligned_buffer bounce;
            void * buf = bounce.reserve(std::min(end - begin, kBounceBytes));
            for (uint64_t at = begin; at < end; at += kBounceBytes) {
                const uint64_t piece = std::min(kBounceBytes, end - at);
                const uint64_t lo = std::max(at, offset), hi = std::min(at + piece, offset + size);
                // at the end of the file O_DIRECT returns the short tail: only the wanted part must be there
                const uint64_t got = pread_full(fd_, buf, piece, at);
                if (at + got < hi) {
                    throw std::runtime_error("short read at " + range_text(offset, size) + ": the file ends at " +
                                             std::to_string(at + got) + " (file truncated?)");
                }
                memcpy((char *) dst + (lo - offset), (const char *) buf + (lo - at), hi - lo);
            }
            check_unchanged();
            return end - begin;
        }
        case expert_io::mmap: {
            // touching a mapped page past the end of a truncated file would be SIGBUS: check first
            check_unchanged();
            if (offset + size > map_bytes_) {
                throw std::runtime_error("short read at " + range_text(offset, size) + ": the file ends at " +
                                         std::to_string(map_bytes_));
            }
            memcpy(dst, (const char *) map_ + offset, size);
            check_unchanged();
            return size;
        }
    }
    return 0;
}

// this thread's page-aligned buffer of at least size bytes (O_DIRECT reads go straight into it)
static void * staging_buffer(uint64_t size) {
    struct buffer {
        void * data = nullptr;
        uint64_t bytes = 0;
        ~buffer() { free(data); }
    };
    thread_local buffer b;
    if (b.bytes < size) {
        free(b.data);
        b.data = nullptr;
        b.bytes = 0;
        if (posix_memalign(&b.data, expert_store::kDirectAlignment, size) != 0) throw std::bad_alloc();
        b.bytes = size;
    }
    return b.data;
}

bool expert_read::uploads_from_dst() const { return view && dst && !ggml_backend_buffer_is_host(view->buffer); }

read_outcome expert_read::run() const {
    try {
        read_outcome out;
        if (!in_dst) out.bytes_read = store->read_range(offset, size, dst ? dst : staging_buffer(size));
        if (low) out.bytes_read_low = out.bytes_read;
        if (cpu_view && !in_dst) ggml_backend_tensor_set(cpu_view, dst, 0, size);
        if (!view || queued) return out;
        const auto t0 = std::chrono::steady_clock::now();
        ggml_backend_tensor_set(view, dst ? dst : staging_buffer(size), 0, size);
        if (!ggml_backend_buffer_is_host(view->buffer)) {
            out.bytes_uploaded = size;
            out.upload_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        }
        return out;
    } catch (const std::exception & ex) {
        throw std::runtime_error("cannot read " + what + " (file offset " + std::to_string(offset) + ") from " +
                                 store->path() + ": " + ex.what());
    }
}

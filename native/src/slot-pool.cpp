#include "slot-pool.h"

#include "expert-options.h"

#include <algorithm>
#include <cstdio>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include <sys/mman.h>

uint64_t expert_bytes_of(const expert_shapes & shapes) {
    uint64_t total = 0;
    for (const auto & s : shapes) total += s.present ? s.bytes : 0;
    return total;
}

std::vector<ggml_backend_dev_t> devices_named(const std::vector<std::string> & names) {
    std::vector<ggml_backend_dev_t> devices;
    for (const std::string & name : names) {
        devices.push_back(ggml_backend_dev_by_name(name.c_str()));
        if (!devices.back()) throw std::invalid_argument("no ggml device named '" + name + "'");
    }
    return devices;
}

// llama.cpp's CPU_REPACK buffer type, or nullptr where this CPU has none
static ggml_backend_buffer_type_t cpu_repack_buffer_type() {
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (!cpu) return nullptr;
    auto get_extra = (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(
        ggml_backend_dev_backend_reg(cpu), "ggml_backend_dev_get_extra_bufts");
    for (ggml_backend_buffer_type_t * b = get_extra ? get_extra(cpu) : nullptr; b && *b; b++) {
        if (strcmp(ggml_backend_buft_name(*b), "CPU_REPACK") == 0) return *b;
    }
    return nullptr;
}

// Whether llama.cpp repacks a tensor of this type and shape: the buffer type's init_tensor
// attaches its repacked kernels (tensor->extra) exactly when it does.
static bool repacks(ggml_backend_buffer_type_t repack, const ggml_tensor * t) {
    ggml_backend_buffer_t probe = ggml_backend_buft_alloc_buffer(repack, 1);
    if (!probe) return false;
    ggml_tensor copy = *t;
    copy.extra = nullptr;
    ggml_backend_buffer_init_tensor(probe, &copy);
    ggml_backend_buffer_free(probe);
    return copy.extra != nullptr;
}

bool cpu_repacks(ggml_type type, int64_t ne0, int64_t ne1, int64_t ne2) {
    ggml_backend_buffer_type_t repack = cpu_repack_buffer_type();
    if (!repack) return false;
    ggml_init_params params = { ggml_tensor_overhead() + 256, nullptr, /*no_alloc*/ true };
    ggml_context * ctx = ggml_init(params);
    if (!ctx) throw std::runtime_error("cpu_repacks: ggml_init failed");
    const bool out = repacks(repack, ggml_new_tensor_3d(ctx, type, ne0, ne1, ne2));
    ggml_free(ctx);
    return out;
}

// The most slots of pool (its ne[2]) that buft's device addresses in one tensor (Vulkan: its
// maxStorageBufferRange, 128 MiB on lavapipe): a larger pool would stop the graph's scheduler.
static int addressable_slots(ggml_backend_buffer_type_t buft, const ggml_tensor * pool) {
    ggml_backend_dev_t dev = buft && !ggml_backend_buft_is_host(buft) ? ggml_backend_buft_get_device(buft) : nullptr;
    auto fits = [&](int64_t slots) {
        ggml_tensor probe = *pool;  // the shape alone: the device's limits are on its bytes
        probe.ne[2] = slots;
        probe.nb[3] = probe.nb[2] * slots;
        return ggml_backend_dev_supports_op(dev, &probe);
    };
    if (!dev || fits(pool->ne[2])) return (int) pool->ne[2];
    int64_t lo = 0, hi = pool->ne[2];  // fits(lo), not fits(hi)
    while (hi - lo > 1) {
        const int64_t mid = (lo + hi) / 2;
        (fits(mid) ? lo : hi) = mid;
    }
    return (int) lo;
}

slot_pool::slot_pool(const expert_shapes & shapes, int n_slots, ggml_backend_buffer_type_t buft, bool repack_host)
    : shapes_(shapes), n_slots_(n_slots) {
    // the pools, and a view of every slot of those written through views
    ggml_init_params params = { ggml_tensor_overhead() * PROJ_COUNT * (2 + (size_t) n_slots) + 1024, nullptr, /*no_alloc*/ true };
    ctx_ = ggml_init(params);
    if (!ctx_) throw std::runtime_error("slot pool: ggml_init failed");
    static const char * names[PROJ_COUNT] = { "edgemoe_pool_up", "edgemoe_pool_gate", "edgemoe_pool_down", "edgemoe_pool_gate_up" };
    ggml_backend_buffer_type_t repack = buft || !repack_host ? nullptr : cpu_repack_buffer_type();
    // every plain projection's pool starts on a page: O_DIRECT reads of page-multiple experts then
    // go straight into their slots (expert_store::read_range)
    const uint64_t align = std::max<uint64_t>(kPageBytes, buft ? ggml_backend_buft_get_alignment(buft) : 0);
    auto round_up = [&](uint64_t n) { return (n + align - 1) / align * align; };
    uint64_t total = 0;
    std::array<uint64_t, PROJ_COUNT> offset{};
    std::array<bool, PROJ_COUNT> repacked{};
    for (int p = 0; p < PROJ_COUNT; p++) {
        if (!shapes[p].present) continue;
        tensors_[p] = ggml_new_tensor_3d(ctx_, shapes[p].type, shapes[p].ne0, shapes[p].ne1, n_slots);
        repacked[p] = repack && repacks(repack, tensors_[p]);
        if (repacked[p] && n_slots == 1) {
            // the repacked mul_mat_id takes only 3-D weights, and ggml_n_dims calls one slot 2-D:
            // a second slot, never used
            tensors_[p] = ggml_new_tensor_3d(ctx_, shapes[p].type, shapes[p].ne0, shapes[p].ne1, 2);
        }
        ggml_set_name(tensors_[p], names[p]);
        if (tensors_[p]->nb[2] != shapes[p].bytes) {
            free_all();
            throw std::runtime_error("slot pool: expert stride mismatch for " + std::string(names[p]));
        }
        if (const int most = addressable_slots(buft, tensors_[p]); most < n_slots) {
            free_all();
            char what[160];
            snprintf(what, sizeof(what), " pool (%d slots, %.1f MiB) is more than %s can address in one tensor (%d slots)",
                     n_slots, ggml_nbytes(tensors_[p]) / 1048576.0, ggml_backend_buft_name(buft), most);
            throw std::invalid_argument(std::string("the expert cache's ") + kExpertProjectionNames[p] + what +
                                        ": give a smaller --expert-cache, at most " + std::to_string(100 * most / n_slots) + "% of this one");
        }
        if (repacked[p]) continue;
        offset[p] = total;
        // a device may want more than the data: CUDA pads a quantized tensor's last row to 512
        total += round_up(buft ? ggml_backend_buft_get_alloc_size(buft, tensors_[p]) : ggml_nbytes(tensors_[p]));
    }
    auto fail = [&]() {
        const uint64_t want = bytes();
        free_all();
        throw std::runtime_error("slot pool: cannot allocate " + std::to_string(want) + " bytes for " +
                                 std::to_string(n_slots) + " expert slots" +
                                 (buft ? std::string(" in ") + ggml_backend_buft_name(buft) : std::string()));
    };
    if (total > 0) {
        if (buft) {
            buffer_ = ggml_backend_buft_alloc_buffer(buft, total);
            if (!buffer_) fail();
            ggml_backend_buffer_clear(buffer_, 0);  // a masked row may read any slot (moe hook)
            on_device_ = !ggml_backend_buffer_is_host(buffer_);
        } else {
            if (posix_memalign(&host_, kHugePageBytes, total) != 0) {
                host_ = nullptr;
                fail();
            }
            // huge pages: an O_DIRECT read into a slot then takes a few large segments instead of
            // one per 4 KiB page, and this virtual disk reads 2-3x faster so (docs/expert-residency.md,
            // "Huge pages for the slots"); where THP is off this does nothing
            madvise(host_, total, MADV_HUGEPAGE);
            buffer_ = ggml_backend_cpu_buffer_from_ptr(host_, total);
        }
        // the scheduler treats the pools like model weights (never as compute scratch)
        ggml_backend_buffer_set_usage(buffer_, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    }
    auto add_slot_views = [&](int p) {
        const ggml_tensor * t = tensors_[p];
        for (int s = 0; s < n_slots; s++) {
            ggml_tensor * view = ggml_view_3d(ctx_, tensors_[p], t->ne[0], t->ne[1], 1, t->nb[1], t->nb[2], (size_t) s * t->nb[2]);
            ggml_backend_view_init(view);  // repacked: attaches the repacked kernels to the view, as to the pool
            slot_views_[p].push_back(view);
        }
    };
    for (int p = 0; p < PROJ_COUNT; p++) {
        if (!tensors_[p]) continue;
        if (!repacked[p]) {
            ggml_backend_tensor_alloc(buffer_, tensors_[p], (char *) ggml_backend_buffer_get_base(buffer_) + offset[p]);
            if (on_device_) add_slot_views(p);
            continue;
        }
        ggml_backend_buffer_t buffer = ggml_backend_buft_alloc_buffer(repack, ggml_nbytes(tensors_[p]));
        if (!buffer) fail();
        repack_buffers_.push_back(buffer);
        ggml_backend_buffer_set_usage(buffer, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        ggml_backend_tensor_alloc(buffer, tensors_[p], ggml_backend_buffer_get_base(buffer));
        add_slot_views(p);
    }
}

void slot_pool::lock_in_memory() {
    std::vector<ggml_backend_buffer_t> buffers = repack_buffers_;
    if (buffer_ && ggml_backend_buffer_is_host(buffer_)) buffers.push_back(buffer_);
    for (ggml_backend_buffer_t b : buffers) {
        void * base = ggml_backend_buffer_get_base(b);
        const size_t size = ggml_backend_buffer_get_size(b);
        if (mlock(base, size) != 0) {
            throw std::runtime_error("--mlock: cannot lock " + std::to_string(size >> 20) + " MiB of the expert cache in "
                                     "memory: " + strerror(errno) + " (the limit: ulimit -l)");
        }
        locked_.emplace_back(base, size);
    }
}

void slot_pool::free_all() {
    for (const auto & [base, size] : locked_) munlock(base, size);
    locked_.clear();
    for (ggml_backend_buffer_t b : repack_buffers_) ggml_backend_buffer_free(b);
    repack_buffers_.clear();
    if (buffer_) ggml_backend_buffer_free(buffer_);  // does not own host_ (buft null)
    buffer_ = nullptr;
    free(host_);
    host_ = nullptr;
    if (ctx_) ggml_free(ctx_);
    ctx_ = nullptr;
}

slot_pool::~slot_pool() { free_all(); }

void * slot_pool::slot_data(expert_projection p, int slot) const {
    if (!slot_views_[p].empty()) return nullptr;
    return (char *) tensors_[p]->data + (size_t) slot * tensors_[p]->nb[2];
}

ggml_tensor * slot_pool::slot_view(expert_projection p, int slot) const {
    return slot_views_[p].empty() ? nullptr : slot_views_[p][slot];
}

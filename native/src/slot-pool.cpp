#include "slot-pool.h"

#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>

uint64_t expert_bytes_of(const expert_shapes & shapes) {
    uint64_t total = 0;
    for (const auto & s : shapes) total += s.present ? s.bytes : 0;
    return total;
}

slot_pool::slot_pool(const expert_shapes & shapes, int n_slots) : shapes_(shapes), n_slots_(n_slots) {
    ggml_init_params params = { ggml_tensor_overhead() * PROJ_COUNT + 1024, nullptr, /*no_alloc*/ true };
    ctx_ = ggml_init(params);
    if (!ctx_) throw std::runtime_error("slot pool: ggml_init failed");
    static const char * names[PROJ_COUNT] = { "edgemoe_pool_up", "edgemoe_pool_gate", "edgemoe_pool_down", "edgemoe_pool_gate_up" };
    // every projection's pool starts on a page: O_DIRECT reads of page-multiple experts then go
    // straight into their slots (expert_store::read_range)
    auto page_round = [](uint64_t n) { return (n + kPageBytes - 1) / kPageBytes * kPageBytes; };
    uint64_t total = 0;
    std::array<uint64_t, PROJ_COUNT> offset{};
    for (int p = 0; p < PROJ_COUNT; p++) {
        if (!shapes[p].present) continue;
        tensors_[p] = ggml_new_tensor_3d(ctx_, shapes[p].type, shapes[p].ne0, shapes[p].ne1, n_slots);
        ggml_set_name(tensors_[p], names[p]);
        if (tensors_[p]->nb[2] != shapes[p].bytes) {
            ggml_free(ctx_);
            throw std::runtime_error("slot pool: expert stride mismatch for " + std::string(names[p]));
        }
        offset[p] = total;
        total += page_round(ggml_nbytes(tensors_[p]));
    }
    if (posix_memalign(&host_, kPageBytes, std::max<uint64_t>(total, kPageBytes)) != 0) {
        host_ = nullptr;
        ggml_free(ctx_);
        throw std::runtime_error("slot pool: cannot allocate " + std::to_string(bytes()) + " bytes for " +
                                 std::to_string(n_slots) + " expert slots");
    }
    buffer_ = ggml_backend_cpu_buffer_from_ptr(host_, total);
    for (int p = 0; p < PROJ_COUNT; p++) {
        if (tensors_[p]) ggml_backend_tensor_alloc(buffer_, tensors_[p], (char *) host_ + offset[p]);
    }
    // the scheduler treats the pools like model weights (never as compute scratch)
    ggml_backend_buffer_set_usage(buffer_, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
}

slot_pool::~slot_pool() {
    if (buffer_) ggml_backend_buffer_free(buffer_);  // does not own host_
    free(host_);
    if (ctx_) ggml_free(ctx_);
}

void * slot_pool::slot_data(expert_projection p, int slot) const {
    return (char *) tensors_[p]->data + (size_t) slot * tensors_[p]->nb[2];
}

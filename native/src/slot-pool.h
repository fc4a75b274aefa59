// Slot pools: the fast-memory home of cached experts (which slot holds what: expert-cache.h).
// For one group of layers whose expert tensors have the same types and shapes, one 3-D tensor
// [ne0, ne1, n_slots] per projection; a cached expert is a slot index, the same in every
// projection's pool. ggml_mul_mat_id multiplies
// over the pools with slot ids exactly as it would over the stacked expert tensors.
//
// Host pools (the default) hold the file's layout; with repack_host (the model's repack), where
// llama.cpp would repack a resident expert tensor (its CPU_REPACK buffer type: Q4_0, Q4_K, IQ4_NL,
// MXFP4 on x86 AVX2), that projection's pool lives in a CPU_REPACK buffer too, so the same
// repacked kernels compute and the result is bit-identical to the resident repacked model. Such a
// slot is written through its view (slot_view), which converts the file's layout. Pools in another
// buffer type: a GPU's memory (written through slot views with ggml_backend_tensor_set, i.e.
// uploaded) or its pinned host memory (plain, CPU-addressable).
#pragma once

#include "expert-format.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <array>
#include <cstdint>
#include <string>
#include <vector>

// The type and shape of one projection's expert matrix; absent projections have present = false.
struct expert_matrix_shape {
    bool      present = false;
    ggml_type type    = GGML_TYPE_F32;
    int64_t   ne0 = 0, ne1 = 0;
    uint64_t  bytes = 0;  // one expert (nb[2] of the stacked tensor)

    bool operator==(const expert_matrix_shape & o) const {
        return present == o.present && type == o.type && ne0 == o.ne0 && ne1 == o.ne1 && bytes == o.bytes;
    }
};
using expert_shapes = std::array<expert_matrix_shape, PROJ_COUNT>;

uint64_t expert_bytes_of(const expert_shapes & shapes);  // all projections of one expert
// Whether llama.cpp's CPU backend would keep a repacked copy of a weight of this type and shape
// (its CPU_REPACK buffer type, where this CPU has one).
bool cpu_repacks(ggml_type type, int64_t ne0, int64_t ne1, int64_t ne2);

// The ggml devices named; throws std::invalid_argument for a name no device has.
std::vector<ggml_backend_dev_t> devices_named(const std::vector<std::string> & names);

class slot_pool {
public:
    // Allocates the pools in page-aligned host memory (buft null; repacked where llama.cpp would,
    // if repack_host) or in a buffer of buft (every slot zeroed). Throws std::runtime_error on failure.
    slot_pool(const expert_shapes & shapes, int n_slots, ggml_backend_buffer_type_t buft, bool repack_host);
    ~slot_pool();
    slot_pool(const slot_pool &) = delete;
    slot_pool & operator=(const slot_pool &) = delete;

    int n_slots() const { return n_slots_; }
    uint64_t bytes() const { return (uint64_t) n_slots_ * expert_bytes_of(shapes_); }
    const expert_shapes & shapes() const { return shapes_; }

    ggml_tensor * tensor(expert_projection p) const { return tensors_[p]; }
    // the slot's bytes in host memory; nullptr where they are written through slot_view
    void * slot_data(expert_projection p, int slot) const;
    // a repacked or device projection: the slot's view, to be written whole with
    // ggml_backend_tensor_set (repacked: the file's layout in, the repacked one stored); nullptr
    // for a plain host projection
    ggml_tensor * slot_view(expert_projection p, int slot) const;
    bool on_device() const { return on_device_; }  // in memory the CPU cannot address
    // mlock the pools' host memory (--mlock); throws std::runtime_error where the kernel refuses
    void lock_in_memory();

private:
    expert_shapes shapes_;
    int n_slots_;
    ggml_context * ctx_ = nullptr;
    void * host_ = nullptr;  // the plain pools' memory, wrapped by buffer_ (buft null)
    ggml_backend_buffer_t buffer_ = nullptr;  // the plain pools
    std::vector<ggml_backend_buffer_t> repack_buffers_;  // one per repacked projection
    std::vector<std::pair<void *, size_t>> locked_;  // by lock_in_memory, unlocked when freed
    std::array<std::vector<ggml_tensor *>, PROJ_COUNT> slot_views_;
    bool on_device_ = false;

    void free_all();

    static constexpr uint64_t kPageBytes = 4096;
    static constexpr uint64_t kHugePageBytes = 2ull << 20;  // x86-64's and arm64's usual THP size
    std::array<ggml_tensor *, PROJ_COUNT> tensors_{};
};

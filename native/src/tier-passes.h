// The passes of the expert FFN in one wave of a MoE layer (patch 0002 asks for them one by one) and
// what the layer's op writes for them. A pass runs mul_mat_id over one tier's pools in one
// precision: the device's (or, mode cpu, host memory's) HIGH and LOW pools, then with coop the host
// tier's (the CPU computes the device's misses there, HOBBIT sec. 4). The op writes one I32 tensor
// per wave, [n_used, n_tokens, planes()]: a plane of slot ids per pass, then a plane of output
// scales (F32 bits) per scaled pass.
//   CPU passes: -1 where the pass does not serve a selection (patch 0004 skips the row).
//   Device passes (masked): GPU kernels do not skip negative ids, so every id is a valid slot and
//   a mask (the scale, 0 where the pass does not serve) zeroes what the pass must not add.
//   Scaled passes: the masked ones; all of them with MoBiLE's little pass, whose kept selections
//   are renormalized through the scale (layer-planner.h).
#pragma once

#include "expert-format.h"
#include "layer-planner.h"
#include "link-balance.h"
#include "precision-policy.h"
#include "stats.h"

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <vector>

class expert_reader;
class slot_pool;
struct ggml_context;
struct ggml_tensor;
struct llama_moe_expert_pass;

// One pass: over the HIGH or LOW pools of the device (host false) or of the host tier (host true).
struct pass_kind {
    bool host;
    expert_precision precision;
};

class tier_passes {
public:
    // has_low: LOW pools; on_device: the pools are a GPU's (their passes masked); coop: host passes
    // after the device's; scale_all: every pass carries a scale (MoBiLE's little pass).
    // fewest_slots: the fewest slots of a device pool (an unserved op's masked ids come from them).
    // link_share (mode split, with coop): the share of a wave's misses uploaded, queued while the
    // CPU computes the others; refined as decode layers run where adapts (link-balance.h).
    tier_passes(bool has_low, bool on_device, bool coop, bool scale_all, int fewest_slots, double link_share = 0,
                bool adapts = false);
    tier_passes() = default;

    int size() const { return (int) passes_.size(); }
    const pass_kind & operator[](int q) const { return passes_[q]; }
    int n_masked() const { return n_masked_; }  // the first n_masked passes: device passes
    int n_scaled() const { return n_scaled_; }  // the first n_scaled passes carry a scale
    int planes() const { return size() + n_scaled_; }
    // the pass computing a selection served by a copy in this tier and precision (-1: none)
    int serving(bool host, expert_precision precision) const;
    // A wave's demands divided: on_device, those the device computes (the copies it holds, and the
    // misses it loads); on_cpu, those the CPU computes from the host tier: coop's misses, but for
    // split's uploaded share. The share s is a decode token's (one token an expert): an upload
    // costs (1 - s) / s of the CPU's work for one token of an expert, and an expert's tokens in the
    // wave (tokens, per demand; only split reads them) multiply the CPU's work and not the upload's bytes. So the misses
    // with the most tokens go to the link, as many as balance the two: m (1 - s) / s uploads'
    // worth against the tokens of the rest (a decode token: s of its misses; a prefill's experts
    // of many tokens: nearly all, for the device to compute). The fraction a wave's count leaves
    // is carried to the next wave: with a decode token's one or two misses a layer, rounding alone
    // would send them all one way.
    void divide(const std::vector<expert_demand> & wanted, const std::vector<int> & tokens,
                const std::function<bool(const expert_demand &)> & held_on_device,
                std::vector<expert_demand> & on_device, std::vector<expert_demand> & on_cpu);
    bool queues_uploads() const { return coop_ && link_share_ > 0; }
    double link_share() const { return queues_uploads() ? balance_.share() : 0.0; }  // split's, now
    bool cpu_computes_misses() const { return coop_; }  // coop, split

    // The graph's side. The pass the hook hands llama.cpp as pass `index` of a wave (patch 0002):
    // the CPU's passes first, so that a layer's CPU work enters the graph before the device's.
    int pass_at(int index) const { return order_[index]; }
    // What a wave's passes read besides the pools, from its slot-id tensor (the op's output):
    //   the CPU's passes (inputs): its planes, and masks [1, n_used, n_tokens, n_scaled] (a custom
    //     op; null without a scaled CPU pass);
    //   the device's (device_inputs, for the first device pass, after the CPU's): one tensor, so one
    //     copy to the device a wave: a custom op writes their slot ids (as F32) and scales, a plane
    //     each, then cpu_sum (the CPU's passes' output, F32; or null), and on the device a copy of
    //     it gives the masks [1, n_used, n_tokens, n_masked], a cast of that the slot ids [n_used,
    //     n_tokens, n_masked] and cpu_sum's copy, for the first device pass to be added to
    //     (llama_moe_expert_pass::previous; views, their planes 256 bytes apart). With queued
    //     uploads (split) that op runs once wait's reader's uploads have arrived, after the CPU's
    //     passes (their order above), so the uploads cross the link while the CPU computes; the
    //     wait is counted in wait's stats (upload_wait_ms, and cpu_pass_ms the time before it since
    //     the uploads were handed over, under its mutex), and its times refine the share.
    struct upload_wait {
        expert_reader * reader;
        expert_layer_stats * stats;
        std::mutex * mutex;
    };
    struct device_plan {  // the device plan op's userdata
        upload_wait wait;
        link_balance * balance;
        const tier_passes * owner;  // its passes, whether it waits for uploads, when the CPU's passes began
    };
    struct wave_inputs {
        ggml_tensor * slot_ids = nullptr, * masks = nullptr;
        ggml_tensor * device_ids = nullptr, * device_masks = nullptr, * device_cpu_sum = nullptr;
    };
    wave_inputs inputs(ggml_context * ctx, ggml_tensor * slot_ids, int il, int wave) const;
    void device_inputs(ggml_context * ctx, wave_inputs & in, ggml_tensor * cpu_sum, int il, int wave, const upload_wait & wait);
    // pass q: pool's tensors for the layer's stacked ones, the pass's slot ids and mask
    void fill_in(ggml_context * ctx, int q, const slot_pool & pool, const std::array<const ggml_tensor *, PROJ_COUNT> & stacked,
                 const wave_inputs & in, llama_moe_expert_pass * p) const;
    // the graph nodes n_waves waves of passes add at most
    uint32_t graph_nodes(int n_waves) const;

    // The op's side: nothing served (a failure), a well-defined output the graph ignores.
    void write_unserved(ggml_tensor * dst) const;
    // when the last wave's slot ids were written (pass_writer's end): its CPU's passes follow them,
    // counted to its device plan op as the wave's cpu_pass_ms
    std::chrono::steady_clock::time_point slots_written() const { return slots_written_; }

private:
    std::vector<pass_kind> passes_;  // device passes first
    std::vector<int> order_;         // pass_at
    int n_masked_ = 0, n_scaled_ = 0, fewest_slots_ = 0;
    bool coop_ = false;
    double link_share_ = 0;  // at load: > 0 where split uploads
    link_balance balance_;
    double carried_ = 0;  // split: uploads owed to the share by the waves before (within +-1/2)
    std::map<std::pair<int, int>, device_plan> plans_;  // per (il, wave): the device plan ops' userdata
    mutable std::chrono::steady_clock::time_point slots_written_;
    friend class pass_writer;
};

// Writes one wave's slot-id tensor dst, selection by selection.
class pass_writer {
public:
    // dst: [n_used, n_tokens, passes.planes()], contiguous
    pass_writer(const tier_passes & passes, ggml_tensor * dst);
    ~pass_writer() { passes_.slots_written_ = std::chrono::steady_clock::now(); }
    // selection i of token t is computed by pass `pass` (-1: by none) from `slot`, its output scaled
    void select(int64_t t, int64_t i, int pass, int32_t slot, float scale);
    // token t's selections are written: its masked rows get valid slots; n_slots[q]: pass q's pool's
    void end_token(int64_t t, const std::vector<int> & n_slots);

private:
    int32_t & at(int plane, int64_t t, int64_t i) { return out_[(plane * n_tokens_ + t) * n_used_ + i]; }
    const tier_passes & passes_;
    int32_t * out_;
    int64_t n_used_, n_tokens_;
};

// A masked pass's row of slot ids, one token's selections: each -1 (a selection the pass does not
// serve, its output scaled by 0) becomes the lowest slot the row does not use yet.
void fill_masked_row(int32_t * row, int n, int n_slots);

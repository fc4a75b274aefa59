#include "tier-passes.h"

#include "expert-reads.h"
#include "slot-pool.h"

#include "ggml.h"
#include "llama-graph.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

namespace {

// the scale planes hold each selection's output scale, an F32 stored in the I32 slot-id tensor
int32_t float_bits(float x) {
    int32_t bits;
    memcpy(&bits, &x, sizeof(bits));
    return bits;
}

// slot ids [n_used, n_tokens, n_passes + n_scaled] -> masks [1, n_used, n_tokens, n_scaled]: the
// output scales of the scaled passes (the planes after the slot ids; 0 where a pass does not serve)
void masks_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) nth; (void) userdata;
    if (ith != 0) return;
    const ggml_tensor * ids = dst->src[0];
    const int64_t n = ids->ne[0] * ids->ne[1], n_scaled = dst->ne[3];
    memcpy(dst->data, (const int32_t *) ids->data + (ids->ne[2] - n_scaled) * n, n * n_scaled * sizeof(float));
}

// A plane of the device's plan (a pass's slot ids or scales) starts a multiple of 256 bytes in: a
// view the device's kernels read starts at an offset its storage buffers may take (Vulkan's
// minStorageBufferOffsetAlignment is at most 256; CUDA asks for 128).
constexpr int64_t PLAN_ALIGN = 256 / sizeof(float);

// slot ids [n_used, n_tokens, n_passes + n_scaled] (and the CPU's passes' sum) -> the device's plan
// [stride, 2 n_masked + the sum's rows] (F32, each plane's n_used * n_tokens values first): the
// device passes' slot ids, then their scales, then the sum; in mode split once the uploads queued
// by the wave's op have arrived
void device_plan_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) nth;
    if (ith != 0) return;
    const auto & plan = *(const tier_passes::device_plan *) userdata;
    const auto t0 = std::chrono::steady_clock::now();
    if (plan.owner->cpu_computes_misses()) {  // the wave's CPU's passes ran since its op wrote the slot ids
        std::lock_guard<std::mutex> lock(*plan.wait.mutex);
        plan.wait.stats->cpu_pass_ms += std::chrono::duration<double, std::milli>(t0 - plan.owner->slots_written()).count();
    }
    if (plan.owner->queues_uploads()) {
        const expert_reader::uploads_arrived arrived = plan.wait.reader->wait_uploads();
        const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        std::lock_guard<std::mutex> lock(*plan.wait.mutex);
        plan.wait.stats->upload_wait_ms += ms;
        plan.wait.stats->queue_ms += arrived.queue_ms;
        plan.balance->arrived(arrived.since_handed_ms, ms);
    }
    const ggml_tensor * ids = dst->src[0];
    const int64_t n = ids->ne[0] * ids->ne[1], stride = dst->ne[0], n_masked = plan.owner->n_masked();
    const int32_t * in = (const int32_t *) ids->data;
    float * out = (float *) dst->data;
    std::fill(out, out + 2 * n_masked * stride, 0.0f);
    for (int64_t q = 0; q < n_masked; q++) {
        for (int64_t j = 0; j < n; j++) out[q * stride + j] = (float) in[q * n + j];  // exact: a pool has fewer than 2^24 slots
        memcpy(out + (n_masked + q) * stride, in + (plan.owner->size() + q) * n, n * sizeof(float));  // the scales (F32 bits)
    }
    if (const ggml_tensor * cpu_sum = dst->src[1]) memcpy(out + 2 * n_masked * stride, cpu_sum->data, ggml_nbytes(cpu_sum));
}

}  // namespace

tier_passes::tier_passes(bool has_low, bool on_device, bool coop, bool scale_all, int fewest_slots, double link_share,
                         bool adapts)
    : fewest_slots_(fewest_slots), coop_(coop), link_share_(link_share), balance_(link_share, adapts && link_share > 0) {
    passes_.push_back({ false, expert_precision::high });
    if (has_low) passes_.push_back({ false, expert_precision::low });
    n_masked_ = on_device ? size() : 0;
    if (coop) {
        passes_.push_back({ true, expert_precision::high });
        if (has_low) passes_.push_back({ true, expert_precision::low });
    }
    n_scaled_ = scale_all ? size() : n_masked_;
    for (int q = n_masked_; q < size(); q++) order_.push_back(q);  // the CPU's passes
    for (int q = 0; q < n_masked_; q++) order_.push_back(q);
}

int tier_passes::serving(bool host, expert_precision precision) const {
    for (int q = 0; q < size(); q++) {
        if (passes_[q].host == host && passes_[q].precision == precision) return q;
    }
    return -1;
}

// How many misses to upload (fractional), those of the most tokens first (tokens: descending):
// where m uploads, each worth r = (1 - s) / s of one token's CPU work, balance the tokens left.
static double balanced_uploads(const std::vector<int> & tokens, double s) {
    const size_t n = tokens.size();
    if (s <= 0 || n == 0) return 0;
    if (s >= 1) return (double) n;
    const double r = (1 - s) / s;
    double rest = 0;  // the tokens of misses m.. (the CPU's work if m are uploaded)
    for (int k : tokens) rest += k;
    for (size_t m = 0; m < n; m++) {
        // g(m) = m r - rest grows by r + tokens[m] from m to m + 1; it crosses 0 in this step
        const double g = m * r - rest;
        if (g + r + tokens[m] > 0) return m + -g / (r + tokens[m]);
        rest -= tokens[m];
    }
    return (double) n;
}

void tier_passes::divide(const std::vector<expert_demand> & wanted, const std::vector<int> & tokens,
                         const std::function<bool(const expert_demand &)> & held_on_device,
                         std::vector<expert_demand> & on_device, std::vector<expert_demand> & on_cpu) {
    if (!coop_) {  // the device serves every selection
        on_device.insert(on_device.end(), wanted.begin(), wanted.end());
        return;
    }
    std::vector<size_t> misses;
    for (size_t j = 0; j < wanted.size(); j++) {
        if (!held_on_device(wanted[j])) misses.push_back(j);
    }
    std::stable_sort(misses.begin(), misses.end(), [&](size_t a, size_t b) { return tokens[a] > tokens[b]; });
    std::vector<int> miss_tokens;
    for (size_t j : misses) miss_tokens.push_back(tokens[j]);
    const double share = balanced_uploads(miss_tokens, balance_.share());
    const long uploaded = std::clamp(std::lround(share + carried_), 0L, (long) misses.size());
    carried_ += share - uploaded;
    if (std::all_of(miss_tokens.begin(), miss_tokens.end(), [](int k) { return k == 1; })) {
        balance_.divided((int) uploaded, (int) (misses.size() - uploaded));  // a decode token's (as the share is)
    }
    std::vector<uint8_t> on_host(wanted.size(), 0);
    for (size_t i = uploaded; i < misses.size(); i++) on_host[misses[i]] = 1;
    for (size_t j = 0; j < wanted.size(); j++) (on_host[j] ? on_cpu : on_device).push_back(wanted[j]);
}

tier_passes::wave_inputs tier_passes::inputs(ggml_context * ctx, ggml_tensor * slot_ids, int il, int wave) const {
    wave_inputs in;
    in.slot_ids = slot_ids;
    if (n_scaled_ > n_masked_) {  // the CPU computes a scaled pass too
        in.masks = ggml_custom_4d(ctx, GGML_TYPE_F32, 1, slot_ids->ne[0], slot_ids->ne[1], n_scaled_, &slot_ids, 1, masks_op, 1, nullptr);
        ggml_format_name(in.masks, "edgemoe_masks-%d-%d", il, wave);
    }
    return in;
}

void tier_passes::device_inputs(ggml_context * ctx, wave_inputs & in, ggml_tensor * cpu_sum, int il, int wave, const upload_wait & wait) {
    GGML_ASSERT(!cpu_sum || (cpu_sum->type == GGML_TYPE_F32 && ggml_is_contiguous(cpu_sum)));
    device_plan * userdata = &(plans_[{ il, wave }] = { wait, &balance_, this });  // a map's entries stay where they are
    ggml_tensor * slot_ids = in.slot_ids;
    const int64_t n_used = slot_ids->ne[0], n_tokens = slot_ids->ne[1];
    const int64_t stride = (n_used * n_tokens + PLAN_ALIGN - 1) / PLAN_ALIGN * PLAN_ALIGN;
    const int64_t sum_rows = cpu_sum ? (ggml_nelements(cpu_sum) + stride - 1) / stride : 0;
    ggml_tensor * args[2] = { slot_ids, cpu_sum };
    ggml_tensor * plan = ggml_custom_4d(ctx, GGML_TYPE_F32, stride, 2 * n_masked_ + sum_rows, 1, 1, args, cpu_sum ? 2 : 1,
                                        device_plan_op, 1, userdata);
    ggml_format_name(plan, "edgemoe_device_plan-%d-%d", il, wave);
    // on the device (the scheduler places a node without weights beside the passes that read it):
    // a copy of the plan, and the slot ids cast from its first planes
    ggml_tensor * copy = ggml_cont(ctx, plan);
    ggml_tensor * ids = ggml_cast(ctx, ggml_view_2d(ctx, copy, stride, n_masked_, copy->nb[1], 0), GGML_TYPE_I32);
    const size_t row = n_used * sizeof(float), plane = stride * sizeof(float);
    in.device_ids = ggml_view_3d(ctx, ids, n_used, n_tokens, n_masked_, row, plane, 0);
    in.device_masks = ggml_view_4d(ctx, copy, 1, n_used, n_tokens, n_masked_, sizeof(float), row, plane, n_masked_ * plane);
    in.device_cpu_sum = cpu_sum ? ggml_view_3d(ctx, copy, cpu_sum->ne[0], cpu_sum->ne[1], cpu_sum->ne[2], cpu_sum->nb[1],
                                               cpu_sum->nb[2], 2 * n_masked_ * plane) : nullptr;
}

void tier_passes::fill_in(ggml_context * ctx, int q, const slot_pool & pool, const std::array<const ggml_tensor *, PROJ_COUNT> & stacked,
                          const wave_inputs & in, llama_moe_expert_pass * p) const {
    ggml_tensor * swapped[PROJ_COUNT] = {};
    for (int j = 0; j < PROJ_COUNT; j++) {
        if (stacked[j]) swapped[j] = pool.tensor((expert_projection) j);
    }
    const bool on_device = q < n_masked_;
    ggml_tensor * ids = on_device ? in.device_ids : in.slot_ids, * masks = on_device ? in.device_masks : in.masks;
    ggml_tensor * mask = q < n_scaled_ ? ggml_view_3d(ctx, masks, 1, masks->ne[1], masks->ne[2], masks->nb[1], masks->nb[2],
                                                       q * masks->nb[3]) : nullptr;
    *p = { swapped[PROJ_UP], swapped[PROJ_GATE], swapped[PROJ_DOWN], swapped[PROJ_GATE_UP],
           ggml_view_2d(ctx, ids, ids->ne[0], ids->ne[1], ids->nb[1], q * ids->nb[2]), mask,
           p->weights_normalized, p->probs, q == 0 ? in.device_cpu_sum : nullptr };
}

uint32_t tier_passes::graph_nodes(int n_waves) const {
    // a generous count of a pass's nodes: views, the projections' mul_mat_id, activations, biases,
    // the mask and the sum; and of a wave's: its op, the masks and the device's plan, copy, views and cast
    constexpr uint32_t kNodesPerPass = 24, kNodesPerWave = 10;
    return n_waves * (passes_.size() * kNodesPerPass + kNodesPerWave);
}

void tier_passes::write_unserved(ggml_tensor * dst) const {
    // masked passes: slots under a 0 scale; the others: -1 (skipped)
    const size_t plane = (size_t) dst->ne[0] * dst->ne[1];
    int32_t * out = (int32_t *) dst->data;
    std::fill(out, out + plane * passes_.size(), -1);
    for (size_t row = 0; row < plane * n_masked_ / dst->ne[0]; row++) {
        fill_masked_row(out + row * dst->ne[0], (int) dst->ne[0], fewest_slots_);
    }
    std::fill(out + plane * passes_.size(), out + plane * (passes_.size() + n_scaled_), float_bits(0.0f));
}

pass_writer::pass_writer(const tier_passes & passes, ggml_tensor * dst)
    : passes_(passes), out_((int32_t *) dst->data), n_used_(dst->ne[0]), n_tokens_(dst->ne[1]) {}

void pass_writer::select(int64_t t, int64_t i, int pass, int32_t slot, float scale) {
    const int n_passes = passes_.size();
    for (int q = 0; q < n_passes; q++) {
        at(q, t, i) = q == pass ? slot : -1;  // masked passes: filled by end_token
        if (q < passes_.n_scaled()) at(n_passes + q, t, i) = float_bits(q == pass ? scale : 0.0f);
    }
}

void pass_writer::end_token(int64_t t, const std::vector<int> & n_slots) {
    for (int q = 0; q < passes_.n_masked(); q++) fill_masked_row(&at(q, t, 0), (int) n_used_, n_slots[q]);
}

// The ids of a row must differ: CUDA's mul_mat_id (its MMQ/MMF helper and its sorted path) counts a
// slot once per token and leaves a repeated one's output unwritten, or stops on an assertion. With
// fewer slots than selections (a LOW pool at its minimum of n_used - 1) one repeats.
void fill_masked_row(int32_t * row, int n, int n_slots) {
    int next = 0;
    for (int i = 0; i < n; i++) {
        if (row[i] >= 0) continue;
        while (next < n_slots && std::find(row, row + n, next) != row + n) next++;
        row[i] = next < n_slots ? next++ : 0;
    }
}

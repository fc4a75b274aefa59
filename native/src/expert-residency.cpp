#include "expert-residency.h"

#include "expert-budget.h"
#include "expert-cache.h"
#include "expert-layout.h"
#include "expert-store.h"
#include "host-tier.h"
#include "layer-planner.h"
#include "loader.h"
#include "mode-chooser.h"
#include "moe-hook.h"
#include "overlap-meter.h"
#include "path-predictor.h"
#include "predictor.h"
#include "prefetch-coordinator.h"
#include "routing-recorder.h"
#include "slot-pool.h"

#include "llama-graph.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <unordered_map>

namespace {

using clock_type = std::chrono::steady_clock;

double ms_since(clock_type::time_point t0) {
    return std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
}

expert_cache_config cache_config_of(const expert_budget & budget, const expert_options & o, const expert_layout & layout) {
    std::vector<std::vector<int>> group_layers(layout.groups.size());
    for (const auto & l : layout.layers) group_layers[l.group].push_back(l.il);
    return { budget.high_slots, budget.low_slots, o.cache_policy, o.policy_weights, o.low_hit == low_hit_rule::accept,
             layout.n_layers, group_layers, layout.n_expert, o.fate_shallow, layout.n_expert_used };
}

// layers the predictor looks ahead: HOBBIT's walk prefetch_depth, Fate's and EdgeMoE's next layer;
// without prefetch, the next layer with tracing (calibration scores the guesses) or with LOW
// copies (a prefill ubatch reads the next layer's predicted experts ahead, read_ahead); 0: none
int predictor_depth(const expert_options & o, bool trace_routing, bool has_low) {
    switch (o.prefetch) {
        case prefetch_mode::hobbit:  return std::max(1, o.prefetch_depth);
        case prefetch_mode::fate:    return 1;
        case prefetch_mode::edgemoe: return 1;
        case prefetch_mode::none:    return trace_routing || has_low ? 1 : 0;
    }
    return 0;
}

// the mask planes hold each selection's output scale, an F32 stored in the I32 slot-id tensor
int32_t float_bits(float x) {
    int32_t bits;
    memcpy(&bits, &x, sizeof(bits));
    return bits;
}

int32_t id_at(const ggml_tensor * ids, int64_t i, int64_t t) {
    return *(const int32_t *) ((const char *) ids->data + i * ids->nb[0] + t * ids->nb[1]);
}

ggml_backend_dev_t device_named(const std::string & name) {
    if (name.empty()) return nullptr;
    ggml_backend_dev_t dev = ggml_backend_dev_by_name(name.c_str());
    if (!dev) throw std::invalid_argument("no ggml device named '" + name + "'");
    return dev;
}

std::string gib(uint64_t bytes) {
    char buf[64];
    snprintf(buf, sizeof(buf), "%.2f GiB", bytes / 1073741824.0);
    return buf;
}

// the device pools must fit in what the device has free
void check_device_room(ggml_backend_dev_t dev, uint64_t pool_bytes) {
    size_t free = 0, total = 0;
    ggml_backend_dev_memory(dev, &free, &total);
    if (total > 0 && pool_bytes > free) {
        throw expert_budget_error("the expert cache's " + std::to_string(pool_bytes) + " bytes (" + gib(pool_bytes) +
            ") do not fit in " + ggml_backend_dev_name(dev) + "'s free memory: " + std::to_string(free) + " bytes (" +
            gib(free) + ") free of " + std::to_string(total) + " (" + gib(total) + ")");
    }
}

}  // namespace

struct expert_residency::impl : moe_pass_builder {
    struct wave_op {  // one wave's custom op in a layer's graph: its userdata
        impl * owner;
        int il, wave;
    };
    struct building_layer {  // a layer's graph while build_pass fills in its passes
        ggml_tensor * ids = nullptr, * slot_ids = nullptr, * masks = nullptr;
        int waves = 0;
    };
    // One pass of the expert FFN within a wave: over the HIGH or LOW pools of the device (or, mode
    // cpu, host memory) or of the host tier (coop: the CPU computes the device's misses there).
    struct pass_kind {
        bool host;
        expert_precision precision;
    };

    impl(llama_model * model, const std::string & path, uint64_t budget_bytes, const expert_options & o, bool trace_routing,
         const expert_device_config & device);

    bool build_pass(int il, ggml_context * ctx, int pass, ggml_tensor * moe_input, ggml_tensor * weights,
                    ggml_tensor * previous, llama_moe_expert_pass * p) override;
    // the custom op of a wave: ids [n_used, n_tokens] (expert ids), weights and (wave 0, with a
    // predictor) the predicted router logits of the layers ahead -> dst [n_used, n_tokens,
    // n_passes] (slot ids per precision pass, -1 where a pass does not compute a selection, or
    // another wave does), loading misses; after wave 0, predictions and prefetches
    void place_experts(int il, int wave, const ggml_tensor * ids, const ggml_tensor * weights,
                       const ggml_tensor * predicted, ggml_tensor * dst);
    // wave 0 of a layer: settles the layer before, plans this one's waves
    bool begin_layer(const moe_layer_layout & l, const ggml_tensor * ids, const ggml_tensor * weights, ggml_tensor * dst);
    // places, loads and pins one wave's experts and writes their slot ids; false after a failure
    bool serve_wave(const moe_layer_layout & l, int wave, const ggml_tensor * ids, ggml_tensor * dst, clock_type::time_point t0);
    void predict_and_prefetch(const moe_layer_layout & l, const ggml_tensor * predicted, int64_t n_tokens);
    // with LOW copies, a prefill ubatch's plan of the next MoE layer from its predicted routing (the
    // guessed ids [n_tokens][k], the logits' rows row_bytes apart), for read_ahead: Fate's prefill
    void plan_guess(int next, const std::vector<int32_t> & guesses, const float * logits, size_t row_bytes, int64_t n_tokens);
    // what decides layer il's demands besides its routing (the little pass's keep aside)
    plan_rules rules_of(int il) const {
        plan_rules rules;
        rules.precision = options.precision();
        rules.fixed = fixed.empty() || fixed[il].empty() ? nullptr : fixed[il].data();
        rules.prefill_low_share = options.prefill_low_share;
        return rules;
    }
    bool needs_most_experts(int64_t n_tokens) const {
        return ::needs_most_experts(n_tokens, layout.n_expert_used, layout.n_expert);
    }
    // EdgeMoE: the next MoE layer's experts from this ubatch's paths so far (path statistics)
    void path_prefetch(const moe_layer_layout & l, int64_t n_tokens);
    // the precision of expert e of layer il: EdgeMoE's static map's, else `otherwise`
    expert_precision fixed_or(int il, int e, expert_precision otherwise) const {
        return fixed.empty() || fixed[il].empty() ? otherwise : fixed[il][e];
    }
    // the reads that fill the device slot `slot` (-1: none) with an expert, through the host slot
    // host_slot (-1: none; in_host: it holds the expert already)
    std::vector<expert_read> reads_of(const moe_layer_layout & l, int expert, expert_precision precision, int slot,
                                      int host_slot = -1, bool in_host = false) const;
    // the device's misses that its HIGH or LOW copy in the host tier serves (host placements, in
    // the device placements' order; slot -1 where none), reserving host slots for the others
    std::vector<expert_cache::placement> host_copies(int group, int il, const std::vector<const expert_cache::placement *> & loads);
    // reads on the loader threads, counted in st; the first error ("" if none)
    std::string read_all(std::vector<expert_read> reads, expert_layer_stats & st);
    std::vector<std::pair<int, int>> fill_order(const std::map<int, std::vector<int>> & ranking) const;
    // Prefill, after a wave was served: the layer's next wave is read while this one computes
    // (pipelined waves, wave_size); after its last wave, a lossless ubatch that needs nearly every
    // expert reads the next layer's experts into the slots its own leave.
    void read_ahead(const moe_layer_layout & l, int wave, int64_t n_tokens);
    // a read failed: nothing in flight, no pins, every slot free (they may hold partial data)
    void forget_cache() {
        coordinator.forget();
        cache.forget_all();
        if (host) {
            host->pins.forget();
            host->cache.forget_all();
        }
    }
    void release_wave() {
        coordinator.release_wave();
        if (host) host->pins.release();
    }
    // slots a wave's distinct experts may take: the device's HIGH slots (coop: and the host tier's)
    int wave_slots(int group) const {
        const int slots = high_pools[group]->n_slots();
        return options.mode == compute_mode::coop ? std::min(slots, host->budget.high_slots[group]) : slots;
    }
    // Whether a ubatch of n_tokens runs a layer in pipelined waves: it needs several waves (a
    // prefill under a small cache) on one tier, so each wave takes half the slots and the next
    // wave's reads (its planned experts, in their planned precisions) run in the other half while
    // it computes (read_ahead).
    // With LOW copies, so does a ubatch that needs most experts where both tiers hold them once but
    // not twice: no slots would be left to read the next layer ahead, so the layer reads its own
    // second half while its first computes.
    bool pipelined(int group, int64_t n_tokens) const {
        const int slots = wave_slots(group);
        if (options.mode == compute_mode::coop || slots < 2) return false;
        if (waves_needed(layout.n_expert, layout.n_expert_used, n_tokens, slots, layout.has_expert_bias) > 1) return true;
        const int64_t distinct = std::min<int64_t>(layout.n_expert, n_tokens * layout.n_expert_used);
        return layout.has_low && !layout.has_expert_bias && needs_most_experts(n_tokens) &&
               2 * distinct > slots + low_pools[group]->n_slots();
    }
    // most distinct experts per wave
    int wave_size(int group, int64_t n_tokens) const { return wave_slots(group) / (pipelined(group, n_tokens) ? 2 : 1); }
    void fail(const std::string & why, ggml_tensor * dst);
    void write_unserved(ggml_tensor * dst) const;
    bool has_failed() const { std::lock_guard<std::mutex> lock(mutex); return failed; }
    const slot_pool & pool(int group, expert_precision p) const { return p == expert_precision::low ? *low_pools[group] : *high_pools[group]; }

    expert_options options;
    expert_layout layout;
    expert_budget budget;
    expert_residency_info info;
    expert_store store;
    std::unique_ptr<expert_store> low_store;
    loader_threads loaders;                                    // io_threads - 1 workers + the op's thread
    ggml_backend_dev_t device;                                 // of the pools; nullptr: host memory (mode cpu)
    std::vector<std::unique_ptr<slot_pool>> high_pools, low_pools;  // per group
    expert_cache cache;
    std::unique_ptr<host_tier> host;                           // with a device, if budgeted
    std::vector<pass_kind> passes;                             // of each wave; device passes first (masked)
    int n_masked = 0;                                          // device passes: masks instead of negative ids
    int n_scaled = 0;                                          // passes with a mask (the masked; all with big-little)
    std::unique_ptr<expert_predictor> predictor;               // with prefetch or tracing
    routing_recorder recorder;
    prefetch_coordinator coordinator;
    std::map<int, std::vector<wave_op>> wave_ops;              // per il, per wave
    std::map<int, building_layer> building;                    // per il
    std::vector<std::vector<expert_demand>> planned_waves;     // the running layer's
    std::vector<predicted_expert> next_layer_guess;            // with LOW copies: the next layer's plan from the predictor (read_ahead)
    std::vector<uint8_t> planned_dropped;                      // its selections the little pass drops
    std::vector<float> planned_scale;                          // per token, its output's scale
    std::vector<std::vector<expert_precision>> fixed;          // per il: EdgeMoE's static map (empty: none)
    std::unique_ptr<path_predictor> paths;                     // EdgeMoE's predictor, once given its table
    std::map<int, std::vector<int32_t>> ubatch_ids;            // the running ubatch's routing per il (paths)
    std::atomic<bool> little{false};                           // MoBiLE: decode tokens compute top-k/2
    std::map<int, std::vector<int32_t>> little_choices;        // per il, the last little token's whole top-k
    std::vector<uint8_t> weights_normalized;                   // per il: llama.cpp normalizes its top-k weights
    overlap_meter overlap;                                     // Fate's bound on its extra prefetches
    std::vector<expert_layer_stats> stats;                     // per il
    mutable std::mutex mutex;                                  // stats, error, failed
    std::string error;
    bool failed = false;
    expert_fill_stats filled;
    int32_t ubatch_index = 0;
    std::unique_ptr<moe_hook_registration> hook;  // last: unregistered first
};

namespace {
// A masked pass's row of slot ids, one token's selections: each -1 (a selection the pass does not
// serve, its output scaled by 0) becomes the lowest slot the row does not use yet. The ids of a
// row must differ: CUDA's mul_mat_id (its MMQ/MMF helper and its sorted path) counts a slot once
// per token and leaves a repeated one's output unwritten, or stops on an assertion. With fewer
// slots than selections (a LOW pool at its minimum of n_used - 1) one repeats.
void fill_masked_row(int32_t * row, int n, int n_slots) {
    int next = 0;
    for (int i = 0; i < n; i++) {
        if (row[i] >= 0) continue;
        while (next < n_slots && std::find(row, row + n, next) != row + n) next++;
        row[i] = next < n_slots ? next++ : 0;
    }
}

std::vector<int> group_of_layers(const expert_layout & layout) {
    std::vector<int> out(layout.n_layers, -1);
    for (const auto & l : layout.layers) out[l.il] = l.group;
    return out;
}
}  // namespace

expert_residency::impl::impl(llama_model * model, const std::string & path, uint64_t budget_bytes,
                             const expert_options & o, bool trace_routing, const expert_device_config & dc)
    : options((check_expert_options(o), o)),
      layout(model, path, o.low_precision, o.low_from),
      budget(layout, budget_bytes, o.low_cache),
      store(path, o.io),
      loaders(o.io_threads),
      device(device_named(dc.device)),
      cache(cache_config_of(budget, o, layout)),
      recorder(predictor_depth(o, trace_routing, layout.has_low)),
      coordinator(cache, group_of_layers(layout), o.io_threads,
                  [this](int il, int e, expert_precision p, int slot) { return reads_of(*layout.layer_at(il), e, p, slot); }) {
    options.low_precision = layout.has_low;
    if ((options.mode == compute_mode::cpu) != !device) {
        throw std::invalid_argument(device ? "--mode cpu takes no device" : std::string("--mode ") + name_of(options.mode) +
                                    " needs a GPU device (a build with GGML_VULKAN=1 or GGML_CUDA=1)");
    }
    if (layout.has_low) low_store = std::make_unique<expert_store>(layout.low_source, o.io);
    if (o.static_precision && !layout.has_low) {
        throw std::invalid_argument("static_precision needs LOW expert copies (a multi-precision GGUF or low_from)");
    }
    if (o.big_little > 0 && layout.n_expert_used < 2) {
        throw std::invalid_argument("big_little needs a model that routes each token to 2 or more experts");
    }
    ggml_backend_buffer_type_t device_buft = device ? ggml_backend_dev_buffer_type(device) : nullptr;
    if (device) {
        uint64_t pool_bytes = 0;
        for (size_t g = 0; g < layout.groups.size(); g++) {
            pool_bytes += budget.high_slots[g] * expert_bytes_of(layout.groups[g].high);
            if (layout.has_low) pool_bytes += budget.low_slots[g] * expert_bytes_of(layout.groups[g].low);
        }
        check_device_room(device, pool_bytes);
    }
    for (size_t g = 0; g < layout.groups.size(); g++) {
        high_pools.push_back(std::make_unique<slot_pool>(layout.groups[g].high, budget.high_slots[g], device_buft, dc.repack));
        if (layout.has_low) low_pools.push_back(std::make_unique<slot_pool>(layout.groups[g].low, budget.low_slots[g], device_buft, dc.repack));
    }
    if (device && dc.host_bytes > 0) host = std::make_unique<host_tier>(layout, dc.host_bytes, o.low_cache, device);
    if (options.mode == compute_mode::automatic) {
        const mode_choice choice = choose_mode(*high_pools[0], host ? host->high_pools[0].get() : nullptr, dc.n_threads);
        options.mode = choice.mode;
        info.mode_reason = choice.reason;
    }
    if (options.mode == compute_mode::coop && !host) {
        throw std::invalid_argument("--mode coop computes the device's misses from the host tier: give it a --host-cache");
    }
    passes.push_back({ false, expert_precision::high });
    if (layout.has_low) passes.push_back({ false, expert_precision::low });
    n_masked = device ? (int) passes.size() : 0;
    if (options.mode == compute_mode::coop) {
        passes.push_back({ true, expert_precision::high });
        if (layout.has_low) passes.push_back({ true, expert_precision::low });
    }
    // MoBiLE's little pass renormalizes the weights it keeps through the masks
    n_scaled = options.big_little > 0 ? (int) passes.size() : n_masked;
    weights_normalized.assign(layout.n_layers, 0);

    stats.resize(layout.n_layers);
    std::vector<int> moe_layers;
    std::vector<std::pair<const ggml_tensor *, int>> hooked;
    for (const auto & l : layout.layers) {
        moe_layers.push_back(l.il);
        for (const ggml_tensor * t : l.stacked) if (t) hooked.emplace_back(t, l.il);
        const int slots = wave_size(l.group, layout.n_expert);  // a ubatch of n_expert tokens: the most waves
        for (int w = 0; w < (layout.n_expert + slots - 1) / slots; w++) wave_ops[l.il].push_back({ this, l.il, w });
    }
    const int depth = predictor_depth(o, trace_routing, layout.has_low);
    if (depth > 0 && o.prefetch != prefetch_mode::edgemoe) {
        predictor = std::make_unique<expert_predictor>(model, moe_layers, depth, layout.n_expert);
    }

    info.budget_bytes = budget.budget_bytes;
    info.minimum_bytes = budget.minimum_bytes;
    for (const auto & p : high_pools) { info.high_pool_bytes += p->bytes(); info.high_slots += p->n_slots(); }
    for (const auto & p : low_pools) { info.low_pool_bytes += p->bytes(); info.low_slots += p->n_slots(); }
    if (host) {
        info.host_pool_bytes = host->bytes();
        for (const auto & p : host->high_pools) info.host_high_slots += p->n_slots();
        for (const auto & p : host->low_pools) info.host_low_slots += p->n_slots();
    }
    info.device = device ? ggml_backend_dev_name(device) : "";
    info.expert_bytes = layout.high_bytes;
    info.low_expert_bytes = layout.low_bytes;
    info.n_expert = layout.n_expert;
    info.n_expert_used = layout.n_expert_used;
    info.n_layers = layout.n_layers;
    info.max_ubatch_tokens = budget.max_ubatch_tokens;
    info.io = store.io();
    info.mixed_precision = layout.has_low;
    info.low_source = layout.low_source;
    info.predictor_depth = depth;
    // every wave's op and passes, in every layer (a generous count of a pass's nodes: views, the
    // projections' mul_mat_id, activations, biases, the mask and the sum)
    constexpr uint32_t kNodesPerPass = 24, kNodesPerWave = 4;
    uint32_t extra_nodes = 0;
    for (const auto & [il, ops] : wave_ops) extra_nodes += ops.size() * (passes.size() * kNodesPerPass + kNodesPerWave);
    hook = std::make_unique<moe_hook_registration>(*this, hooked, extra_nodes);
}

namespace {
void place_experts_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) nth;
    if (ith != 0) return;
    auto * op = (expert_residency::impl::wave_op *) userdata;
    // wave 0: src[2] is the predicted router logits (if any); later waves: the passes before
    const ggml_tensor * predicted = op->wave == 0 ? dst->src[2] : nullptr;
    op->owner->place_experts(op->il, op->wave, dst->src[0], dst->src[1], predicted, dst);
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
}  // namespace

bool expert_residency::impl::build_pass(int il, ggml_context * ctx, int pass, ggml_tensor * moe_input, ggml_tensor * weights,
                                        ggml_tensor * previous, llama_moe_expert_pass * p) {
    const moe_layer_layout & l = *layout.layer_at(il);
    const int n_passes = (int) passes.size();
    building_layer & b = building[il];
    if (pass == 0) {
        const ggml_tensor * given[PROJ_COUNT] = { p->up_exps, p->gate_exps, p->down_exps, p->gate_up_exps };
        for (int q = 0; q < PROJ_COUNT; q++) GGML_ASSERT(given[q] == l.stacked[q]);
        b.ids = p->ids;
        weights_normalized[il] = p->weights_normalized;
        b.waves = waves_needed(layout.n_expert, layout.n_expert_used, p->ids->ne[1], wave_size(l.group, p->ids->ne[1]),
                               layout.has_expert_bias);
    }
    const int wave = pass / n_passes, index = pass % n_passes;
    if (wave >= b.waves) return false;
    ggml_tensor * ids = b.ids;
    if (index == 0) {
        // one op per wave writes the slot ids of all its passes; a later wave's op runs after the
        // passes before it (previous), whose slots it may reuse
        ggml_tensor * args[3] = { ids, weights, nullptr };
        int n_args = 2;
        if (wave > 0) {
            args[n_args++] = previous;
        } else if (ggml_tensor * routers = predictor ? predictor->stacked(il) : nullptr) {
            // HOBBIT's stacking computer: one matmul predicts the router logits of the layers ahead
            args[n_args++] = ggml_mul_mat(ctx, routers, ggml_reshape_2d(ctx, moe_input, moe_input->ne[0], ids->ne[1]));
        }
        // one task: the op is bookkeeping plus I/O, the other threads have nothing to do in it
        b.slot_ids = ggml_custom_4d(ctx, GGML_TYPE_I32, ids->ne[0], ids->ne[1], n_passes + n_scaled, 1, args, n_args,
                                    place_experts_op, 1, &wave_ops[il][wave]);
        ggml_format_name(b.slot_ids, "edgemoe_slot_ids-%d-%d", il, wave);
        if (n_scaled > 0) {
            b.masks = ggml_custom_4d(ctx, GGML_TYPE_F32, 1, ids->ne[0], ids->ne[1], n_scaled, &b.slot_ids, 1, masks_op, 1, nullptr);
            ggml_format_name(b.masks, "edgemoe_masks-%d-%d", il, wave);
        }
    }
    const pass_kind kind = passes[index];
    const slot_pool & pl = kind.host ? host->pool(l.group, kind.precision) : pool(l.group, kind.precision);
    ggml_tensor * swapped[PROJ_COUNT] = {};
    for (int q = 0; q < PROJ_COUNT; q++) {
        if (l.stacked[q]) swapped[q] = pl.tensor((expert_projection) q);
    }
    ggml_tensor * mask = index < n_scaled ? ggml_view_3d(ctx, b.masks, 1, ids->ne[0], ids->ne[1], b.masks->nb[1], b.masks->nb[2],
                                                         index * b.masks->nb[3]) : nullptr;
    *p = { swapped[PROJ_UP], swapped[PROJ_GATE], swapped[PROJ_DOWN], swapped[PROJ_GATE_UP],
           ggml_view_2d(ctx, b.slot_ids, ids->ne[0], ids->ne[1], b.slot_ids->nb[1], index * b.slot_ids->nb[2]), mask,
           p->weights_normalized };
    return true;
}

void expert_residency::impl::fail(const std::string & why, ggml_tensor * dst) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!failed) error = why;
    failed = true;
    write_unserved(dst);
}

void expert_residency::impl::write_unserved(ggml_tensor * dst) const {
    // nothing served: a well-defined (ignored) output. Masked passes: slots under a 0 scale;
    // the others: -1 (skipped)
    const size_t plane = (size_t) dst->ne[0] * dst->ne[1];
    int32_t * out = (int32_t *) dst->data;
    std::fill(out, out + plane * passes.size(), -1);
    int min_slots = INT_MAX;
    for (const auto * pools : { &high_pools, &low_pools }) for (const auto & p : *pools) min_slots = std::min(min_slots, p->n_slots());
    for (size_t row = 0; row < plane * n_masked / dst->ne[0]; row++) fill_masked_row(out + row * dst->ne[0], (int) dst->ne[0], min_slots);
    std::fill(out + plane * passes.size(), out + plane * (passes.size() + n_scaled), float_bits(0.0f));
}

void expert_residency::impl::place_experts(int il, int wave, const ggml_tensor * ids, const ggml_tensor * weights,
                                           const ggml_tensor * predicted, ggml_tensor * dst) {
    const auto t0 = clock_type::now();
    GGML_ASSERT(ids->type == GGML_TYPE_I32 && dst->type == GGML_TYPE_I32 && ggml_is_contiguous(dst));
    GGML_ASSERT(weights->type == GGML_TYPE_F32);
    if (has_failed()) {  // a load failed earlier in this decode
        write_unserved(dst);
        return;
    }
    const moe_layer_layout & l = *layout.layer_at(il);
    if (wave == 0 && !begin_layer(l, ids, weights, dst)) return;
    if (wave == 0) overlap.layer_began(t0, ubatch_index);
    if (!serve_wave(l, wave, ids, dst, t0)) return;
    if (wave == 0 && predicted) predict_and_prefetch(l, predicted, ids->ne[1]);
    if (wave == 0 && paths && options.prefetch == prefetch_mode::edgemoe) path_prefetch(l, ids->ne[1]);
    read_ahead(l, wave, ids->ne[1]);
    if (wave == 0) coordinator.top_up_fill();
    overlap.layer_ended(clock_type::now(), ubatch_index);
}

bool expert_residency::impl::begin_layer(const moe_layer_layout & l, const ggml_tensor * ids, const ggml_tensor * weights,
                                         ggml_tensor * dst) {
    const int64_t n_tokens = ids->ne[1];
    const int k = (int) ids->ne[0];
    if (l.il == layout.layers.front().il) { cache.advance_tokens(n_tokens); ubatch_index++; ubatch_ids.clear(); }
    // the layer before has been computed: its experts may go; finished prefetches are cached
    release_wave();
    // lossy: every prefetch read is over before this layer places its experts (a read in flight
    // pins its slot, so which slots a placement may evict would depend on the reads' speed)
    if (options.lossy()) coordinator.wait_in_flight();
    const std::string read_error = coordinator.collect_finished();
    if (!read_error.empty()) {
        forget_cache();
        fail(read_error, dst);
        return false;
    }
    // predictions for this layer are settled: mispredicted experts may go
    coordinator.settle(l.il);

    // the routing as [n_tokens][k] arrays (weights: [1, k, n_tokens])
    std::vector<int32_t> id((size_t) n_tokens * k);
    std::vector<float> w((size_t) n_tokens * k);
    for (int64_t t = 0; t < n_tokens; t++) {
        for (int i = 0; i < k; i++) {
            id[t * k + i] = id_at(ids, i, t);
            w[t * k + i] = *(const float *) ((const char *) weights->data + i * weights->nb[1] + t * weights->nb[2]);
        }
    }
    recorder.on_layer(l.il, ubatch_index, id.data(), w.data(), n_tokens, k);
    // MoBiLE's little pass: a decode token keeps its top-k/2 (the whole top-k is remembered for
    // the big pass's prefetch)
    const bool little_pass = little && n_tokens == 1;
    if (little_pass) little_choices[l.il] = id;
    if (paths) ubatch_ids[l.il] = id;
    plan_rules rules = rules_of(l.il);
    rules.keep = little_pass ? k / 2 : 0;
    const int high_slots = wave_size(l.group, n_tokens);
    const int n_waves = waves_needed(layout.n_expert, k, n_tokens, high_slots, layout.has_expert_bias);
    layer_plan plan = plan_layer(id.data(), w.data(), n_tokens, k, layout.n_expert, rules, n_waves, high_slots,
        [&](int e, expert_precision demand) {
            return cache.serving_tier(l.group, make_expert_key(l.il, e), demand) != expert_precision::skip;
        });
    if (!plan.error.empty()) {
        fail("layer " + std::to_string(l.il) + ": " + plan.error, dst);
        return false;
    }
    planned_waves = std::move(plan.waves);
    planned_dropped = std::move(plan.dropped);
    // a model that normalizes its top-k weights, routed to fewer experts, normalizes over those
    planned_scale.assign(n_tokens, 1.0f);
    for (int64_t t = 0; little_pass && weights_normalized[l.il] && t < n_tokens; t++) {
        double all = 0, kept = 0;
        for (int i = 0; i < k; i++) {
            all += w[t * k + i];
            kept += planned_dropped[t * k + i] ? 0.0 : w[t * k + i];
        }
        if (kept > 0) planned_scale[t] = (float) (all / kept);
    }
    return true;
}

bool expert_residency::impl::serve_wave(const moe_layer_layout & l, int wave, const ggml_tensor * ids, ggml_tensor * dst,
                                        clock_type::time_point t0) {
    const int64_t n_used = ids->ne[0], n_tokens = ids->ne[1];
    if (wave > 0) release_wave();  // the wave before has been computed: its experts may go
    const std::vector<expert_demand> none;
    const auto & wanted = wave < (int) planned_waves.size() ? planned_waves[wave] : none;
    // coop: the device computes what it holds, the CPU the rest (from the host tier)
    std::vector<expert_demand> on_device, on_cpu;
    for (const auto & d : wanted) {
        const bool held = d.second == expert_precision::skip ||
                          cache.serving_tier(l.group, make_expert_key(l.il, d.first), d.second) != expert_precision::skip;
        (options.mode != compute_mode::coop || held ? on_device : on_cpu).push_back(d);
    }
    std::vector<expert_cache::placement> placed, on_host;
    try {
        placed = cache.place(l.group, l.il, on_device);
    } catch (const std::exception &) {
        // prefetches in flight may hold the slots an on-demand load needs: they give way
        coordinator.drop_all();
        try {
            placed = cache.place(l.group, l.il, on_device);
        } catch (const std::exception & ex) {
            fail(ex.what(), dst);
            return false;
        }
    }
    if (!on_cpu.empty()) {
        try {
            on_host = host->cache.place(l.group, l.il, on_cpu);
        } catch (const std::exception & ex) {
            fail(std::string("host cache: ") + ex.what(), dst);
            return false;
        }
    }

    expert_layer_stats st;
    st.requests = placed.size() + on_host.size();
    std::vector<const expert_cache::placement *> loads;
    std::vector<std::shared_ptr<prefetch_job>> claimed;
    bool waited = false;  // for a prefetch read in flight
    std::unordered_map<int, std::pair<const expert_cache::placement *, bool>> where;  // expert -> (placement, on the host)
    for (const auto & p : placed) {
        where[p.expert] = { &p, false };
        if (p.has_evicted) coordinator.evicted({ p.evicted, p.precision });
        if (p.precision == expert_precision::skip) { st.skipped++; continue; }
        const bool high = p.precision == expert_precision::high;
        const cached_copy copy = { make_expert_key(l.il, p.expert), p.precision };
        coordinator.use(copy);
        if (p.load) { loads.push_back(&p); (high ? st.loads_high : st.loads_low)++; continue; }
        (high ? st.hits_high : st.hits_low)++;
        if (auto job = coordinator.claim(copy, &waited)) claimed.push_back(job);
    }
    // the device's loads: through the host tier when there is one (its copy, or read into it)
    std::vector<expert_read> reads;
    const std::vector<expert_cache::placement> from_host = host ? host_copies(l.group, l.il, loads) : std::vector<expert_cache::placement>();
    for (size_t j = 0; j < loads.size(); j++) {
        const auto & p = *loads[j];
        const int host_slot = from_host.empty() ? -1 : from_host[j].slot;
        if (host_slot >= 0) (from_host[j].load ? st.host_loads : st.host_hits)++;
        if (device) st.uploads++;
        for (expert_read & r : reads_of(l, p.expert, p.precision, p.slot, host_slot, host_slot >= 0 && !from_host[j].load)) {
            reads.push_back(std::move(r));
        }
    }
    // coop: the CPU's experts, read into the host tier where missing
    for (const auto & p : on_host) {
        where[p.expert] = { &p, true };
        host->pins.add({ make_expert_key(l.il, p.expert), p.precision });
        st.cpu_experts++;
        if (!p.load) { st.host_hits++; continue; }
        st.host_loads++;
        for (expert_read & r : reads_of(l, p.expert, p.precision, -1, p.slot, false)) reads.push_back(std::move(r));
    }
    st.hits = st.hits_high + st.hits_low;
    st.misses = st.loads_high + st.loads_low + on_host.size();
    std::string read_error = waited ? coordinator.collect_finished() : std::string();

    const bool any_reads = !reads.empty() || !claimed.empty();
    if (read_error.empty() && any_reads) {
        // the misses and the claimed prefetches are read together, several in flight
        for (const auto & job : claimed) reads.insert(reads.end(), job->reads.begin(), job->reads.end());
        coordinator.pause_for_loads();
        read_error = read_all(std::move(reads), st);
        coordinator.resume_after_loads();
        overlap.experts_read((int) (loads.size() + on_host.size() + claimed.size()), st.load_ms);
    }
    for (const auto & job : claimed) coordinator.claimed_done(*job);
    if (!read_error.empty()) {
        forget_cache();
        fail(read_error, dst);
        return false;
    }

    // per pass: slot ids for the selections it serves; the others -1, or (masked) slot 0; the
    // scaled passes' output scales (0 where they do not serve) in the planes after the slot ids
    const int n_passes = (int) passes.size();
    int32_t * out = (int32_t *) dst->data;
    auto at = [&](int plane, int64_t t, int64_t i) -> int32_t & { return out[(plane * n_tokens + t) * n_used + i]; };
    for (int64_t t = 0; t < n_tokens; t++) {
        for (int64_t i = 0; i < n_used; i++) {
            auto it = planned_dropped[t * n_used + i] ? where.end() : where.find(id_at(ids, i, t));
            const expert_cache::placement * p = it == where.end() ? nullptr : it->second.first;
            int serving = -1;  // the pass that computes this selection
            if (p && p->precision != expert_precision::skip) {
                for (int q = 0; q < n_passes; q++) {
                    if (passes[q].host == it->second.second && passes[q].precision == p->precision) serving = q;
                }
            }
            for (int q = 0; q < n_passes; q++) {
                at(q, t, i) = q == serving ? p->slot : -1;  // masked passes: filled below
                if (q < n_scaled) at(n_passes + q, t, i) = float_bits(q == serving ? planned_scale[t] : 0.0f);
            }
            if (!p) continue;
            (p->precision == expert_precision::high ? st.selections_high
             : p->precision == expert_precision::low ? st.selections_low : st.selections_skip)++;
        }
        for (int q = 0; q < n_masked; q++) fill_masked_row(&at(q, t, 0), (int) n_used, pool(l.group, passes[q].precision).n_slots());
    }
    st.stall_ms = !any_reads && !waited ? 0.0 : ms_since(t0);
    std::lock_guard<std::mutex> lock(mutex);
    stats[l.il].add(st);
    return true;
}

std::vector<expert_cache::placement> expert_residency::impl::host_copies(int group, int il,
                                                                         const std::vector<const expert_cache::placement *> & loads) {
    std::vector<expert_demand> wanted;
    for (const auto * p : loads) wanted.emplace_back(p->expert, p->precision);
    std::vector<expert_cache::placement> placed;
    try {
        placed = host->cache.place(group, il, wanted);
    } catch (const std::exception &) {
        // too few host slots for this wave's loads: they go straight to the device
        return std::vector<expert_cache::placement>(loads.size(), expert_cache::placement{ -1, expert_precision::skip, -1, false });
    }
    std::unordered_map<int, const expert_cache::placement *> by_expert;
    for (const auto & p : placed) by_expert[p.expert] = &p;
    std::vector<expert_cache::placement> out;
    for (const auto * d : loads) {
        expert_cache::placement h = *by_expert.at(d->expert);
        // a HIGH copy serving a LOW demand cannot fill a LOW device slot: read that one directly
        if (h.precision != d->precision) h = { d->expert, expert_precision::skip, -1, false };
        else host->pins.add({ make_expert_key(il, d->expert), h.precision });
        out.push_back(h);
    }
    return out;
}

std::vector<expert_read> expert_residency::impl::reads_of(const moe_layer_layout & l, int expert, expert_precision precision,
                                                          int slot, int host_slot, bool in_host) const {
    const bool low = precision == expert_precision::low;
    const expert_store & source = low ? *low_store : store;
    std::vector<expert_read> reads;
    for (int p = 0; p < PROJ_COUNT; p++) {
        if (!l.stacked[p]) continue;
        const uint64_t size = (slot >= 0 ? pool(l.group, precision) : host->pool(l.group, precision)).shapes()[p].bytes;
        const uint64_t offset = (low ? l.low_offset[p] : l.high_offset[p]) + (uint64_t) expert * size;
        const auto proj = (expert_projection) p;
        // the bytes go into the host slot (if any), else the device slot's memory (host pools) or a
        // staging buffer, and from there through the device slot's view (if any)
        void * dst = host_slot >= 0 ? host->pool(l.group, precision).slot_data(proj, host_slot)
                                    : pool(l.group, precision).slot_data(proj, slot);
        reads.push_back({ &source, offset, size, dst,
                          std::string(low ? "the LOW copy of " : "") + "expert " + std::to_string(expert) + " of layer " +
                          std::to_string(l.il) + " (" + kExpertProjectionNames[p] + ")",
                          slot >= 0 ? pool(l.group, precision).slot_view(proj, slot) : nullptr, in_host, low });
    }
    return reads;
}

void expert_residency::impl::predict_and_prefetch(const moe_layer_layout & l, const ggml_tensor * predicted, int64_t n_tokens) {
    const std::vector<int> & ahead = predictor->ahead(l.il);
    const int k = layout.n_expert_used, n_expert = layout.n_expert;
    auto row = [&](int64_t t, size_t d) {
        return (const float *) ((const char *) predicted->data + t * predicted->nb[1]) + d * n_expert;
    };
    // the top-k guesses for each layer ahead, scored when it runs
    std::vector<int> top;
    std::vector<float> w;
    for (size_t d = 0; d < ahead.size(); d++) {
        std::vector<int32_t> guesses(n_tokens * k);
        for (int64_t t = 0; t < n_tokens; t++) {
            predicted_top_k(row(t, d), n_expert, k, top, w);
            std::copy(top.begin(), top.end(), guesses.begin() + t * k);
        }
        if (d == 0) plan_guess(ahead[0], guesses, row(0, 0), predicted->nb[1], n_tokens);
        recorder.remember(ahead[d], d, ahead.size(), std::move(guesses));
    }
    if (options.prefetch == prefetch_mode::none || !coordinator.prefetching() || n_tokens != 1) return;  // prefetching serves decode
    if (coordinator.judged_useless()) return;

    // HOBBIT's walk (or Fate's next layer): the predictions walked are pinned until their layer
    // runs; those not cached are prefetched into reserved slots
    const bool fate = options.prefetch == prefetch_mode::fate;
    // Fate's extra experts: as many as the compute between layers hides (its N_max beyond the
    // top-k, measured as the run goes), at most fate_extra (-1: k). With LOW copies or skips a
    // measured time must not decide what is cached: fate_extra, -1 none (measured faster than k)
    const int extra = !fate ? 0 : options.lossy() ? std::max(0, options.fate_extra)
        : std::min(options.fate_extra < 0 ? k : options.fate_extra, std::max(0, overlap.hidden_experts() - k));
    std::vector<std::vector<predicted_expert>> predicted_layers;
    for (size_t d = 0; d < ahead.size(); d++) {
        predicted_layers.push_back(predict_layer(ahead[d], row(0, d), n_expert, k, options.precision(), extra,
                                                 options.fate_percentile));
        for (auto & p : predicted_layers.back()) p.precision = fixed_or(p.layer, p.expert, p.precision);
    }
    coordinator.prefetch(walk_predictions(predicted_layers, !fate, [&](const predicted_expert & p) {
        const int group = layout.layer_at(p.layer)->group;
        return cache.serving_tier(group, make_expert_key(p.layer, p.expert), p.precision) != expert_precision::skip;
    }), /*judged*/ true);
}

void expert_residency::impl::plan_guess(int next, const std::vector<int32_t> & guesses, const float * logits, size_t row_bytes,
                                        int64_t n_tokens) {
    next_layer_guess.clear();
    if (!layout.has_low || !needs_most_experts(n_tokens)) return;
    const int k = layout.n_expert_used;
    std::vector<float> w((size_t) n_tokens * k);
    std::vector<int> top;
    std::vector<float> top_w;
    for (int64_t t = 0; t < n_tokens; t++) {
        predicted_top_k((const float *) ((const char *) logits + t * row_bytes), layout.n_expert, k, top, top_w);
        std::copy(top_w.begin(), top_w.end(), w.begin() + t * k);
    }
    const layer_plan plan = plan_layer(guesses.data(), w.data(), n_tokens, k, layout.n_expert, rules_of(next), 1, 0,
                                       [](int, expert_precision) { return false; });
    for (const auto & [e, demand] : plan.waves[0]) {
        if (demand != expert_precision::skip) next_layer_guess.push_back({ next, e, demand });
    }
}

void expert_residency::impl::read_ahead(const moe_layer_layout & l, int wave, int64_t n_tokens) {
    const bool next_wave = wave + 1 < (int) planned_waves.size() && !planned_waves[wave + 1].empty();
    if (next_wave || planned_waves.size() > 1) {
        if (!pipelined(l.group, n_tokens)) return;  // the next wave needs every slot
        coordinator.settle(l.il);  // the experts read ahead for this wave are pinned by it now
    }
    if (next_wave) {
        std::vector<predicted_expert> experts;
        for (const auto & d : planned_waves[wave + 1]) experts.push_back({ l.il, d.first, d.second });
        coordinator.prefetch(experts);
        return;
    }
    const moe_layer_layout * after = layout.after(l);
    if (!after || !needs_most_experts(n_tokens)) return;
    const int next = after->il;
    if (layout.has_low) {  // the next layer's precisions are planned from its predicted routing
        if (!next_layer_guess.empty() && next_layer_guess[0].layer == next) coordinator.prefetch(next_layer_guess);
        return;
    }
    std::vector<predicted_expert> all;
    for (int e = 0; e < layout.n_expert; e++) all.push_back({ next, e, fixed_or(next, e, expert_precision::high) });
    coordinator.prefetch(all);
}

void expert_residency::impl::path_prefetch(const moe_layer_layout & l, int64_t n_tokens) {
    const moe_layer_layout * after = layout.after(l);
    if (!after) return;
    const int next = after->il, k = layout.n_expert_used;
    const std::vector<int32_t> & now = ubatch_ids[l.il];
    auto before = &l == layout.layers.data() ? ubatch_ids.end() : ubatch_ids.find((&l - 1)->il);
    // each token's top-k guess (scored when the next layer runs) and the summed probabilities
    std::vector<int32_t> guesses((size_t) n_tokens * k, -1);
    std::vector<float> total(layout.n_expert, 0.0f);
    for (int64_t t = 0; t < n_tokens; t++) {
        const std::vector<int> prev1(now.begin() + t * k, now.begin() + (t + 1) * k);
        const std::vector<int> prev2 = before == ubatch_ids.end() ? std::vector<int>()
            : std::vector<int>(before->second.begin() + t * k, before->second.begin() + (t + 1) * k);
        const std::vector<float> * probs = paths->lookup(next, prev2, prev1);
        if (!probs || (int) probs->size() != layout.n_expert) continue;
        const std::vector<int> top = most_probable(*probs, k);
        std::copy(top.begin(), top.end(), guesses.begin() + t * k);
        for (int e = 0; e < layout.n_expert; e++) total[e] += (*probs)[e];
    }
    recorder.remember(next, 0, 1, std::move(guesses));
    if (!coordinator.prefetching() || n_tokens != 1 || coordinator.judged_useless()) return;  // prefetching serves decode
    std::vector<predicted_expert> predicted;
    for (int e : most_probable(total, k)) predicted.push_back({ next, e, fixed_or(next, e, expert_precision::high) });
    coordinator.prefetch(predicted, /*judged*/ true);
}

std::string expert_residency::impl::read_all(std::vector<expert_read> reads, expert_layer_stats & st) {
    const loader_threads::read_result r = loaders.read_all(std::move(reads));
    st.bytes_read += r.moved.bytes_read;
    st.bytes_read_low += r.moved.bytes_read_low;
    st.bytes_uploaded += r.moved.bytes_uploaded;
    st.upload_ms += r.moved.upload_ms;
    st.load_ms += r.ms;
    return r.error;
}

// -- the front ------------------------------------------------------------------------------------

expert_residency::expert_residency(llama_model * model, const std::string & path, uint64_t budget_bytes,
                                   const expert_options & options, bool trace_routing, const expert_device_config & device)
    : impl_(std::make_unique<impl>(model, path, budget_bytes, options, trace_routing, device)) {}

expert_residency::~expert_residency() = default;

// The fill's order: per group, its layers round-robin, each layer's experts in ranking[il]'s order
// then by id; (il, expert) pairs, without the experts EdgeMoE's map keeps LOW.
std::vector<std::pair<int, int>> expert_residency::impl::fill_order(const std::map<int, std::vector<int>> & ranking) const {
    const int n_expert = layout.n_expert;
    std::map<int, std::vector<int>> order;  // per il
    for (const auto & l : layout.layers) {
        std::vector<bool> listed(n_expert, false);
        auto it = ranking.find(l.il);
        for (int e : it == ranking.end() ? std::vector<int>() : it->second) {
            if (e < 0 || e >= n_expert || listed[e]) throw std::invalid_argument("fill ranking: bad expert id");
            listed[e] = true;
            order[l.il].push_back(e);
        }
        for (int e = 0; e < n_expert; e++) if (!listed[e]) order[l.il].push_back(e);
    }
    std::vector<std::pair<int, int>> out;
    for (int g = 0; g < (int) high_pools.size(); g++) {
        for (int i = 0; i < n_expert; i++) {
            for (const auto & l : layout.layers) {
                const int e = order[l.il][i];
                if (l.group == g && fixed_or(l.il, e, expert_precision::high) == expert_precision::high) out.emplace_back(l.il, e);
            }
        }
    }
    return out;
}

expert_fill_stats expert_residency::fill(const std::map<int, std::vector<int>> & ranking,
                                         const std::function<bool()> & interrupted) {
    impl & r = *impl_;
    const auto t0 = clock_type::now();
    expert_fill_stats out;
    std::vector<expert_read> reads;
    for (const auto & [il, e] : r.fill_order(ranking)) {
        const moe_layer_layout & l = *r.layout.layer_at(il);
        const expert_cache::placement slot = r.cache.reserve(l.group, il, e, expert_precision::high, /*evict*/ false);
        if (!slot.load) continue;  // the group's tier is full
        for (expert_read & rd : r.reads_of(l, e, expert_precision::high, slot.slot)) reads.push_back(std::move(rd));
        out.experts++;
    }
    expert_layer_stats st;
    for (size_t begin = 0; begin < reads.size();) {
        if (interrupted && interrupted()) {
            r.cache.forget_all();
            throw fill_interrupted();
        }
        size_t end = begin;
        for (uint64_t bytes = 0; end < reads.size() && bytes < FILL_CHUNK_BYTES; end++) bytes += reads[end].size;
        const std::string error = r.read_all(std::vector<expert_read>(reads.begin() + begin, reads.begin() + end), st);
        if (!error.empty()) {
            r.cache.forget_all();
            throw std::runtime_error(error);
        }
        begin = end;
    }
    out.bytes_read = st.bytes_read;
    out.ms = ms_since(t0);
    r.filled = out;
    return out;
}

void expert_residency::fill_in_background(const std::map<int, std::vector<int>> & ranking) {
    impl_->coordinator.start_fill(impl_->fill_order(ranking));
}

const expert_fill_stats & expert_residency::fill_stats() const {
    return impl_->coordinator.fill_stats().experts ? impl_->coordinator.fill_stats() : impl_->filled;
}

std::string expert_residency::take_error() {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    std::string e = std::move(impl_->error);
    impl_->error.clear();
    impl_->failed = false;
    return e;
}

void expert_residency::start_sequence() { impl_->cache.start_sequence(); }

const expert_options & expert_residency::options() const { return impl_->options; }

const expert_residency_info & expert_residency::info() const { return impl_->info; }

std::vector<std::pair<int, expert_layer_stats>> expert_residency::layer_stats() const {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    std::vector<std::pair<int, expert_layer_stats>> out;
    for (const auto & l : impl_->layout.layers) out.emplace_back(l.il, impl_->stats[l.il]);
    return out;
}

std::vector<std::pair<int, expert_prefetch_stats>> expert_residency::prefetch_stats() const {
    std::vector<std::pair<int, expert_prefetch_stats>> out;
    for (const auto & l : impl_->layout.layers) out.emplace_back(l.il, impl_->coordinator.stats()[l.il]);
    return out;
}

double expert_residency::prefetch_busy_ms() const { return impl_->coordinator.busy_ms(); }

bool expert_residency::prefetch_stopped() const { return impl_->coordinator.judged_useless(); }

std::vector<expert_prediction_stats> expert_residency::prediction_stats() const { return impl_->recorder.prediction_stats(); }

uint64_t expert_residency::resident_experts() const { return impl_->cache.resident_experts(); }

void expert_residency::reset_stats() {
    {
        std::lock_guard<std::mutex> lock(impl_->mutex);
        for (auto & s : impl_->stats) s = expert_layer_stats();
    }
    impl_->coordinator.reset_stats();
    impl_->recorder.reset_stats();
}

void expert_residency::set_tracing(bool on) { impl_->recorder.set_tracing(on); }

void expert_residency::set_precision_map(const std::map<int, std::vector<int>> & low) {
    impl & r = *impl_;
    if (!r.layout.has_low) throw std::invalid_argument("a static precision map needs LOW expert copies (a multi-precision GGUF or low_from)");
    std::vector<std::vector<expert_precision>> fixed(r.layout.n_layers);
    for (const auto & l : r.layout.layers) fixed[l.il].assign(r.layout.n_expert, expert_precision::high);
    for (const auto & [il, experts] : low) {
        if (il < 0 || il >= r.layout.n_layers || fixed[il].empty()) {
            throw std::invalid_argument("precision map: layer " + std::to_string(il) + " has no experts");
        }
        for (int e : experts) {
            if (e < 0 || e >= r.layout.n_expert) {
                throw std::invalid_argument("precision map: layer " + std::to_string(il) + " has no expert " + std::to_string(e));
            }
            fixed[il][e] = expert_precision::low;
        }
    }
    // copies cached in another precision go: each expert is only ever in its own
    r.coordinator.drop_all();
    r.forget_cache();
    r.fixed = std::move(fixed);
}

void expert_residency::set_path_statistics(const std::vector<path_entry> & entries) {
    impl & r = *impl_;
    auto paths = std::make_unique<path_predictor>();
    for (const auto & [layer, prev2, prev1, probs] : entries) {
        if ((int) probs.size() != r.layout.n_expert) {
            throw std::invalid_argument("path statistics: layer " + std::to_string(layer) + " has " + std::to_string(probs.size()) +
                                        " probabilities for " + std::to_string(r.layout.n_expert) + " experts");
        }
        paths->add(layer, prev2, prev1, probs);
    }
    r.paths = std::move(paths);
}

void expert_residency::set_little(bool on) { impl_->little = on; }

int expert_residency::prefetch_big() {
    impl & r = *impl_;
    std::vector<predicted_expert> predicted;
    for (const auto & [il, ids] : r.little_choices) {
        std::vector<int> distinct(ids.begin(), ids.end());
        std::sort(distinct.begin(), distinct.end());
        distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
        for (int e : distinct) predicted.push_back({ il, e, r.fixed_or(il, e, expert_precision::high) });
    }
    r.little_choices.clear();
    if (!r.coordinator.prefetching()) return 0;
    r.coordinator.prefetch(predicted);
    return (int) predicted.size();
}

routing_trace expert_residency::take_trace() { return impl_->recorder.take_trace(); }

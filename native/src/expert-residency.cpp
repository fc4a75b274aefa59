// The orchestrator: wires the parts of the layer (expert-residency.h) and runs a MoE layer's op.
// What to plan, cache, prefetch and encode for the passes is decided in the parts: layer-planner,
// expert-cache, prefetch-strategy (and its strategies), tier-passes.
#include "expert-residency.h"

#include "cache-fill.h"
#include "expert-budget.h"
#include "expert-cache.h"
#include "expert-layout.h"
#include "expert-reads.h"
#include "host-tier.h"
#include "layer-planner.h"
#include "layer-routing.h"
#include "mode-chooser.h"
#include "moe-hook.h"
#include "path-predictor.h"
#include "predictor.h"
#include "prefetch-coordinator.h"
#include "prefetch-strategy.h"
#include "residency-info.h"
#include "routing-recorder.h"
#include "slot-pool.h"
#include "tier-passes.h"

#include "llama-graph.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <stdexcept>

using clock_type = std::chrono::steady_clock;

struct expert_residency::impl : moe_pass_builder {
    struct wave_op {  // one wave's custom op in a layer's graph: its userdata
        impl * owner;
        int il, wave;
        // the srcs of wave 0 that some engines have (-1: none): the routing weights (reads_weights),
        // the router's probabilities (cache routing), the predicted router logits (a predictor), the
        // layer's input (tracing)
        int weights_src = -1, probs_src = -1, predicted_src = -1, inputs_src = -1;
    };
    struct building_layer {  // a layer's graph while build_pass fills in its passes
        ggml_tensor * ids = nullptr;
        tier_passes::wave_inputs in;  // of the wave being built
        int waves = 0;
    };

    impl(llama_model * model, const std::string & path, uint64_t budget_bytes, const expert_options & o, bool trace_routing,
         const expert_device_config & device);

    bool build_pass(int il, ggml_context * ctx, int pass, ggml_tensor * moe_input, ggml_tensor * weights,
                    ggml_tensor * previous, llama_moe_expert_pass * p) override;
    // the custom op of a wave: ids [n_used, n_tokens] (expert ids), weights and (wave 0) the router's probabilities and, with
    // a predictor, the predicted router logits of the layers ahead; tracing, the layer's input -> dst, the passes' slot ids (tier-passes.h), loading
    // misses; after each wave, the prefetch strategies
    void place_experts(int il, int wave, const ggml_tensor * ids, const ggml_tensor * weights, const ggml_tensor * probs,
                       const ggml_tensor * predicted, const ggml_tensor * inputs, ggml_tensor * dst);
    // wave 0 of a layer: settles the layer before, plans this one's waves
    bool begin_layer(const moe_layer_layout & l, const ggml_tensor * ids, const ggml_tensor * weights, const ggml_tensor * probs,
                     ggml_tensor * dst);
    // places, loads and pins one wave's experts and writes their slot ids; false after a failure
    bool serve_wave(const moe_layer_layout & l, int wave, const ggml_tensor * ids, ggml_tensor * dst, clock_type::time_point t0);
    // the reads that fill the device slot `slot` (-1: none) with an expert, through the host slot
    // host_slot (-1: none; in_host: it holds the expert already)
    std::vector<expert_read> reads_of(const moe_layer_layout & l, int expert, expert_precision precision, int slot,
                                      int host_slot = -1, bool in_host = false) const {
        return reader.reads_of(l, expert, precision, *pools, slot, host ? &host->pools : nullptr, host_slot, in_host, host ? host->cpu_copies.get() : nullptr);
    }
    // a read failed: nothing in flight, no pins, every slot free (they may hold partial data)
    void forget_cache() {
        coordinator.forget();
        cache.forget_all();
        if (host) host->forget();
    }
    // the wave before is over: its slots may go (uploads an aborted graph left queued arrive first)
    void release_wave() { reader.wait_uploads(); coordinator.release_wave(); if (host) host->pins.release(); }
    void fail(const std::string & why, ggml_tensor * dst);
    bool has_failed() const { std::lock_guard<std::mutex> lock(mutex); return failed; }

    expert_options options;
    std::vector<ggml_backend_dev_t> devices;                   // of the pools, a group's its home's; none: host memory
    expert_layout layout;
    expert_budget budget;
    expert_residency_info info;
    expert_reader reader;
    ggml_backend_dev_t device;                                 // the first (the host tier's); nullptr: mode cpu
    std::unique_ptr<tier_pools> pools;                         // the devices' (mode cpu: host memory)
    expert_cache cache;
    std::unique_ptr<host_tier> host;                           // with a device, if budgeted
    tier_passes passes;                                        // of each wave
    std::vector<wave_shape> wave_shapes;                       // per group
    layer_rules rules;
    std::unique_ptr<expert_predictor> predictor;               // with prefetch or tracing
    routing_recorder recorder;
    prefetch_coordinator coordinator;
    std::unique_ptr<prefetch_strategies> prefetch;
    std::map<int, std::vector<wave_op>> wave_ops;              // per il, per wave
    std::map<int, building_layer> building;                    // per il
    layer_plan planned;                                        // the running layer's
    std::atomic<bool> little{false};                           // MoBiLE: decode tokens compute top-k/2
    std::vector<expert_layer_stats> stats;                     // per il
    mutable std::mutex mutex;                                  // stats, error, failed
    std::string error;
    bool failed = false;
    bool trace_inputs = false;  // an engine that traces: each layer's op is handed the layer's input
    expert_fill_stats filled;
    int32_t ubatch_index = 0;
    std::unique_ptr<moe_hook_registration> hook;  // last: unregistered first
};

expert_residency::impl::impl(llama_model * model, const std::string & path, uint64_t budget_bytes,
                             const expert_options & o, bool trace_routing, const expert_device_config & dc)
    : options((check_expert_options(o), o)), devices(devices_named(dc.devices)),
      layout(model, path, o.low_precision, o.low_from, devices),
      budget(layout, budget_bytes, o.low_cache),
      reader(layout.high_files, o.io, o.io_threads),
      device(devices.empty() ? nullptr : devices[0]),
      cache(cache_config_of(layout, budget, o)),
      recorder(predictions_needed(o, trace_routing, layout.has_low).scored_depths),
      coordinator(cache, layout.group_of_layers(), o.io_threads,
                  [this](int il, int e, expert_precision p, int slot) {  // prefetches: uploaded from the host tier where it holds all
                      const int h = host ? host->stable_slot(*layout.layer_at(il), e, p) : -1; return reads_of(*layout.layer_at(il), e, p, slot, h, h >= 0); },
                  /*timed*/ !layout.has_low && !o.skip) {
    options.low_precision = layout.has_low;
    check_options_fit(options, device != nullptr, layout.has_low, layout.n_expert_used, layout.fixed_routing);
    if (layout.has_low) reader.open_low(layout.low_files, o.io);
    info.device_pool_bytes = device_pool_bytes(layout, budget, devices);  // checked before they are allocated
    pools = std::make_unique<tier_pools>(layout, budget, pool_buffer_types(layout, devices), dc.repack);
    const bool has_host = device && dc.host_bytes > 0;
    const bool split_repacked = host_layouts_of(compute_mode::split, dc.repack, layout, dc.host_bytes) == host_layouts::both;
    if (options.mode == compute_mode::automatic) {
        const mode_choice choice = choose_mode(*pools->high[0], device, has_host ? dc.host_bytes : 0, dc.repack, split_repacked, dc.n_threads);
        options.mode = choice.mode, options.link_share = choice.link_share, info.mode_reason = choice.reason;
    }
    const bool coop = options.mode == compute_mode::coop || options.mode == compute_mode::split;  // split: coop's passes
    if (coop && !has_host) throw std::invalid_argument(std::string("--mode ") + name_of(options.mode) + " computes the device's misses from the host tier: give it a --host-cache");
    const double link_share = split_share(options, *pools->high[0], device, dc.host_bytes, dc.n_threads, split_repacked, &info.mode_reason);
    if (has_host) host = std::make_unique<host_tier>(layout, dc.host_bytes, o.low_cache, device, host_layouts_of(options.mode, dc.repack, layout, dc.host_bytes), dc.repack);
    if (options.mlock) pools->lock_in_memory();
    if (options.mlock && host) host->lock_in_memory();
    passes = tier_passes(layout.has_low, device != nullptr, coop, options.big_little > 0 || options.cache_routing > 0, pools->fewest_slots(), link_share,
                         /*adapts*/ o.link_share < 0);  // the share the rates give, not one given
    for (size_t g = 0; g < layout.groups.size(); g++) {
        const int slots = pools->high[g]->n_slots();
        wave_shapes.push_back({ layout.n_expert, layout.n_expert_used, layout.has_expert_bias, layout.has_low, coop,
                                coop ? host->wave_slots((int) g, options.mode, slots) : slots,
                                layout.has_low ? pools->low[g]->n_slots() : 0 });
    }
    rules.precision = options.precision();
    rules.prefill_low_share = options.prefill_low_share;
    rules.cache_routing = options.cache_routing;
    rules.weights_normalized.assign(layout.n_layers, 0);
    trace_inputs = trace_routing;

    stats.resize(layout.n_layers);
    std::vector<std::pair<const ggml_tensor *, int>> hooked;
    for (const auto & l : layout.layers) {
        for (const ggml_tensor * t : l.stacked) if (t) hooked.emplace_back(t, l.il);
        const int slots = wave_shapes[l.group].wave_size(layout.n_expert);  // a ubatch of n_expert tokens: the most waves
        for (int w = 0; w < (layout.n_expert + slots - 1) / slots; w++) wave_ops[l.il].push_back({ this, l.il, w });
    }
    const prediction_needs needs = predictions_needed(o, trace_routing, layout.has_low);
    if (needs.router_depth > 0) predictor = std::make_unique<expert_predictor>(model, layout.moe_layers(), needs.router_depth, layout.n_expert);
    prefetch = std::make_unique<prefetch_strategies>(prefetch_env{ layout, options, rules, cache, coordinator, recorder, predictor.get() });
    reader.on_uploads([this](bool held) { held ? coordinator.pause_for_loads() : coordinator.resume_after_loads(); });

    describe_residency(info, layout, budget, *pools, host.get(), reader.io(), needs.scored_depths);
    uint32_t extra_nodes = 0;  // every wave's op and passes, in every layer
    for (const auto & [il, ops] : wave_ops) extra_nodes += passes.graph_nodes(ops.size());
    hook = std::make_unique<moe_hook_registration>(*this, hooked, extra_nodes);
}

namespace {
void place_experts_op(ggml_tensor * dst, int ith, int /* nth */, void * userdata) {
    if (ith != 0) return;
    auto * op = (expert_residency::impl::wave_op *) userdata;
    const auto src = [dst](int i) -> const ggml_tensor * { return i >= 0 ? dst->src[i] : nullptr; };
    op->owner->place_experts(op->il, op->wave, dst->src[0], src(op->weights_src), src(op->probs_src), src(op->predicted_src),
                             src(op->inputs_src), dst);
}
}  // namespace

bool expert_residency::impl::build_pass(int il, ggml_context * ctx, int pass, ggml_tensor * moe_input, ggml_tensor * weights,
                                        ggml_tensor * previous, llama_moe_expert_pass * p) {
    const moe_layer_layout & l = *layout.layer_at(il);
    const int n_passes = passes.size();
    building_layer & b = building[il];
    if (pass == 0) {
        const ggml_tensor * given[PROJ_COUNT] = { p->up_exps, p->gate_exps, p->down_exps, p->gate_up_exps };
        for (int q = 0; q < PROJ_COUNT; q++) GGML_ASSERT(given[q] == l.stacked[q]);
        b.ids = p->ids;
        rules.weights_normalized[il] = p->weights_normalized;
        b.waves = wave_shapes[l.group].waves(p->ids->ne[1]);
    }
    const int wave = pass / n_passes, index = pass % n_passes;
    if (wave >= b.waves) return false;
    ggml_tensor * ids = b.ids;
    if (index == 0) {
        // one op per wave writes the slot ids of all its passes; a later wave's op runs after the
        // passes before it (previous), whose slots it may reuse. On a device each src is one more
        // copy to the host a layer, so wave 0 takes only what this engine reads.
        wave_op & op = wave_ops[il][wave];
        ggml_tensor * args[5] = { ids, nullptr, nullptr, nullptr, nullptr };
        int n_args = 1;
        const auto add = [&](ggml_tensor * t) { args[n_args] = t; return n_args++; };
        const auto inputs = [&] { return ggml_reshape_2d(ctx, moe_input, moe_input->ne[0], ids->ne[1]); };
        if (wave > 0) add(previous);
        op.weights_src = wave == 0 && reads_weights(rules, options.big_little > 0, recorder.tracing()) ? add(weights) : -1;
        op.probs_src = wave == 0 && rules.cache_routing > 0 ? add(p->probs) : -1;
        // HOBBIT's stacking computer: one matmul predicts the router logits of the layers ahead
        ggml_tensor * routers = wave == 0 && predictor ? predictor->stacked(il) : nullptr;
        op.predicted_src = routers ? add(ggml_mul_mat(ctx, routers, inputs())) : -1;
        op.inputs_src = wave == 0 && trace_inputs ? add(inputs()) : -1;  // the layer's input, for calibrate --stand-ins
        // one task: the op is bookkeeping plus I/O, the other threads have nothing to do in it
        ggml_tensor * slot_ids = ggml_custom_4d(ctx, GGML_TYPE_I32, ids->ne[0], ids->ne[1], passes.planes(), 1, args, n_args,
                                                place_experts_op, 1, &op);
        ggml_format_name(slot_ids, "edgemoe_slot_ids-%d-%d", il, wave);
        b.in = passes.inputs(ctx, slot_ids, il, wave);
    }
    const int q = passes.pass_at(index);
    if (q == 0 && passes.n_masked() > 0) {  // the first device pass, after its wave's CPU passes (their sum: wave 0's previous)
        passes.device_inputs(ctx, b.in, wave == 0 && index > 0 ? previous : nullptr, il, wave, { &reader, &stats[il], &mutex });
    }
    const pass_kind kind = passes[q];
    passes.fill_in(ctx, q, (kind.host ? host->cpu_pools() : *pools).pool(l.group, kind.precision), l.stacked, b.in, p);
    return true;
}

void expert_residency::impl::fail(const std::string & why, ggml_tensor * dst) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!failed) error = why;
    failed = true;
    passes.write_unserved(dst);
}

void expert_residency::impl::place_experts(int il, int wave, const ggml_tensor * ids, const ggml_tensor * weights,
                                           const ggml_tensor * probs, const ggml_tensor * predicted, const ggml_tensor * inputs,
                                           ggml_tensor * dst) {
    const auto t0 = clock_type::now();
    GGML_ASSERT(dst->type == GGML_TYPE_I32 && ggml_is_contiguous(dst));
    GGML_ASSERT(!probs || (probs->type == GGML_TYPE_F32 && ggml_is_contiguous(probs)));
    if (has_failed()) {  // a load failed earlier in this decode
        passes.write_unserved(dst);
        return;
    }
    const moe_layer_layout & l = *layout.layer_at(il);
    const int64_t n_tokens = ids->ne[1];
    if (wave == 0 && !begin_layer(l, ids, weights, probs, dst)) return;
    if (inputs) recorder.on_inputs((const char *) inputs->data, inputs->ne[0], inputs->nb[1], n_tokens);
    if (wave == 0) prefetch->on_layer_began(t0, ubatch_index);
    if (!serve_wave(l, wave, ids, dst, t0)) return;
    predicted_logits logits;
    if (wave == 0 && predicted) {
        logits = { (const char *) predicted->data, predicted->nb[1], layout.n_expert };
        recorder.remember_predicted(predictor->ahead(il), logits, n_tokens, layout.n_expert_used);
    }
    prefetch->after_wave({ l, wave, n_tokens, logits, planned.waves, wave_shapes[l.group].pipelined(n_tokens) });
    if (wave == 0) coordinator.top_up_fill();
    prefetch->on_wave_ended(clock_type::now(), ubatch_index);
}

bool expert_residency::impl::begin_layer(const moe_layer_layout & l, const ggml_tensor * ids, const ggml_tensor * weights,
                                         const ggml_tensor * probs, ggml_tensor * dst) {
    const int64_t n_tokens = ids->ne[1];
    const int k = (int) ids->ne[0];
    if (l.il == layout.layers.front().il) { cache.advance_tokens(n_tokens); ubatch_index++; prefetch->on_ubatch(); }
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

    auto [id, w] = read_routing(ids, weights);
    recorder.on_layer(l.il, ubatch_index, id.data(), w.data(), n_tokens, k);
    // MoBiLE's little pass: a decode token keeps its top-k/2
    const bool little_pass = little && n_tokens == 1;
    prefetch->on_routing(l, id, little_pass);
    const wave_shape & shape = wave_shapes[l.group];
    planned = plan_layer(id.data(), w.data(), n_tokens, k, layout.n_expert,
                         rules.of(l.il, little_pass ? k / 2 : 0, probs ? (const float *) probs->data : nullptr),
                         shape.waves(n_tokens), shape.wave_size(n_tokens), [&](int e, expert_precision demand) {
            return cache.serving_tier(l.group, make_expert_key(l.il, e), demand) != expert_precision::skip;
        });
    if (!planned.error.empty()) {
        fail("layer " + std::to_string(l.il) + ": " + planned.error, dst);
        return false;
    }
    return true;
}

bool expert_residency::impl::serve_wave(const moe_layer_layout & l, int wave, const ggml_tensor * ids, ggml_tensor * dst,
                                        clock_type::time_point t0) {
    const int64_t n_used = ids->ne[0], n_tokens = ids->ne[1];
    if (wave > 0) release_wave();  // the wave before has been computed: its experts may go
    const std::vector<expert_demand> none;
    const auto & wanted = wave < (int) planned.waves.size() ? planned.waves[wave] : none;
    std::vector<expert_demand> on_device, on_cpu;  // coop: the CPU computes the device's misses (split: some)
    if (passes.cpu_computes_misses()) {  // a prefetch not begun is a miss to divide
        for (const auto & d : wanted) coordinator.give_back({ make_expert_key(l.il, d.first), d.second });
    }
    passes.divide(wanted, passes.queues_uploads() ? tokens_of(planned, wanted) : std::vector<int>(wanted.size(), 1), [&](const expert_demand & d) {
        return d.second == expert_precision::skip || cache.serving_tier(l.group, make_expert_key(l.il, d.first), d.second) != expert_precision::skip;
    }, on_device, on_cpu);
    std::vector<expert_cache::placement> placed, on_host;
    try {
        placed = coordinator.place(l.group, l.il, on_device);
    } catch (const std::exception & ex) {
        fail(ex.what(), dst);
        return false;
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
    if (wave == 0) st.stand_in_swaps = planned.stand_in_swaps, st.stand_in_drops = planned.stand_in_drops;
    std::vector<const expert_cache::placement *> loads;
    std::vector<std::shared_ptr<prefetch_job>> claimed;
    bool waited = false;  // for a prefetch read in flight
    using serving = std::pair<const expert_cache::placement *, bool>;  // (placement, on the host)
    std::vector<serving> where(layout.n_expert);  // by expert
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
    const std::vector<expert_cache::placement> from_host = host ? host->copies_for(l.group, l.il, loads) : std::vector<expert_cache::placement>();
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
        read_error = reader.read_all(std::move(reads), st, passes.queues_uploads());
        coordinator.resume_after_loads();
        prefetch->on_experts_read((int) (loads.size() + on_host.size() + claimed.size()), st.load_ms);
    }
    for (const auto & job : claimed) coordinator.claimed_done(*job);
    if (!read_error.empty()) {
        forget_cache();
        fail(read_error, dst);
        return false;
    }

    // each selection: the pass serving it from its slot, scaled as planned (tier-passes.h)
    pass_writer out(passes, dst);
    std::vector<int> masked_slots;
    for (int q = 0; q < passes.n_masked(); q++) masked_slots.push_back(pools->pool(l.group, passes[q].precision).n_slots());
    for (int64_t t = 0; t < n_tokens; t++) {
        for (int64_t i = 0; i < n_used; i++) {
            const auto [p, on_host] = planned.dropped[t * n_used + i] ? serving() : where[planned.ids[t * n_used + i]];
            const bool served = p && p->precision != expert_precision::skip;
            out.select(t, i, served ? passes.serving(on_host, p->precision) : -1, served ? p->slot : -1, planned.scale[t * n_used + i]);
            if (!p) continue;
            (p->precision == expert_precision::high ? st.selections_high
             : p->precision == expert_precision::low ? st.selections_low : st.selections_skip)++;
        }
        out.end_token(t, masked_slots);
    }
    const double ms = std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
    st.stall_ms = !any_reads && !waited ? 0.0 : ms, st.op_ms = ms;
    std::lock_guard<std::mutex> lock(mutex); stats[l.il].add(st);
    return true;
}

// -- the front ------------------------------------------------------------------------------------

expert_residency::expert_residency(llama_model * model, const std::string & path, uint64_t budget_bytes,
                                   const expert_options & options, bool trace_routing, const expert_device_config & device)
    : impl_(std::make_unique<impl>(model, path, budget_bytes, options, trace_routing, device)) {}

expert_residency::~expert_residency() { impl_->reader.wait_uploads(); }  // before the pools they write go

expert_fill_stats expert_residency::fill(const std::map<int, std::vector<int>> & ranking,
                                         const std::function<bool()> & interrupted) {
    impl & r = *impl_;
    r.filled = fill_cache(r.cache, r.layout, *r.pools, r.reader, fill_order(r.layout, r.rules, ranking), interrupted);
    return r.filled;
}

void expert_residency::fill_in_background(const std::map<int, std::vector<int>> & ranking) { impl_->coordinator.start_fill(fill_order(impl_->layout, impl_->rules, ranking)); }
const expert_fill_stats & expert_residency::fill_stats() const { return impl_->coordinator.fill_stats().experts ? impl_->coordinator.fill_stats() : impl_->filled; }

expert_fill_stats expert_residency::fill_host(const std::function<bool()> & interrupted) {
    return impl_->host ? fill_host_tier(*impl_->host, impl_->layout, impl_->reader, interrupted) : expert_fill_stats();
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
prefetch_phase expert_residency::decode_prefetch() const { return impl_->coordinator.phase(); }
std::vector<expert_prediction_stats> expert_residency::prediction_stats() const { return impl_->recorder.prediction_stats(); }
uint64_t expert_residency::resident_experts() const { return impl_->cache.resident_experts(); }
double expert_residency::link_share() const { return impl_->passes.link_share(); }

void expert_residency::reset_stats() {
    {
        std::lock_guard<std::mutex> lock(impl_->mutex);
        for (auto & s : impl_->stats) s = expert_layer_stats();
    }
    impl_->coordinator.reset_stats();
    impl_->recorder.reset_stats();
}

void expert_residency::set_tracing(bool on, bool inputs) { impl_->recorder.set_tracing(on, inputs); moe_graph_changed(); }
void expert_residency::set_precision_map(const std::map<int, std::vector<int>> & low) {
    impl & r = *impl_;
    if (!r.layout.has_low) throw std::invalid_argument("a static precision map needs LOW expert copies (a multi-precision GGUF or low_from)");
    auto fixed = static_precision_map(low, r.layout.moe_layers(), r.layout.n_layers, r.layout.n_expert);
    // copies cached in another precision go: each expert is only ever in its own (uploads a stopped
    // graph left in flight arrive first: the prefetcher waits for them, and drop_all for it)
    r.reader.wait_uploads();
    r.coordinator.drop_all();
    r.forget_cache();
    r.rules.fixed = std::move(fixed);
}

void expert_residency::set_stand_ins(const std::map<int, stand_in_costs> & layers) {
    const expert_layout & l = impl_->layout;
    impl_->rules.stand_ins = stand_in_tables(layers, l.moe_layers(), l.n_layers, l.n_expert);
    moe_graph_changed();
}

void expert_residency::set_path_statistics(const std::vector<path_entry> & entries) {
    auto paths = std::make_shared<path_predictor>(impl_->layout.n_expert);
    for (const auto & [layer, prev2, prev1, probs] : entries) paths->add(layer, prev2, prev1, probs);
    impl_->prefetch->set_path_statistics(paths);
}

void expert_residency::set_little(bool on) { impl_->little = on; }
void expert_residency::set_decode_batch(bool on) { impl_->rules.decode_batch = on; }
int expert_residency::prefetch_big() { return impl_->prefetch->before_redo(); }
routing_trace expert_residency::take_trace() { return impl_->recorder.take_trace(); }

#include "expert-residency.h"

#include "moe-hook.h"

#include "ggml-cpu.h"
#include "gguf.h"
#include "llama.h"
#include "llama-graph.h"
#include "llama-model.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <stdexcept>
#include <unordered_map>
#include <unordered_set>

namespace {

using clock_type = std::chrono::steady_clock;

double ms_since(clock_type::time_point t0) {
    return std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
}

std::string mib(uint64_t bytes) {
    char buf[64];
    snprintf(buf, sizeof(buf), "%.2f MiB", bytes / 1048576.0);
    return buf;
}

const char * kProjectionNames[PROJ_COUNT] = { "up", "gate", "down", "gate_up" };

// "blk.<il>.ffn_<proj>_exps.weight" -> (il, projection); false for anything else
bool parse_expert_tensor_name(const std::string & name, int * il, expert_projection * proj) {
    int layer = -1, used = 0;
    char kind[16] = {0};
    if (sscanf(name.c_str(), "blk.%d.ffn_%15[a-z_]%n", &layer, kind, &used) != 2) return false;
    for (int p = 0; p < PROJ_COUNT; p++) {
        if (kind == std::string(kProjectionNames[p]) + "_exps" && name.substr(used) == ".weight") {
            *il = layer; *proj = (expert_projection) p; return true;
        }
    }
    return false;
}

std::string meta_string(const llama_model * model, const std::string & key) {
    char buf[256];
    int32_t n = llama_model_meta_val_str(model, key.c_str(), buf, sizeof(buf));
    return n < 0 ? std::string() : std::string(buf);
}

// A GGUF's tensor directory with shapes (no data): the offsets and shapes of expert copies.
struct gguf_directory {
    gguf_context * meta = nullptr;
    ggml_context * shapes = nullptr;

    explicit gguf_directory(const std::string & path) {
        gguf_init_params params = { /*no_alloc*/ true, &shapes };
        meta = gguf_init_from_file(path.c_str(), params);
        if (!meta) throw std::runtime_error("cannot read the GGUF header of " + path);
    }
    ~gguf_directory() {
        if (meta) gguf_free(meta);
        if (shapes) ggml_free(shapes);
    }
    // (tensor, absolute file offset); tensor null when absent
    std::pair<const ggml_tensor *, uint64_t> find(const std::string & name) const {
        int64_t id = gguf_find_tensor(meta, name.c_str());
        if (id < 0) return { nullptr, 0 };
        return { ggml_get_tensor(shapes, name.c_str()), gguf_get_data_offset(meta) + gguf_get_tensor_offset(meta, id) };
    }
};

expert_matrix_shape shape_of(const ggml_tensor * t) {
    expert_matrix_shape s;
    s.present = true; s.type = t->type; s.ne0 = t->ne[0]; s.ne1 = t->ne[1]; s.bytes = t->nb[2];
    return s;
}

// a wave's (or a fill's) experts of one projection then read as one forward sweep
void sort_in_file_order(std::vector<expert_read> & reads) {
    std::sort(reads.begin(), reads.end(), [](const expert_read & a, const expert_read & b) {
        return std::make_pair(a.store, a.offset) < std::make_pair(b.store, b.offset);
    });
}

// Slots per group for one tier: each group gets its minimum, the rest of the budget is shared in
// proportion to the group's expert bytes, and no group gets more slots than it has experts.
std::vector<int> share_slots(uint64_t budget, int min_slots, const std::vector<uint64_t> & slot_bytes,
                             const std::vector<int> & group_layers, int n_expert) {
    uint64_t minimum = 0, demand = 0;
    for (size_t g = 0; g < slot_bytes.size(); g++) {
        minimum += (uint64_t) min_slots * slot_bytes[g];
        demand += (uint64_t) group_layers[g] * n_expert * slot_bytes[g];
    }
    const uint64_t extra = budget > minimum ? budget - minimum : 0;
    std::vector<int> slots;
    for (size_t g = 0; g < slot_bytes.size(); g++) {
        const uint64_t group_demand = (uint64_t) group_layers[g] * n_expert;
        const double share = (double) (group_demand * slot_bytes[g]) / (double) demand;
        uint64_t n = min_slots + (uint64_t) (extra * share / slot_bytes[g]);
        slots.push_back((int) std::min(n, group_demand));
    }
    return slots;
}

}  // namespace

expert_residency::expert_residency(llama_model * model, const std::string & path, const expert_residency_params & params)
    : params_(params), budget_bytes_(params.budget_bytes), io_threads_(std::max(1, params.io_threads)) {
    // where each expert tensor starts in the file
    std::map<int, std::unique_ptr<layer>> by_layer;
    std::map<int, expert_shapes> shapes_of;
    {
        gguf_directory dir(path);
        for (const auto & [name, t] : llama_internal_get_tensor_map(model)) {
            has_expert_bias_ = has_expert_bias_ || name.find("_exps.bias") != std::string::npos;
            int il; expert_projection proj;
            if (!parse_expert_tensor_name(name, &il, &proj)) continue;
            auto [entry, offset] = dir.find(name);
            if (!entry) throw std::runtime_error("expert tensor " + name + " not in the GGUF directory");
            auto & l = by_layer[il];
            if (!l) { l = std::make_unique<layer>(); l->owner = this; l->il = il; }
            l->stacked[proj] = t;
            l->file_offset[proj] = offset;
            shapes_of[il][proj] = shape_of(t);
            if (n_expert_ == 0) n_expert_ = (int) t->ne[2];
            if (t->ne[2] != n_expert_ || !ggml_is_contiguous(t)) {
                throw std::runtime_error("expert tensor " + name + " has an unsupported layout");
            }
        }
    }
    if (by_layer.empty()) throw std::runtime_error("the model has no stacked expert tensors: nothing to offload");

    const std::string arch = meta_string(model, "general.architecture");
    n_expert_used_ = atoi(meta_string(model, arch + ".expert_used_count").c_str());
    if (n_expert_used_ <= 0 || n_expert_used_ > n_expert_) {
        throw std::runtime_error("cannot read " + arch + ".expert_used_count from the model");
    }
    n_layers_ = by_layer.rbegin()->first + 1;
    first_il_ = by_layer.begin()->first;
    for (auto & [il, l] : by_layer) layers_.push_back(std::move(l));

    // the top-1 selection is always HIGH: with top-1 routing there is nothing to serve in LOW
    const bool use_low = params.precision.use_low && n_expert_used_ > 1;
    params_.precision.use_low = use_low;
    if (use_low && has_expert_bias_) {
        throw std::runtime_error("mixed-precision experts are not supported for models with expert biases "
                                 "(run with low precision off)");
    }
    std::map<int, expert_shapes> low_shapes_of;
    if (use_low) {
        low_source_ = params.low_from.empty() ? path : params.low_from;
        gguf_directory dir(low_source_);
        for (auto & l : layers_) {
            for (int p = 0; p < PROJ_COUNT; p++) {
                if (!l->stacked[p]) continue;
                const std::string base = "blk." + std::to_string(l->il) + ".ffn_" + kProjectionNames[p] + "_exps";
                const std::string name = base + (params.low_from.empty() ? ".lowbit" : ".weight");
                auto [t, offset] = dir.find(name);
                if (!t) throw std::runtime_error("no LOW copy " + name + " in " + low_source_);
                const ggml_tensor * high = l->stacked[p];
                if (t->ne[0] != high->ne[0] || t->ne[1] != high->ne[1] || t->ne[2] != high->ne[2]) {
                    throw std::runtime_error("LOW copy " + name + " in " + low_source_ + " has another shape than " + base + ".weight");
                }
                l->low_offset[p] = offset;
                low_shapes_of[l->il][p] = shape_of(t);
            }
        }
    }

    // groups of layers whose experts have the same shapes (in both precisions) share slot pools
    std::vector<std::pair<expert_shapes, expert_shapes>> group_shapes;
    std::vector<int> group_layers;
    for (auto & l : layers_) {
        const std::pair<expert_shapes, expert_shapes> s = { shapes_of[l->il], low_shapes_of[l->il] };
        auto it = std::find(group_shapes.begin(), group_shapes.end(), s);
        l->group = (int) (it - group_shapes.begin());
        if (it == group_shapes.end()) { group_shapes.push_back(s); group_layers.push_back(0); }
        group_layers[l->group]++;
        expert_bytes_total_ += expert_bytes_of(s.first) * n_expert_;
        low_expert_bytes_total_ += expert_bytes_of(s.second) * n_expert_;
    }
    const int n_groups = (int) group_shapes.size();
    std::vector<uint64_t> high_bytes(n_groups), low_bytes(n_groups);
    uint64_t high_minimum = 0, low_minimum = 0;
    for (int g = 0; g < n_groups; g++) {
        high_bytes[g] = expert_bytes_of(group_shapes[g].first);
        low_bytes[g] = expert_bytes_of(group_shapes[g].second);
        // every selection of a token may be HIGH; all but the top-1 may be LOW
        high_minimum += (uint64_t) n_expert_used_ * high_bytes[g];
        low_minimum += (uint64_t) (n_expert_used_ - 1) * low_bytes[g];
    }
    minimum_bytes_ = high_minimum + (use_low ? low_minimum : 0);
    if (budget_bytes_ < minimum_bytes_) {
        throw expert_budget_error("expert cache budget " + std::to_string(budget_bytes_) + " bytes (" + mib(budget_bytes_) +
            ") is below the minimum of " + std::to_string(minimum_bytes_) + " bytes (" + mib(minimum_bytes_) +
            "): one layer's top-" + std::to_string(n_expert_used_) + " experts must fit" +
            (use_low ? " in HIGH, and all but one of them in LOW (" + std::to_string((int) (params.low_fraction * 100)) +
                       "% of the budget)" : ""));
    }

    // the LOW tier gets low_fraction of the budget, but at least its minimum and at most what the
    // HIGH tier's minimum leaves
    const uint64_t low_budget = !use_low ? 0 :
        std::max(low_minimum, std::min((uint64_t) (budget_bytes_ * params.low_fraction), budget_bytes_ - high_minimum));
    expert_cache_config cache_config;
    cache_config.high_slots = share_slots(budget_bytes_ - low_budget, n_expert_used_, high_bytes, group_layers, n_expert_);
    if (use_low) cache_config.low_slots = share_slots(low_budget, n_expert_used_ - 1, low_bytes, group_layers, n_expert_);
    cache_config.policy = params.cache_policy;
    cache_config.weights = params.cache_weights;
    cache_config.low_serves_high = params.low_serves_high;
    cache_config.n_layers = n_layers_;
    cache_ = std::make_unique<expert_cache>(cache_config);  // std::invalid_argument for a bad policy name

    // a ubatch of t tokens needs up to min(n_expert, t*k) distinct experts in one layer: those
    // beyond the HIGH tier (LOW demands the LOW tier has no room for are served in HIGH) are
    // computed in waves (n_waves); with expert biases, which a pass would add to the rows it
    // skips, t is capped so that they fit instead
    for (int g = 0; g < n_groups; g++) {
        const int high_slots = cache_config.high_slots[g];
        high_pools_.push_back(std::make_unique<slot_pool>(group_shapes[g].first, high_slots));
        if (has_expert_bias_ && high_slots < n_expert_) {
            const int cap = high_slots / n_expert_used_;
            max_ubatch_tokens_ = max_ubatch_tokens_ == 0 ? cap : std::min(max_ubatch_tokens_, cap);
        }
        if (use_low) {
            const int low_slots = cache_config.low_slots[g];
            low_pools_.push_back(std::make_unique<slot_pool>(group_shapes[g].second, low_slots));
        }
    }

    store_ = std::make_unique<expert_store>(path, params.io);
    if (use_low) low_store_ = std::make_unique<expert_store>(low_source_, params.io);
    loaders_ = std::make_unique<loader_threads>(io_threads_);
    stats_.resize(n_layers_);
    prefetch_stats_.resize(n_layers_);
    group_of_.assign(n_layers_, -1);
    std::vector<int> moe_layers;
    layer_at_.assign(n_layers_, nullptr);
    for (const auto & l : layers_) {
        group_of_[l->il] = l->group;
        layer_at_[l->il] = l.get();
        moe_layers.push_back(l->il);
        const int max_waves = (n_expert_ + high_pools_[l->group]->n_slots() - 1) / high_pools_[l->group]->n_slots();
        for (int w = 0; w < max_waves; w++) l->wave_ops.push_back({ l.get(), w });
    }

    // the predictor always looks one layer ahead (prediction telemetry, calibration traces);
    // prefetching looks prefetch_depth layers ahead
    if (params.prefetch != "none" && params.prefetch != "hobbit" && params.prefetch != "fate") {
        throw std::invalid_argument("unknown prefetch '" + params.prefetch + "' (none, hobbit, fate)");
    }
    const int depth = params.prefetch == "none" ? 1 : params.prefetch == "fate" ? 1 : std::max(1, params.prefetch_depth);
    predictor_ = std::make_unique<expert_predictor>(model, moe_layers, depth, n_expert_);
    prediction_stats_.resize(depth);
    if (params.prefetch != "none") prefetcher_ = std::make_unique<prefetcher>(io_threads_);
    moe_hook_register(this);
}

expert_residency::~expert_residency() { moe_hook_unregister(this); }

uint64_t expert_residency::pool_bytes(expert_precision p) const {
    uint64_t total = 0;
    for (const auto & pool : p == expert_precision::low ? low_pools_ : high_pools_) total += pool->bytes();
    return total;
}

int expert_residency::pool_slots(expert_precision p) const {
    int total = 0;
    for (const auto & pool : p == expert_precision::low ? low_pools_ : high_pools_) total += pool->n_slots();
    return total;
}

namespace {
void place_experts_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) nth;
    if (ith != 0) return;
    auto * op = (expert_residency::wave_op *) userdata;
    // wave 0: src[2] is the predicted router logits (if any); later waves: the passes before
    const ggml_tensor * predicted = op->wave == 0 ? dst->src[2] : nullptr;
    op->l->owner->place_experts(*op->l, op->wave, dst->src[0], dst->src[1], predicted, dst);
}
}  // namespace

int expert_residency::n_waves(const layer & l, int64_t n_tokens) const {
    if (has_expert_bias_) return 1;  // the ubatch is capped instead (max_ubatch_tokens)
    const int64_t most = std::min<int64_t>(n_expert_, n_tokens * n_expert_used_);  // distinct experts
    const int64_t slots = high_pools_[l.group]->n_slots();
    return (int) ((most + slots - 1) / slots);
}

bool expert_residency::build_pass(layer & l, ggml_context * ctx, int pass, ggml_tensor * moe_input,
                                  ggml_tensor * weights, ggml_tensor * previous, llama_moe_expert_pass * p) {
    const int n_precisions = cache_->has_low() ? 2 : 1;
    if (pass == 0) {
        const ggml_tensor * given[PROJ_COUNT] = { p->up_exps, p->gate_exps, p->down_exps, p->gate_up_exps };
        for (int q = 0; q < PROJ_COUNT; q++) GGML_ASSERT(given[q] == l.stacked[q]);
        l.building_ids = p->ids;
        l.building_waves = n_waves(l, p->ids->ne[1]);
    }
    const int wave = pass / n_precisions, precision = pass % n_precisions;
    if (wave >= l.building_waves) return false;
    ggml_tensor * ids = l.building_ids;
    if (precision == 0) {
        // one op per wave writes the slot ids of all its precision passes; a later wave's op runs
        // after the passes before it (previous), whose slots it may reuse
        ggml_tensor * args[3] = { ids, weights, nullptr };
        int n_args = 2;
        if (wave > 0) {
            args[n_args++] = previous;
        } else if (ggml_tensor * routers = predictor_->stacked(l.il)) {
            // HOBBIT's stacking computer: one matmul predicts the router logits of the layers ahead
            args[n_args++] = ggml_mul_mat(ctx, routers, ggml_reshape_2d(ctx, moe_input, moe_input->ne[0], ids->ne[1]));
        }
        // one task: the op is bookkeeping plus I/O, the other threads have nothing to do in it
        l.building_slot_ids = ggml_custom_4d(ctx, GGML_TYPE_I32, ids->ne[0], ids->ne[1], n_precisions, 1, args, n_args,
                                             place_experts_op, 1, &l.wave_ops[wave]);
        ggml_format_name(l.building_slot_ids, "edgemoe_slot_ids-%d-%d", l.il, wave);
    }
    const slot_pool & pool = precision == 0 ? *high_pools_[l.group] : *low_pools_[l.group];
    ggml_tensor * swapped[PROJ_COUNT] = {};
    for (int q = 0; q < PROJ_COUNT; q++) {
        if (l.stacked[q]) swapped[q] = pool.tensor((expert_projection) q);
    }
    ggml_tensor * slot_ids = l.building_slot_ids;
    *p = { swapped[PROJ_UP], swapped[PROJ_GATE], swapped[PROJ_DOWN], swapped[PROJ_GATE_UP],
           ggml_view_2d(ctx, slot_ids, ids->ne[0], ids->ne[1], slot_ids->nb[1], precision * slot_ids->nb[2]) };
    return true;
}

void expert_residency::fail(const std::string & why, ggml_tensor * dst) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!failed_) error_ = why;
    failed_ = true;
    memset(dst->data, 0xff, ggml_nbytes(dst));  // -1 everywhere: well-defined (ignored) output
}

namespace {
int32_t id_at(const ggml_tensor * ids, int64_t i, int64_t t) {
    return *(const int32_t *) ((const char *) ids->data + i * ids->nb[0] + t * ids->nb[1]);
}
}  // namespace

void expert_residency::place_experts(layer & l, int wave, const ggml_tensor * ids, const ggml_tensor * weights,
                                     const ggml_tensor * predicted, ggml_tensor * dst) {
    const auto t0 = clock_type::now();
    GGML_ASSERT(ids->type == GGML_TYPE_I32 && dst->type == GGML_TYPE_I32 && ggml_is_contiguous(dst));
    GGML_ASSERT(weights->type == GGML_TYPE_F32);
    {
        std::lock_guard<std::mutex> lock(mutex_);
        if (failed_) {  // a load failed earlier in this decode
            memset(dst->data, 0xff, ggml_nbytes(dst));
            return;
        }
    }
    if (wave == 0 && !begin_layer(l, ids, weights, dst)) return;
    if (!serve_wave(l, wave, ids, dst, t0)) return;
    if (wave == 0 && predicted) predict_and_prefetch(l, predicted, ids->ne[1]);
}

bool expert_residency::begin_layer(const layer & l, const ggml_tensor * ids, const ggml_tensor * weights, ggml_tensor * dst) {
    const int64_t n_used = ids->ne[0], n_tokens = ids->ne[1];
    // weights: [1, n_used, n_tokens]
    auto weight_at = [&](int64_t i, int64_t t) { return *(const float *) ((const char *) weights->data + i * weights->nb[1] + t * weights->nb[2]); };
    if (l.il == first_il_) { cache_->advance_tokens(n_tokens); ubatch_index_++; }
    // the previous layer has been computed: its experts may go; finished prefetches are cached
    for (const auto & [key, p] : current_pins_) cache_->unpin(key, p, true);
    current_pins_.clear();
    if (prefetcher_) collect_finished_prefetches();
    if (failed_) { memset(dst->data, 0xff, ggml_nbytes(dst)); return false; }
    // predictions for this layer are settled: mispredicted experts may go
    for (const auto & [key, p] : predicted_pins_[l.il]) cache_->unpin(key, p, false);
    predicted_pins_.erase(l.il);
    count_prediction(l, ids);
    if (tracing_) record_trace(l, ids, weights);
    predictions_.erase(l.il);

    // each selection's demand, and per distinct expert the highest demand of its tokens (in order of first use)
    const precision_params & pp = params_.precision;
    const bool all_high = !pp.use_low && !pp.use_skip;
    std::vector<expert_precision> demand(n_used * n_tokens, expert_precision::high);
    std::vector<float> w(n_used);
    std::vector<std::pair<int, expert_precision>> wanted;
    std::unordered_map<int, size_t> wanted_index;
    for (int64_t t = 0; t < n_tokens; t++) {
        if (!all_high) {
            for (int64_t i = 0; i < n_used; i++) w[i] = weight_at(i, t);
            choose_precisions(w.data(), (int) n_used, pp, &demand[t * n_used]);
        }
        for (int64_t i = 0; i < n_used; i++) {
            const int e = id_at(ids, i, t);
            if (e < 0 || e >= n_expert_) {
                fail("layer " + std::to_string(l.il) + ": router chose expert " + std::to_string(e) + " out of " + std::to_string(n_expert_), dst);
                return false;
            }
            auto [it, inserted] = wanted_index.emplace(e, wanted.size());
            if (inserted) wanted.emplace_back(e, demand[t * n_used + i]);
            else wanted[it->second].second = std::max(wanted[it->second].second, demand[t * n_used + i]);
        }
    }

    // waves of at most one HIGH tier's worth of experts each; the cached experts go first, so the
    // loads of the first wave do not evict them before their use
    const int waves = n_waves(l, n_tokens);
    wave_plan_.assign(waves, {});
    if (waves > 1) {
        std::stable_partition(wanted.begin(), wanted.end(), [&](const std::pair<int, expert_precision> & e) {
            expert_precision tier;
            return serving_tier(l.il, e.first, e.second, &tier);
        });
    }
    const size_t per_wave = waves == 1 ? wanted.size() : (size_t) high_pools_[l.group]->n_slots();
    for (size_t i = 0; i < wanted.size(); i++) wave_plan_[i / per_wave].push_back(wanted[i]);
    return true;
}

bool expert_residency::serve_wave(const layer & l, int wave, const ggml_tensor * ids, ggml_tensor * dst,
                                  std::chrono::steady_clock::time_point t0) {
    const int64_t n_used = ids->ne[0], n_tokens = ids->ne[1];
    if (wave > 0) {  // the wave before has been computed: its experts may go
        for (const auto & [key, p] : current_pins_) cache_->unpin(key, p, true);
        current_pins_.clear();
    }
    const std::vector<std::pair<int, expert_precision>> none;
    const auto & wanted = wave < (int) wave_plan_.size() ? wave_plan_[wave] : none;
    std::vector<expert_cache::placement> placed;
    try {
        placed = cache_->place(l.group, l.il, wanted);
    } catch (const std::exception &) {
        // prefetches in flight may hold the slots an on-demand load needs: they give way
        drop_prefetches();
        try {
            placed = cache_->place(l.group, l.il, wanted);
        } catch (const std::exception & ex) {
            fail(ex.what(), dst);
            return false;
        }
    }

    expert_layer_stats st;
    st.requests = placed.size();
    std::vector<expert_cache::placement> loads;
    std::vector<std::shared_ptr<prefetch_job>> claimed;
    bool waited = false;  // for a prefetch read in flight
    std::unordered_map<int, const expert_cache::placement *> where;
    expert_prefetch_stats & pst = prefetch_stats_[l.il];
    for (const auto & p : placed) {
        where[p.expert] = &p;
        if (p.has_evicted) pst.wasted += prefetched_unused_.erase({ p.evicted, p.precision });
        if (p.precision == expert_precision::skip) { st.skipped++; continue; }
        const cached_copy copy = { make_expert_key(l.il, p.expert), p.precision };
        const bool high = p.precision == expert_precision::high;
        current_pins_.push_back(copy);
        cache_->pin(copy.first, copy.second, true);
        if (p.load) { loads.push_back(p); (high ? st.loads_high : st.loads_low)++; continue; }
        (high ? st.hits_high : st.hits_low)++;
        pst.used += prefetched_unused_.erase(copy);
        auto it = in_flight_.find(copy);
        if (it != in_flight_.end()) {
            // prefetched but not read yet: read it now (queued) or wait for it (running)
            if (auto job = prefetcher_->claim(it->second)) claimed.push_back(job);
            else { waited = true; collect_finished_prefetches(); }
        }
    }
    st.hits = st.hits_high + st.hits_low;
    st.misses = st.loads_high + st.loads_low;

    if (!loads.empty() || !claimed.empty()) {
        // the misses and the claimed prefetches are read together, several in flight
        std::vector<expert_read> reads;
        for (const auto & p : loads) {
            for (expert_read & r : reads_of(l, p.expert, p.precision, p.slot)) reads.push_back(std::move(r));
        }
        for (const auto & job : claimed) reads.insert(reads.end(), job->reads.begin(), job->reads.end());
        sort_in_file_order(reads);
        if (prefetcher_) prefetcher_->pause();
        std::string error = read_all(reads, st);
        if (prefetcher_) prefetcher_->resume();
        for (const auto & job : claimed) {
            in_flight_.erase({ job->key, job->precision });
            cache_->unpin(job->key, job->precision, true);
        }
        if (!error.empty()) {
            drop_prefetches();
            cache_->forget_all();  // slots may hold partial data
            current_pins_.clear();
            predicted_pins_.clear();
            fail(error, dst);
            return false;
        }
    }

    // slot ids for the selections this wave serves, -1 for the others (and for the other pass)
    const int n_passes = (int) dst->ne[2];
    int32_t * out = (int32_t *) dst->data;
    for (int64_t t = 0; t < n_tokens; t++) {
        for (int64_t i = 0; i < n_used; i++) {
            auto it = where.find(id_at(ids, i, t));
            const expert_cache::placement * p = it == where.end() ? nullptr : it->second;
            const int pass = p && p->precision == expert_precision::low ? 1 : 0;
            for (int q = 0; q < n_passes; q++) {
                out[(q * n_tokens + t) * n_used + i] = p && q == pass && p->precision != expert_precision::skip ? p->slot : -1;
            }
            if (!p) continue;
            (p->precision == expert_precision::high ? st.selections_high
             : p->precision == expert_precision::low ? st.selections_low : st.selections_skip)++;
        }
    }
    st.stall_ms = loads.empty() && claimed.empty() && !waited ? 0.0 : ms_since(t0);
    {
        std::lock_guard<std::mutex> lock(mutex_);
        stats_[l.il].add(st);
    }
    return true;
}

bool expert_residency::serving_tier(int il, int expert, expert_precision demand, expert_precision * tier) const {
    const int g = group_of_[il];
    const expert_key key = make_expert_key(il, expert);
    if (cache_->tier(g, expert_precision::high).find(key) >= 0) { *tier = expert_precision::high; return true; }
    if (cache_->tier(g, expert_precision::low).find(key) >= 0 &&
        (demand != expert_precision::high || params_.low_serves_high)) { *tier = expert_precision::low; return true; }
    return false;
}

std::vector<expert_read> expert_residency::reads_of(const layer & l, int expert, expert_precision precision, int slot) const {
    const bool low = precision == expert_precision::low;
    const slot_pool & pool = low ? *low_pools_[l.group] : *high_pools_[l.group];
    const expert_store & store = low ? *low_store_ : *store_;
    std::vector<expert_read> reads;
    for (int p = 0; p < PROJ_COUNT; p++) {
        if (!l.stacked[p]) continue;
        const uint64_t size = pool.shapes()[p].bytes;
        const uint64_t offset = (low ? l.low_offset[p] : l.file_offset[p]) + (uint64_t) expert * size;
        reads.push_back({ &store, offset, size, pool.slot_data((expert_projection) p, slot),
                          std::string(low ? "the LOW copy of " : "") + "expert " + std::to_string(expert) + " of layer " +
                          std::to_string(l.il) + " (" + kProjectionNames[p] + ")",
                          pool.repack_view((expert_projection) p, slot) });
    }
    return reads;
}

void expert_residency::predict_and_prefetch(const layer & l, const ggml_tensor * predicted, int64_t n_tokens) {
    const std::vector<int> & ahead = predictor_->ahead(l.il);
    const int k = n_expert_used_;
    auto row = [&](int64_t t, size_t d) {
        return (const float *) ((const char *) predicted->data + t * predicted->nb[1]) + d * n_expert_;
    };
    // remember the top-k guesses for each layer ahead, to score them when it runs
    std::vector<int> ids;
    std::vector<float> w;
    for (size_t d = 0; d < ahead.size(); d++) {
        auto & guesses = predictions_[ahead[d]];
        guesses.resize(ahead.size());
        guesses[d].assign(n_tokens * k, -1);
        for (int64_t t = 0; t < n_tokens; t++) {
            predicted_top_k(row(t, d), n_expert_, k, ids, w);
            std::copy(ids.begin(), ids.end(), guesses[d].begin() + t * k);
        }
    }
    if (!prefetcher_ || n_tokens != 1) return;  // prefetching serves decode

    // HOBBIT's walk (or Fate's next layer): the predictions walked are pinned until their layer
    // runs; those not cached are prefetched into reserved slots
    std::vector<std::vector<predicted_expert>> predicted_layers;
    const bool fate = params_.prefetch == "fate";
    for (size_t d = 0; d < ahead.size(); d++) {
        predicted_layers.push_back(predict_layer(ahead[d], row(0, d), n_expert_, k, params_.precision,
                                                 fate ? (params_.fate_extra < 0 ? k : params_.fate_extra) : 0,
                                                 params_.fate_percentile));
    }
    const auto walked = walk_predictions(predicted_layers, !fate, [&](const predicted_expert & p) {
        expert_precision tier;
        return serving_tier(p.layer, p.expert, p.precision, &tier);
    });
    for (const predicted_expert & p : walked) {
        const expert_key key = make_expert_key(p.layer, p.expert);
        expert_precision pinned = p.precision;
        if (!serving_tier(p.layer, p.expert, p.precision, &pinned)) {
            expert_cache::placement slot = cache_->reserve(group_of_[p.layer], p.layer, p.expert, p.precision);
            if (!slot.load) continue;  // no slot can be evicted for it now
            if (slot.has_evicted) prefetch_stats_[p.layer].wasted += prefetched_unused_.erase({ slot.evicted, p.precision });
            auto job = std::make_shared<prefetch_job>();
            job->key = key;
            job->precision = p.precision;
            job->reads = reads_of(*layer_at_[p.layer], p.expert, p.precision, slot.slot);
            in_flight_[{ key, p.precision }] = job;
            prefetched_unused_.insert({ key, p.precision });
            cache_->pin(key, p.precision, true);  // until the read is done
            prefetch_stats_[p.layer].issued++;
            prefetcher_->submit(job);
        }
        cache_->pin(key, pinned, false);
        predicted_pins_[p.layer].push_back({ key, pinned });
    }
}

void expert_residency::count_prediction(const layer & l, const ggml_tensor * ids) {
    auto it = predictions_.find(l.il);
    if (it == predictions_.end()) return;
    const int64_t n_used = ids->ne[0], n_tokens = ids->ne[1];
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t d = 0; d < it->second.size(); d++) {
        const std::vector<int32_t> & guess = it->second[d];
        if ((int64_t) guess.size() != n_tokens * n_used) continue;  // made for another ubatch
        expert_prediction_stats & ps = prediction_stats_[d];
        for (int64_t t = 0; t < n_tokens; t++) {
            const int32_t * row = (const int32_t *) ((const char *) ids->data + t * ids->nb[1]);
            ps.tokens++;
            ps.top1_correct += guess[t * n_used] == row[0];
            ps.predicted += n_used;
            ps.actual += n_used;
            for (int64_t i = 0; i < n_used; i++) {
                ps.overlap += std::find(row, row + n_used, guess[t * n_used + i]) != row + n_used;
            }
        }
    }
}

void expert_residency::record_trace(const layer & l, const ggml_tensor * ids, const ggml_tensor * weights) {
    const int64_t n_used = ids->ne[0], n_tokens = ids->ne[1];
    auto it = predictions_.find(l.il);
    const std::vector<int32_t> * guess = it != predictions_.end() && !it->second.empty() &&
        (int64_t) it->second[0].size() == n_tokens * n_used ? &it->second[0] : nullptr;
    std::lock_guard<std::mutex> lock(mutex_);
    for (int64_t t = 0; t < n_tokens; t++) {
        trace_.ubatch.push_back(ubatch_index_);
        trace_.layer.push_back(l.il);
        for (int64_t i = 0; i < n_used; i++) {
            trace_.ids.push_back(*(const int32_t *) ((const char *) ids->data + i * ids->nb[0] + t * ids->nb[1]));
            trace_.weights.push_back(*(const float *) ((const char *) weights->data + i * weights->nb[1] + t * weights->nb[2]));
            trace_.predicted.push_back(guess ? (*guess)[t * n_used + i] : -1);
        }
    }
}

void expert_residency::collect_finished_prefetches() {
    for (const auto & job : prefetcher_->take_finished()) {
        in_flight_.erase({ job->key, job->precision });
        cache_->unpin(job->key, job->precision, true);
        const int il = expert_key_layer(job->key);
        prefetch_stats_[il].bytes_read += job->bytes;
        prefetch_stats_[il].load_ms += job->ms;
        if (!job->error.empty()) {
            std::lock_guard<std::mutex> lock(mutex_);
            if (!failed_) error_ = job->error;
            failed_ = true;
        }
    }
    if (failed_) {
        drop_prefetches();
        cache_->forget_all();
        current_pins_.clear();
        predicted_pins_.clear();
    }
}

void expert_residency::drop_prefetches() {
    if (!prefetcher_) return;
    for (const auto & job : prefetcher_->cancel_all()) {
        const int il = expert_key_layer(job->key);
        cache_->unpin(job->key, job->precision, true);
        cache_->discard(group_of_[il], job->key, job->precision);
        prefetched_unused_.erase({ job->key, job->precision });
        in_flight_.erase({ job->key, job->precision });
    }
    for (const auto & job : prefetcher_->take_finished()) {
        in_flight_.erase({ job->key, job->precision });
        cache_->unpin(job->key, job->precision, true);
    }
}

std::string expert_residency::read_all(const std::vector<expert_read> & reads, expert_layer_stats & st) {
    // each thread takes the next read: several stay in flight (small reads are latency-bound)
    const int n_threads = std::min<int>(loaders_->n_threads(), (int) reads.size());
    std::atomic<size_t> next{0};
    std::vector<uint64_t> bytes(n_threads, 0);
    std::vector<std::string> errs(n_threads);
    const auto t0 = clock_type::now();
    loaders_->run(n_threads, [&](int t) {
        for (size_t j; (j = next.fetch_add(1)) < reads.size();) {
            try {
                bytes[t] += reads[j].run();
            } catch (const std::exception & ex) {
                errs[t] = ex.what();
                next = reads.size();  // the others stop too
                return;
            }
        }
    });
    st.load_ms += ms_since(t0);
    std::string error;
    for (int t = 0; t < n_threads; t++) {
        if (error.empty()) error = errs[t];
        st.bytes_read += bytes[t];
    }
    return error;
}

expert_fill_stats expert_residency::fill(const std::map<int, std::vector<int>> & ranking) {
    const auto t0 = clock_type::now();
    // per layer: its experts in fill order, and how many of them are placed
    std::vector<std::vector<int>> order(n_layers_);
    std::vector<size_t> placed(n_layers_, 0);
    for (const auto & l : layers_) {
        std::vector<bool> listed(n_expert_, false);
        auto it = ranking.find(l->il);
        for (int e : it == ranking.end() ? std::vector<int>() : it->second) {
            if (e < 0 || e >= n_expert_ || listed[e]) throw std::invalid_argument("fill ranking: bad expert id");
            listed[e] = true;
            order[l->il].push_back(e);
        }
        for (int e = 0; e < n_expert_; e++) if (!listed[e]) order[l->il].push_back(e);
    }
    expert_fill_stats out;
    std::vector<expert_read> reads;
    const expert_precision high = expert_precision::high;
    for (int g = 0; g < (int) high_pools_.size(); g++) {
        const slot_table & tier = cache_->tier(g, high);
        for (bool more = true; more && tier.n_used() < tier.n_slots();) {
            more = false;
            for (const auto & l : layers_) {
                if (l->group != g || placed[l->il] == order[l->il].size() || tier.n_used() == tier.n_slots()) continue;
                more = true;
                const int e = order[l->il][placed[l->il]++];
                const expert_cache::placement slot = cache_->reserve(g, l->il, e, high);
                if (!slot.load) continue;
                for (expert_read & r : reads_of(*l, e, high, slot.slot)) reads.push_back(std::move(r));
                out.experts++;
            }
        }
    }
    sort_in_file_order(reads);
    expert_layer_stats st;
    const std::string error = read_all(reads, st);
    if (!error.empty()) {
        cache_->forget_all();
        throw std::runtime_error(error);
    }
    out.bytes_read = st.bytes_read;
    out.ms = ms_since(t0);
    fill_stats_ = out;
    return out;
}

std::string expert_residency::take_error() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::string e = error_;
    error_.clear();
    failed_ = false;
    return e;
}

void expert_residency::start_sequence() { cache_->start_sequence(); }

std::vector<std::pair<int, expert_layer_stats>> expert_residency::layer_stats() const {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<std::pair<int, expert_layer_stats>> out;
    for (const auto & l : layers_) out.emplace_back(l->il, stats_[l->il]);
    return out;
}

std::vector<std::pair<int, expert_prefetch_stats>> expert_residency::prefetch_stats() const {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<std::pair<int, expert_prefetch_stats>> out;
    for (const auto & l : layers_) out.emplace_back(l->il, prefetch_stats_[l->il]);
    return out;
}

std::vector<expert_prediction_stats> expert_residency::prediction_stats() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return prediction_stats_;
}

double expert_residency::prefetch_busy_ms() const { return prefetcher_ ? prefetcher_->busy_ms() : 0.0; }

uint64_t expert_residency::resident_experts() const { return cache_->resident_experts(); }

void expert_residency::reset_stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto & s : stats_) s = expert_layer_stats();
    for (auto & s : prefetch_stats_) s = expert_prefetch_stats();
    for (auto & s : prediction_stats_) s = expert_prediction_stats();
    if (prefetcher_) prefetcher_->reset_busy_ms();
}

void expert_residency::set_tracing(bool on) {
    std::lock_guard<std::mutex> lock(mutex_);
    tracing_ = on;
}

routing_trace expert_residency::take_trace() {
    std::lock_guard<std::mutex> lock(mutex_);
    routing_trace out = std::move(trace_);
    trace_ = routing_trace();
    return out;
}

#include "expert-residency.h"

#include "moe-hook.h"

#include "ggml-cpu.h"
#include "gguf.h"
#include "llama.h"
#include "llama-model.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <stdexcept>
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

// "blk.<il>.ffn_<proj>_exps.weight" -> (il, projection); false for anything else
bool parse_expert_tensor_name(const std::string & name, int * il, expert_projection * proj) {
    int layer = -1, used = 0;
    char kind[16] = {0};
    if (sscanf(name.c_str(), "blk.%d.ffn_%15[a-z_]%n", &layer, kind, &used) != 2) return false;
    const std::string k = kind;
    static const std::pair<const char *, expert_projection> kinds[] = {
        {"up_exps", PROJ_UP}, {"gate_exps", PROJ_GATE}, {"down_exps", PROJ_DOWN}, {"gate_up_exps", PROJ_GATE_UP} };
    for (const auto & [n, p] : kinds) {
        if (k == n && name.substr(used) == ".weight") { *il = layer; *proj = p; return true; }
    }
    return false;
}

std::string meta_string(const llama_model * model, const std::string & key) {
    char buf[256];
    int32_t n = llama_model_meta_val_str(model, key.c_str(), buf, sizeof(buf));
    return n < 0 ? std::string() : std::string(buf);
}

}  // namespace

expert_residency::expert_residency(llama_model * model, const std::string & path, const expert_residency_params & params)
    : budget_bytes_(params.budget_bytes), io_threads_(std::max(1, params.io_threads)) {
    // where each expert tensor starts in the file
    gguf_init_params gparams = { /*no_alloc*/ true, /*ctx*/ nullptr };
    gguf_context * meta = gguf_init_from_file(path.c_str(), gparams);
    if (!meta) throw std::runtime_error("cannot read the GGUF header of " + path);
    const uint64_t data_offset = gguf_get_data_offset(meta);

    std::map<int, std::unique_ptr<layer>> by_layer;
    std::map<int, expert_shapes> shapes_of;
    for (const auto & [name, t] : llama_internal_get_tensor_map(model)) {
        int il; expert_projection proj;
        if (!parse_expert_tensor_name(name, &il, &proj)) continue;
        int64_t id = gguf_find_tensor(meta, name.c_str());
        if (id < 0) { gguf_free(meta); throw std::runtime_error("expert tensor " + name + " not in the GGUF directory"); }
        auto & l = by_layer[il];
        if (!l) { l = std::make_unique<layer>(); l->owner = this; l->il = il; }
        l->stacked[proj] = t;
        l->file_offset[proj] = data_offset + gguf_get_tensor_offset(meta, id);
        expert_matrix_shape & s = shapes_of[il][proj];
        s.present = true; s.type = t->type; s.ne0 = t->ne[0]; s.ne1 = t->ne[1]; s.bytes = t->nb[2];
        if (n_expert_ == 0) n_expert_ = (int) t->ne[2];
        if (t->ne[2] != n_expert_ || !ggml_is_contiguous(t)) {
            gguf_free(meta);
            throw std::runtime_error("expert tensor " + name + " has an unsupported layout");
        }
    }
    gguf_free(meta);
    if (by_layer.empty()) throw std::runtime_error("the model has no stacked expert tensors: nothing to offload");

    const std::string arch = meta_string(model, "general.architecture");
    n_expert_used_ = atoi(meta_string(model, arch + ".expert_used_count").c_str());
    if (n_expert_used_ <= 0 || n_expert_used_ > n_expert_) {
        throw std::runtime_error("cannot read " + arch + ".expert_used_count from the model");
    }

    // groups of layers whose experts have the same shapes share one slot pool
    std::vector<expert_shapes> group_shapes;
    std::vector<int> group_layers;
    for (auto & [il, l] : by_layer) {
        const expert_shapes & s = shapes_of[il];
        auto it = std::find(group_shapes.begin(), group_shapes.end(), s);
        l->group = (int) (it - group_shapes.begin());
        if (it == group_shapes.end()) { group_shapes.push_back(s); group_layers.push_back(0); }
        group_layers[l->group]++;
        expert_bytes_total_ += expert_bytes_of(s) * n_expert_;
        layers_.push_back(std::move(l));
    }

    // minimum: each group must hold one token's top-k experts of a layer at once
    const int n_groups = (int) group_shapes.size();
    for (int g = 0; g < n_groups; g++) minimum_bytes_ += (uint64_t) n_expert_used_ * expert_bytes_of(group_shapes[g]);
    if (budget_bytes_ < minimum_bytes_) {
        throw expert_budget_error("expert cache budget " + std::to_string(budget_bytes_) + " bytes (" + mib(budget_bytes_) +
            ") is below the minimum of " + std::to_string(minimum_bytes_) + " bytes (" + mib(minimum_bytes_) +
            "): one layer's top-" + std::to_string(n_expert_used_) + " experts must fit");
    }

    // the budget beyond the minimum is shared in proportion to each group's expert bytes
    const uint64_t extra = budget_bytes_ - minimum_bytes_;
    max_ubatch_tokens_ = 0;
    for (int g = 0; g < n_groups; g++) {
        const uint64_t slot_bytes = expert_bytes_of(group_shapes[g]);
        const uint64_t demand_slots = (uint64_t) group_layers[g] * n_expert_;
        const double share = (double) (demand_slots * slot_bytes) / (double) expert_bytes_total_;
        uint64_t slots = n_expert_used_ + (uint64_t) (extra * share / slot_bytes);
        slots = std::min(slots, demand_slots);
        pools_.push_back(std::make_unique<slot_pool>(group_shapes[g], (int) slots, ggml_backend_cpu_buffer_type()));
        policies_.push_back(make_cache_policy(params.cache_policy));
        // a ubatch of t tokens needs up to min(n_expert, t*k) distinct experts in one layer
        if (slots < (uint64_t) n_expert_) {
            int cap = (int) (slots / n_expert_used_);
            max_ubatch_tokens_ = max_ubatch_tokens_ == 0 ? cap : std::min(max_ubatch_tokens_, cap);
        }
    }

    store_ = std::make_unique<expert_store>(path, params.io);
    loaders_ = std::make_unique<loader_threads>(io_threads_);
    int max_il = 0;
    for (const auto & l : layers_) max_il = std::max(max_il, l->il);
    stats_.resize(max_il + 1);
    moe_hook_register(this);
}

expert_residency::~expert_residency() { moe_hook_unregister(this); }

uint64_t expert_residency::pool_bytes() const {
    uint64_t total = 0;
    for (const auto & p : pools_) total += p->bytes();
    return total;
}

namespace {
void place_experts_op(ggml_tensor * dst, const ggml_tensor * ids, int ith, int nth, void * userdata) {
    (void) nth;
    if (ith != 0) return;
    auto * l = (expert_residency::layer *) userdata;
    l->owner->place_experts(*l, ids, dst);
}
}  // namespace

void expert_residency::build_layer(layer & l, ggml_context * ctx, ggml_tensor ** up, ggml_tensor ** gate,
                                   ggml_tensor ** down, ggml_tensor ** gate_up, ggml_tensor ** ids) {
    slot_pool & pool = *pools_[l.group];
    ggml_tensor ** slots[PROJ_COUNT] = { up, gate, down, gate_up };
    for (int p = 0; p < PROJ_COUNT; p++) {
        if (*slots[p]) {
            GGML_ASSERT(*slots[p] == l.stacked[p]);
            *slots[p] = pool.tensor((expert_projection) p);
        }
    }
    // one task: the op is bookkeeping plus I/O, the other threads have nothing to do in it
    ggml_tensor * slot_ids = ggml_map_custom1(ctx, *ids, place_experts_op, 1, &l);
    ggml_format_name(slot_ids, "edgemoe_slot_ids-%d", l.il);
    *ids = slot_ids;
}

void expert_residency::place_experts(layer & l, const ggml_tensor * ids, ggml_tensor * dst) {
    const auto t0 = clock_type::now();
    GGML_ASSERT(ids->type == GGML_TYPE_I32 && dst->type == GGML_TYPE_I32 && ggml_is_contiguous(dst));
    const int64_t n_used = ids->ne[0], n_tokens = ids->ne[1];
    int32_t * out = (int32_t *) dst->data;
    auto id_at = [&](int64_t i, int64_t t) { return *(const int32_t *) ((const char *) ids->data + i * ids->nb[0] + t * ids->nb[1]); };

    {
        std::lock_guard<std::mutex> lock(mutex_);
        if (failed_) {  // a load failed earlier in this decode: produce well-defined (ignored) output
            memset(out, 0, ggml_nbytes(dst));
            return;
        }
    }

    slot_pool & pool = *pools_[l.group];
    cache_policy & policy = *policies_[l.group];

    // the distinct experts this ubatch needs here, in order of first use
    std::vector<int> needed;
    std::unordered_set<int> seen;
    for (int64_t t = 0; t < n_tokens; t++) {
        for (int64_t i = 0; i < n_used; i++) {
            int e = id_at(i, t);
            if (e < 0 || e >= n_expert_) {
                std::lock_guard<std::mutex> lock(mutex_);
                failed_ = true;
                error_ = "layer " + std::to_string(l.il) + ": router chose expert " + std::to_string(e) + " out of " + std::to_string(n_expert_);
                memset(out, 0, ggml_nbytes(dst));
                return;
            }
            if (seen.insert(e).second) needed.push_back(e);
        }
    }
    if ((int) needed.size() > pool.n_slots()) {
        std::lock_guard<std::mutex> lock(mutex_);
        failed_ = true;
        error_ = "layer " + std::to_string(l.il) + ": a ubatch needs " + std::to_string(needed.size()) +
                 " experts but the cache holds " + std::to_string(pool.n_slots()) + " (n_ubatch too large for the budget)";
        memset(out, 0, ggml_nbytes(dst));
        return;
    }

    expert_layer_stats st;
    st.requests = needed.size();
    std::unordered_set<expert_key> pinned;  // needed now: must not be evicted for another one
    for (int e : needed) pinned.insert(make_expert_key(l.il, e));
    std::vector<std::pair<int, int>> to_load;  // (slot, expert)
    std::vector<int> slot_of_expert(n_expert_, -1);
    for (int e : needed) {
        const expert_key key = make_expert_key(l.il, e);
        int slot = pool.find(key);
        if (slot >= 0) {
            st.hits++;
            policy.on_use(key);
        } else {
            st.misses++;
            slot = pool.take_free_slot();
            if (slot < 0) {
                expert_key victim = 0;
                bool found = policy.victim([&](expert_key k) { return pinned.count(k) == 0; }, &victim);
                GGML_ASSERT(found && "no evictable slot although the ubatch fits");
                slot = pool.find(victim);
                policy.on_evict(victim);
                pool.release(slot);
                slot = pool.take_free_slot();
            }
            pool.assign(slot, key);
            policy.on_insert(key);
            policy.on_use(key);
            to_load.emplace_back(slot, e);
        }
        slot_of_expert[e] = slot;
    }

    std::string error;
    if (!to_load.empty()) {
        try {
            load_misses(l, to_load, st);
        } catch (const std::exception & ex) {
            error = ex.what();
        }
    }
    if (!error.empty()) {
        // slots may hold partial data: forget everything, and fail this decode
        pool.release_all();
        policies_[l.group] = make_cache_policy(policy.name());
        std::lock_guard<std::mutex> lock(mutex_);
        failed_ = true;
        error_ = error;
        memset(out, 0, ggml_nbytes(dst));
        return;
    }

    for (int64_t t = 0; t < n_tokens; t++) {
        for (int64_t i = 0; i < n_used; i++) out[t * n_used + i] = slot_of_expert[id_at(i, t)];
    }
    st.stall_ms = to_load.empty() ? 0.0 : ms_since(t0);
    std::lock_guard<std::mutex> lock(mutex_);
    stats_[l.il].add(st);
}

void expert_residency::load_misses(const layer & l, const std::vector<std::pair<int, int>> & slot_expert,
                                   expert_layer_stats & st) {
    slot_pool & pool = *pools_[l.group];
    const expert_shapes & shapes = pool.shapes();
    // one job = one projection of one expert
    struct job { int slot, expert; expert_projection proj; };
    std::vector<job> jobs;
    for (const auto & [slot, e] : slot_expert) {
        for (int p = 0; p < PROJ_COUNT; p++) {
            if (shapes[p].present) jobs.push_back({slot, e, (expert_projection) p});
        }
    }
    // each thread takes the next job: several reads stay in flight (small reads are latency-bound)
    const int n_threads = std::min<int>(loaders_->n_threads(), (int) jobs.size());
    std::atomic<size_t> next{0};
    std::vector<uint64_t> bytes(n_threads, 0);
    std::vector<double> ms(n_threads, 0.0);
    std::vector<std::string> errs(n_threads);
    loaders_->run(n_threads, [&](int t) {
        for (size_t j; (j = next.fetch_add(1)) < jobs.size();) {
            const job & jb = jobs[j];
            const uint64_t size = shapes[jb.proj].bytes;
            const uint64_t offset = l.file_offset[jb.proj] + (uint64_t) jb.expert * size;
            const auto t0 = clock_type::now();
            try {
                bytes[t] += store_->read_range(offset, size, pool.slot_data(jb.proj, jb.slot));
            } catch (const std::exception & ex) {
                static const char * pname[PROJ_COUNT] = { "up", "gate", "down", "gate_up" };
                errs[t] = "cannot read expert " + std::to_string(jb.expert) + " of layer " + std::to_string(l.il) +
                          " (" + pname[jb.proj] + ", file offset " + std::to_string(offset) + ") from " +
                          store_->path() + ": " + ex.what();
                next = jobs.size();  // the others stop too
                return;
            }
            ms[t] += ms_since(t0);
        }
    });
    for (int t = 0; t < n_threads; t++) {
        if (!errs[t].empty()) throw std::runtime_error(errs[t]);
        st.bytes_read += bytes[t];
        st.load_ms += ms[t];
    }
}

std::string expert_residency::take_error() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::string e = error_;
    error_.clear();
    failed_ = false;
    return e;
}

std::vector<std::pair<int, expert_layer_stats>> expert_residency::layer_stats() const {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<std::pair<int, expert_layer_stats>> out;
    for (const auto & l : layers_) out.emplace_back(l->il, stats_[l->il]);
    return out;
}

uint64_t expert_residency::resident_experts() const {
    uint64_t n = 0;
    for (const auto & p : pools_) n += p->n_used();
    return n;
}

void expert_residency::reset_stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto & s : stats_) s = expert_layer_stats();
}

// Expert residency: turn on the byte-budgeted expert cache of a Model loaded with
// experts_on_demand, read its statistics, and report load errors after a decode.
#include "native.h"

#include "llama.h"
#include "../src/expert-residency.h"

#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <vector>

std::string take_residency_error(Context & c) {
    if (!c.model || !c.model->residency) return "";
    std::string err = c.model->residency->take_error();
    if (!err.empty()) llama_memory_clear(llama_get_memory(c.ctx), true);
    return err;
}

namespace {

template <typename T>
nb::ndarray<nb::numpy, T> to_numpy(std::vector<T> && v, std::initializer_list<size_t> shape) {
    auto * data = new std::vector<T>(std::move(v));
    nb::capsule owner(data, [](void * p) noexcept { delete (std::vector<T> *) p; });
    return nb::ndarray<nb::numpy, T>(data->data(), shape, owner);
}

expert_precision precision_from_name(const std::string & name) {
    if (name == "high") return expert_precision::high;
    if (name == "low") return expert_precision::low;
    if (name == "skip") return expert_precision::skip;
    throw nb::value_error(("unknown precision '" + name + "' (high, low, skip)").c_str());
}

policy_weights weights_from(const std::vector<float> & w) {
    if (w.size() != 4) throw nb::value_error("policy weights are four numbers: lru, lfu, lhu, fld");
    return { w[0], w[1], w[2], w[3] };
}

void enable(Model & m, uint64_t budget_bytes, const std::string & io, int io_threads, const std::string & policy,
            const std::vector<float> & weights, bool use_low, bool use_skip, double t1, double t2, double low_fraction,
            bool low_serves_high, const std::string & low_from, const std::string & prefetch, int prefetch_depth,
            double fate_percentile, int fate_extra) {
    if (!m.experts_on_demand) throw nb::value_error("the model was not loaded with experts_on_demand=True");
    if (m.residency) throw nb::value_error("expert residency is already enabled for this model");
    if (io_threads < 1) throw nb::value_error("io_threads must be >= 1");
    if (!(low_fraction > 0 && low_fraction < 1)) throw nb::value_error("low_fraction must be between 0 and 1");
    if (!(0 <= t1 && t1 <= t2)) throw nb::value_error("thresholds must satisfy 0 <= t1 <= t2");
    expert_residency_params params;
    params.budget_bytes = budget_bytes;
    params.io = expert_io_from_name(io);  // std::invalid_argument -> ValueError
    params.io_threads = io_threads;
    params.cache_policy = policy;
    params.cache_weights = weights_from(weights);
    params.precision.use_low = use_low;
    params.precision.use_skip = use_skip;
    params.precision.t1 = t1;
    params.precision.t2 = t2;
    params.low_fraction = low_fraction;
    params.low_serves_high = low_serves_high;
    params.low_from = low_from;
    params.prefetch = prefetch;
    if (prefetch_depth < 1) throw nb::value_error("prefetch_depth must be >= 1");
    params.prefetch_depth = prefetch_depth;
    params.fate_percentile = fate_percentile;
    params.fate_extra = fate_extra;
    m.residency = std::make_unique<expert_residency>(m.model, m.path, params);
}

nb::dict fill_counters(const expert_fill_stats & f) {
    nb::dict d;
    d["experts"] = f.experts;
    d["bytes_read"] = f.bytes_read;
    d["ms"] = f.ms;
    return d;
}

// ranking: per layer, expert ids most routed first (the others follow by id)
nb::dict fill(Model & m, const std::map<int, std::vector<int>> & ranking) {
    if (!m.residency) throw nb::value_error("expert residency is not enabled for this model");
    expert_fill_stats filled;
    {
        nb::gil_scoped_release release;  // seconds of reads for a large cache
        filled = m.residency->fill(ranking);  // std::runtime_error -> RuntimeError
    }
    return fill_counters(filled);
}

const expert_residency & live(const Model & m) {
    if (!m.residency) throw nb::value_error("expert residency is not enabled for this model");
    return *m.residency;
}

nb::dict counters(const expert_layer_stats & s) {
    nb::dict d;
    d["requests"] = s.requests;
    d["hits"] = s.hits;
    d["misses"] = s.misses;
    d["skipped"] = s.skipped;
    d["hits_high"] = s.hits_high;
    d["hits_low"] = s.hits_low;
    d["loads_high"] = s.loads_high;
    d["loads_low"] = s.loads_low;
    d["selections_high"] = s.selections_high;
    d["selections_low"] = s.selections_low;
    d["selections_skip"] = s.selections_skip;
    d["bytes_read"] = s.bytes_read;
    d["load_ms"] = s.load_ms;
    d["stall_ms"] = s.stall_ms;
    return d;
}

nb::dict stats(const Model & m) {
    const expert_residency & r = live(m);
    nb::dict out, per_layer;
    expert_layer_stats total;
    for (const auto & [il, s] : r.layer_stats()) {
        per_layer[nb::str(std::to_string(il).c_str())] = counters(s);
        total.add(s);
    }
    out["total"] = counters(total);
    out["layers"] = per_layer;
    out["resident_experts"] = r.resident_experts();
    out["fill"] = fill_counters(r.fill_stats());
    nb::dict prefetch_layers;
    expert_prefetch_stats prefetch_total;
    for (const auto & [il, p] : r.prefetch_stats()) {
        nb::dict d;
        d["issued"] = p.issued; d["used"] = p.used; d["wasted"] = p.wasted;
        d["bytes_read"] = p.bytes_read; d["load_ms"] = p.load_ms;
        prefetch_layers[nb::str(std::to_string(il).c_str())] = d;
        prefetch_total.issued += p.issued; prefetch_total.used += p.used; prefetch_total.wasted += p.wasted;
        prefetch_total.bytes_read += p.bytes_read; prefetch_total.load_ms += p.load_ms;
    }
    nb::dict prefetch;
    prefetch["issued"] = prefetch_total.issued; prefetch["used"] = prefetch_total.used;
    prefetch["wasted"] = prefetch_total.wasted; prefetch["bytes_read"] = prefetch_total.bytes_read;
    prefetch["load_ms"] = prefetch_total.load_ms;
    prefetch["busy_ms"] = r.prefetch_busy_ms();
    prefetch["layers"] = prefetch_layers;
    out["prefetches"] = prefetch;
    nb::list prediction;
    const auto ps = r.prediction_stats();
    for (size_t d = 0; d < ps.size(); d++) {
        nb::dict p;
        p["depth"] = d + 1;
        p["tokens"] = ps[d].tokens;
        p["top1_accuracy"] = ps[d].tokens ? (double) ps[d].top1_correct / ps[d].tokens : 0.0;
        p["precision"] = ps[d].predicted ? (double) ps[d].overlap / ps[d].predicted : 0.0;
        p["recall"] = ps[d].actual ? (double) ps[d].overlap / ps[d].actual : 0.0;
        prediction.append(p);
    }
    out["prediction"] = prediction;
    return out;
}

nb::dict info(const Model & m) {
    const expert_residency & r = live(m);
    nb::dict d;
    d["budget_bytes"] = r.budget_bytes();
    d["pool_bytes"] = r.pool_bytes(expert_precision::high) + r.pool_bytes(expert_precision::low);
    d["high_pool_bytes"] = r.pool_bytes(expert_precision::high);
    d["low_pool_bytes"] = r.pool_bytes(expert_precision::low);
    d["high_slots"] = r.pool_slots(expert_precision::high);
    d["low_slots"] = r.pool_slots(expert_precision::low);
    d["minimum_bytes"] = r.minimum_bytes();
    d["expert_bytes"] = r.expert_bytes();
    d["low_expert_bytes"] = r.low_expert_bytes();
    d["n_expert"] = r.n_expert();
    d["n_expert_used"] = r.n_expert_used();
    d["n_layers"] = r.n_layers();
    d["max_ubatch_tokens"] = r.max_ubatch_tokens();
    d["io"] = expert_io_name(r.io());
    d["io_threads"] = r.io_threads();
    d["cache_policy"] = r.policy_name();
    d["mixed_precision"] = r.mixed_precision();
    d["skip"] = r.precision().use_skip;
    d["t1"] = r.precision().t1;
    d["t2"] = r.precision().t2;
    d["low_source"] = r.low_source();
    d["prefetch"] = r.prefetch_mode();
    d["prefetch_depth"] = r.prefetch_depth();
    return d;
}

// The routing trace recorded since the last call: numpy arrays ubatch, layer [n], ids, weights [n, k].
nb::dict take_trace(Model & m) {
    if (!m.residency) throw nb::value_error("expert residency is not enabled for this model");
    routing_trace t = m.residency->take_trace();
    const size_t n = t.layer.size(), k = (size_t) m.residency->n_expert_used();
    nb::dict d;
    d["ubatch"] = to_numpy(std::move(t.ubatch), { n });
    d["layer"] = to_numpy(std::move(t.layer), { n });
    d["ids"] = to_numpy(std::move(t.ids), { n, k });
    d["weights"] = to_numpy(std::move(t.weights), { n, k });
    d["predicted"] = to_numpy(std::move(t.predicted), { n, k });
    return d;
}

nb::list placements_to_python(const std::vector<expert_cache::placement> & placed) {
    nb::list out;
    for (const auto & p : placed) out.append(nb::make_tuple(p.expert, expert_precision_name(p.precision), p.slot, p.load));
    return out;
}

// The cache's bookkeeping alone (no memory, no I/O): for unit tests and calibration's trace replay.
struct cache_simulator {
    expert_cache cache;
    explicit cache_simulator(const expert_cache_config & c) : cache(c) {}
};

}  // namespace

void register_residency(nb::module_ & m) {
    nb::exception<expert_load_error>(m, "ExpertLoadError", PyExc_RuntimeError);
    nb::exception<expert_budget_error>(m, "ExpertBudgetError", PyExc_ValueError);

    m.def("choose_precisions", [](const std::vector<float> & w, double t1, double t2, bool use_low, bool use_skip) {
            precision_params p;
            p.t1 = t1; p.t2 = t2; p.use_low = use_low; p.use_skip = use_skip;
            std::vector<expert_precision> out(w.size());
            choose_precisions(w.data(), (int) w.size(), p, out.data());
            std::vector<std::string> names;
            for (auto x : out) names.push_back(expert_precision_name(x));
            return names;
        }, nb::arg("weights"), nb::arg("t1") = 0.6, nb::arg("t2") = 0.9, nb::arg("use_low") = true, nb::arg("use_skip") = true,
        "HOBBIT's demand (high/low/skip) for each of one token's selections, from their routing weights.");

    m.def("predict_layer", [](const std::vector<float> & logits, int k, double t1, double t2, bool use_low,
                              bool use_skip, int fate_extra, double fate_percentile) {
            if (k < 1 || k > (int) logits.size()) throw nb::value_error("k must be between 1 and the number of experts");
            precision_params p;
            p.t1 = t1; p.t2 = t2; p.use_low = use_low; p.use_skip = use_skip;
            std::vector<std::pair<int, std::string>> out;
            for (const auto & e : predict_layer(0, logits.data(), (int) logits.size(), k, p, fate_extra, fate_percentile)) {
                out.emplace_back(e.expert, expert_precision_name(e.precision));
            }
            return out;
        }, nb::arg("logits"), nb::arg("k"), nb::arg("t1") = 0.6, nb::arg("t2") = 0.9, nb::arg("use_low") = true,
        nb::arg("use_skip") = true, nb::arg("fate_extra") = 0, nb::arg("fate_percentile") = 0.75,
        "A layer's predicted experts (expert, precision) from predicted router logits, as the prefetcher sees them.");

    m.def("walk_predictions", [](const std::vector<std::vector<std::pair<int, std::string>>> & layers,
                                 const std::vector<std::pair<int, int>> & cached, bool walk_further) {
            std::vector<std::vector<predicted_expert>> in;
            for (size_t d = 0; d < layers.size(); d++) {
                in.emplace_back();
                for (const auto & [e, p] : layers[d]) in.back().push_back({ (int) d, e, precision_from_name(p) });
            }
            auto is_cached = [&](const predicted_expert & p) {
                return std::find(cached.begin(), cached.end(), std::make_pair(p.layer, p.expert)) != cached.end();
            };
            std::vector<std::pair<int, int>> out;
            for (const auto & p : walk_predictions(in, walk_further, is_cached)) out.emplace_back(p.layer, p.expert);
            return out;
        }, nb::arg("layers"), nb::arg("cached"), nb::arg("walk_further") = true,
        "HOBBIT's walk over predicted (expert, precision) lists per layer ahead, with the cached (depth, expert) "
        "pairs: returns the (depth, expert) pairs walked.");

    nb::class_<cache_simulator>(m, "ExpertCache",
        "The expert cache's bookkeeping without memory or I/O (one pool group): the runtime's own placement "
        "and eviction code, for tests and trace replay.")
        .def("__init__", [](cache_simulator * self, int high_slots, int low_slots, const std::string & policy,
                            const std::vector<float> & weights, bool low_serves_high, int n_layers) {
                 expert_cache_config c;
                 c.high_slots = { high_slots };
                 c.low_slots = { low_slots };
                 c.policy = policy;
                 c.weights = weights_from(weights);
                 c.low_serves_high = low_serves_high;
                 c.n_layers = n_layers;
                 new (self) cache_simulator(c);
             }, nb::arg("high_slots"), nb::arg("low_slots") = 0, nb::arg("policy") = "lru",
             nb::arg("weights") = std::vector<float>{0.25f, 0.25f, 0.25f, 0.25f}, nb::arg("low_serves_high") = true,
             nb::arg("n_layers") = 1)
        .def("place", [](cache_simulator & s, int layer, const std::vector<std::pair<int, std::string>> & wanted) {
                 std::vector<std::pair<int, expert_precision>> w;
                 for (const auto & [e, p] : wanted) w.emplace_back(e, precision_from_name(p));
                 return placements_to_python(s.cache.place(0, layer, w));
             }, nb::arg("layer"), nb::arg("wanted"),
             "Serves (expert, demand) pairs of one layer; returns (expert, precision, slot, load) per pair.")
        .def("advance_tokens", [](cache_simulator & s, uint64_t n) { s.cache.advance_tokens(n); })
        .def("start_sequence", [](cache_simulator & s) { s.cache.start_sequence(); })
        .def("cached", [](const cache_simulator & s, int layer, int expert, const std::string & precision) {
                 return s.cache.tier(0, precision_from_name(precision)).find(make_expert_key(layer, expert)) >= 0;
             });
}

void add_residency_methods(nb::class_<Model> & cls) {
    cls.def("enable_expert_residency", &enable, nb::arg("budget_bytes"), nb::arg("io") = "direct",
            nb::arg("io_threads") = 1, nb::arg("cache_policy") = "lru",
            nb::arg("policy_weights") = std::vector<float>{0.25f, 0.25f, 0.25f, 0.25f},
            nb::arg("use_low") = false, nb::arg("use_skip") = false, nb::arg("t1") = 0.6, nb::arg("t2") = 0.9,
            nb::arg("low_fraction") = 0.25, nb::arg("low_serves_high") = true, nb::arg("low_from") = "",
            nb::arg("prefetch") = "none", nb::arg("prefetch_depth") = 2, nb::arg("fate_percentile") = 0.75,
            nb::arg("fate_extra") = -1,
            "Serve the experts from a cache of budget_bytes (the model must be loaded with experts_on_demand).")
       .def("fill_expert_cache", &fill, nb::arg("ranking") = std::map<int, std::vector<int>>{},
            "Reads experts into the cache's free slots before the first token (ranking: per layer, "
            "expert ids most routed first).")
       .def("expert_stats", &stats, "Per-layer and total expert cache counters.")
       .def("expert_residency_info", &info, "Budget, pool bytes, minimum, io mode, policy, precision, ubatch cap.")
       .def("reset_expert_stats", [](Model & mm) { if (mm.residency) mm.residency->reset_stats(); })
       .def("set_expert_tracing", [](Model & mm, bool on) { if (mm.residency) mm.residency->set_tracing(on); })
       .def("take_expert_trace", &take_trace, "The routing trace recorded since the last call.")
       .def_prop_ro("expert_residency_enabled", [](const Model & mm) { return (bool) mm.residency; });
}

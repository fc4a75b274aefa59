// Expert residency: turn on the byte-budgeted expert cache of a Model loaded with
// experts_on_demand, read its statistics, and report load errors after a decode. The options
// are one object, ExpertOptions, bound field by field from EDGEMOE_EXPERT_OPTIONS.
#include "native.h"

#include "llama.h"
#include "../src/expert-residency.h"

#include <nanobind/ndarray.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <type_traits>
#include <vector>

std::string take_residency_error(Context & c) {
    if (!c.model || !c.model->residency) return "";
    std::string err = c.model->residency->take_error();
    if (!err.empty()) llama_memory_clear(llama_get_memory(c.ctx), true);
    return err;
}

namespace {

template <typename E>
void bind_enum(nb::module_ & m, const char * name) {
    nb::enum_<E> e(m, name);
    for (size_t v = 0; v < enum_names<E>::values.size(); v++) e.value(enum_names<E>::values[v], (E) v);
}

void enable(Model & m, uint64_t budget_bytes, const expert_options & options, bool trace_routing, uint64_t host_cache_bytes,
            int n_threads) {
    if (!m.experts_on_demand) throw nb::value_error("the model was not loaded with experts_on_demand=True");
    if (m.residency) throw nb::value_error("expert residency is already enabled for this model");
    // std::invalid_argument (bad options, expert_budget_error) -> ValueError / ExpertBudgetError
    const expert_device_config device = { m.devices, host_cache_bytes, n_threads, m.repack };
    m.residency = std::make_unique<expert_residency>(m.model, m.path, budget_bytes, options, trace_routing, device);
}

nb::dict fill_counters(const expert_fill_stats & f) {
    nb::dict d;
    d["experts"] = f.experts;
    d["bytes_read"] = f.bytes_read;
    d["ms"] = f.ms;
    return d;
}

const expert_residency & live(const Model & m) {
    if (!m.residency) throw nb::value_error("expert residency is not enabled for this model");
    return *m.residency;
}

// a fill's counters; it runs without the GIL (seconds of reads for a large cache), and Ctrl-C stops
// it (Python's handler runs between chunks and sets KeyboardInterrupt)
nb::dict interruptible_fill(const std::function<expert_fill_stats(const std::function<bool()> &)> & fill) {
    expert_fill_stats filled;
    try {
        gil_released release;
        filled = fill([] {
            nb::gil_scoped_acquire acquire;
            return PyErr_CheckSignals() != 0;
        });  // std::runtime_error -> RuntimeError
    } catch (const fill_interrupted &) {
        throw nb::python_error();  // the KeyboardInterrupt
    }
    return fill_counters(filled);
}

// ranking: per layer, expert ids most routed first (the others follow by id)
nb::dict fill(Model & m, const std::map<int, std::vector<int>> & ranking) {
    live(m);
    return interruptible_fill([&](const std::function<bool()> & interrupted) { return m.residency->fill(ranking, interrupted); });
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
    d["bytes_read_low"] = s.bytes_read_low;
    d["load_ms"] = s.load_ms;
    d["stall_ms"] = s.stall_ms;
    d["op_ms"] = s.op_ms;
    d["host_hits"] = s.host_hits;
    d["host_loads"] = s.host_loads;
    d["uploads"] = s.uploads;
    d["bytes_uploaded"] = s.bytes_uploaded;
    d["upload_ms"] = s.upload_ms;
    d["upload_wait_ms"] = s.upload_wait_ms;
    d["queue_ms"] = s.queue_ms;
    d["cpu_pass_ms"] = s.cpu_pass_ms;
    d["cpu_experts"] = s.cpu_experts;
    d["stand_in_swaps"] = s.stand_in_swaps;
    d["stand_in_drops"] = s.stand_in_drops;
    return d;
}

nb::dict prefetch_counters(const expert_prefetch_stats & p) {
    nb::dict d;
    d["issued"] = p.issued; d["used"] = p.used; d["wasted"] = p.wasted;
    d["late"] = p.late; d["displaced"] = p.displaced; d["declined"] = p.declined; d["given_back"] = p.given_back;
    d["bytes_read"] = p.bytes_read; d["bytes_read_low"] = p.bytes_read_low; d["load_ms"] = p.load_ms;
    d["bytes_uploaded"] = p.bytes_uploaded; d["upload_ms"] = p.upload_ms;
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
    out["link_share"] = r.link_share();
    out["fill"] = fill_counters(r.fill_stats());
    nb::dict prefetch_layers;
    expert_prefetch_stats prefetch_total;
    for (const auto & [il, p] : r.prefetch_stats()) {
        prefetch_layers[nb::str(std::to_string(il).c_str())] = prefetch_counters(p);
        prefetch_total.issued += p.issued; prefetch_total.used += p.used; prefetch_total.wasted += p.wasted;
        prefetch_total.late += p.late; prefetch_total.displaced += p.displaced; prefetch_total.declined += p.declined;
        prefetch_total.given_back += p.given_back;
        prefetch_total.bytes_read += p.bytes_read; prefetch_total.bytes_read_low += p.bytes_read_low;
        prefetch_total.load_ms += p.load_ms;
        prefetch_total.bytes_uploaded += p.bytes_uploaded; prefetch_total.upload_ms += p.upload_ms;
    }
    nb::dict prefetch = prefetch_counters(prefetch_total);
    prefetch["busy_ms"] = r.prefetch_busy_ms();
    prefetch["stopped"] = r.decode_prefetch() == prefetch_phase::stopped;
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

// an option's value for Python: an enum by its name
template <typename T>
nb::object option_value(const T & v) {
    if constexpr (std::is_enum_v<T>) return nb::str(name_of(v)); else return nb::cast(v);
}

// What the cache is (budget, pools, model) and the options in effect (by their names).
nb::dict info(const Model & m) {
    const expert_residency & r = live(m);
    const expert_residency_info & i = r.info();
    nb::dict d;
    d["budget_bytes"] = i.budget_bytes;
    d["pool_bytes"] = i.high_pool_bytes + i.low_pool_bytes;
    d["high_pool_bytes"] = i.high_pool_bytes;
    d["low_pool_bytes"] = i.low_pool_bytes;
    d["high_slots"] = i.high_slots;
    d["low_slots"] = i.low_slots;
    d["minimum_bytes"] = i.minimum_bytes;
    d["expert_bytes"] = i.expert_bytes;
    d["low_expert_bytes"] = i.low_expert_bytes;
    d["n_expert"] = i.n_expert;
    d["n_expert_used"] = i.n_expert_used;
    d["n_layers"] = i.n_layers;
    d["max_ubatch_tokens"] = i.max_ubatch_tokens;
    d["mixed_precision"] = i.mixed_precision;
    d["low_source"] = i.low_source;
    d["predictor_depth"] = i.predictor_depth;
    std::string devices;  // "A,B"
    nb::dict pool_bytes;
    for (const auto & [name, bytes] : i.device_pool_bytes) {
        devices += (devices.empty() ? "" : ",") + name;
        pool_bytes[name.c_str()] = bytes;
    }
    d["device"] = devices;
    d["device_pool_bytes"] = pool_bytes;
    d["host_pool_bytes"] = i.host_pool_bytes;
    d["host_high_slots"] = i.host_high_slots;
    d["host_low_slots"] = i.host_low_slots;
    d["mode_reason"] = i.mode_reason;
    const expert_options & o = r.options();
#define EDGEMOE_OPTION_TO_DICT(type, name, default_value, help) d[#name] = option_value(o.name);
    EDGEMOE_EXPERT_OPTIONS(EDGEMOE_OPTION_TO_DICT)
#undef EDGEMOE_OPTION_TO_DICT
    d["io"] = name_of(i.io);  // in effect
    return d;
}

// The routing trace recorded since the last call: numpy arrays ubatch, layer [n], ids, weights [n, k].
nb::dict take_trace(Model & m) {
    live(m);
    routing_trace t = m.residency->take_trace();
    const size_t n = t.layer.size(), k = (size_t) m.residency->info().n_expert_used;
    nb::dict d;
    d["ubatch"] = to_numpy(std::move(t.ubatch), { n });
    d["layer"] = to_numpy(std::move(t.layer), { n });
    d["ids"] = to_numpy(std::move(t.ids), { n, k });
    d["weights"] = to_numpy(std::move(t.weights), { n, k });
    d["predicted"] = to_numpy(std::move(t.predicted), { n, k });
    if (!t.inputs.empty()) d["inputs"] = to_numpy(std::move(t.inputs), { n, (size_t) t.input_width });
    return d;
}

}  // namespace

void register_residency(nb::module_ & m) {
    nb::exception<expert_load_error>(m, "ExpertLoadError", PyExc_RuntimeError);
    nb::exception<expert_budget_error>(m, "ExpertBudgetError", PyExc_ValueError);

    bind_enum<expert_io>(m, "ExpertIO");
    bind_enum<cache_policy_kind>(m, "CachePolicy");
    bind_enum<prefetch_mode>(m, "Prefetch");
    bind_enum<low_hit_rule>(m, "LowHit");
    bind_enum<compute_mode>(m, "ComputeMode");

    nb::class_<expert_options> options(m, "ExpertOptions",
        "The expert cache's options; a default-constructed one holds every default.");
    options.def(nb::init<>());
#define EDGEMOE_BIND_OPTION(type, name, default_value, help) options.def_rw(#name, &expert_options::name, help);
    EDGEMOE_EXPERT_OPTIONS(EDGEMOE_BIND_OPTION)
#undef EDGEMOE_BIND_OPTION
#define EDGEMOE_OPTION_NAME(type, name, default_value, help) #name,
    options.def_prop_ro_static("names", [](nb::handle) {
        return std::vector<std::string>{ EDGEMOE_EXPERT_OPTIONS(EDGEMOE_OPTION_NAME) };
    }, "The options' names, in declaration order.");
#undef EDGEMOE_OPTION_NAME
    options.def_prop_ro("lossy", &expert_options::lossy,
        "LOW copies, skips or cache routing on: what a token computes depends on what the cache holds.");
    options.def("check", &check_expert_options, "Raises ValueError naming the first option out of its range.");

    register_policies(m);
}

void add_residency_methods(nb::class_<Model> & cls) {
    cls.def("enable_expert_residency", &enable, nb::arg("budget_bytes"), nb::arg("options"),
            nb::arg("trace_routing") = false, nb::arg("host_cache_bytes") = 0, nb::arg("n_threads") = 1,
            "Serve the experts from a cache of budget_bytes (the model must be loaded with experts_on_demand); "
            "on a device (the model's), with a host tier of host_cache_bytes.")
       .def("fill_host_tier", [](Model & mm) {
                live(mm);
                return interruptible_fill([&](const std::function<bool()> & interrupted) { return mm.residency->fill_host(interrupted); });
            }, "Reads every expert copy into a host tier that holds them all (else nothing) before the first "
            "token: {experts, bytes_read, ms}.")
       .def("fill_expert_cache", &fill, nb::arg("ranking") = std::map<int, std::vector<int>>{},
            "Reads experts into the cache's free slots before the first token (ranking: per layer, "
            "expert ids most routed first).")
       .def("fill_expert_cache_in_background",
            [](Model & mm, const std::map<int, std::vector<int>> & ranking) { live(mm); mm.residency->fill_in_background(ranking); },
            nb::arg("ranking") = std::map<int, std::vector<int>>{},
            "Starts the same fill in the background: it reads as the layers of the next tokens run.")
       .def("expert_stats", &stats, "Per-layer and total expert cache counters.")
       .def("expert_residency_info", &info, "Budget, pool bytes, minimum, ubatch cap, and the options in effect.")
       .def("expert_prefetch_phase", [](const Model & mm) {
                static const char * names[] = { "reading", "held", "stopped" };
                return mm.residency ? names[(int) mm.residency->decode_prefetch()] : "stopped";
            }, "Decode prefetching: reading, held (its trial's windows without it) or stopped for good.")
       .def("reset_expert_stats", [](Model & mm) { if (mm.residency) mm.residency->reset_stats(); })
       .def("set_expert_tracing", [](Model & mm, bool on, bool inputs) { if (mm.residency) mm.residency->set_tracing(on, inputs); },
            nb::arg("on"), nb::arg("inputs") = false, "Records the routing (and each MoE layer's input: inputs) from now on.")
       .def("take_expert_trace", &take_trace, "The routing trace recorded since the last call.")
       .def("set_expert_precision_map", [](Model & mm, const std::map<int, std::vector<int>> & low) {
                live(mm);
                mm.residency->set_precision_map(low);
            }, nb::arg("low"),
            "EdgeMoE's static map: the experts listed ({layer: [expert, ...]}) only in LOW, the others only in HIGH "
            "(with the static_precision option). Empties the cache.")
       .def("set_expert_stand_ins", [](Model & mm, const std::map<int, stand_in_costs> & layers) {
                live(mm);
                mm.residency->set_stand_ins(layers);
            }, nb::arg("layers"),
            "The calibrated stand-ins for stand_in: {layer: (costs, n_expert x n_expert row-major, drop costs, n_expert "
            "or none, tau)}.")
       .def("set_expert_path_statistics", [](Model & mm, const std::vector<expert_residency::path_entry> & entries) {
                live(mm);
                mm.residency->set_path_statistics(entries);
            }, nb::arg("entries"),
            "EdgeMoE's path statistics for prefetch edgemoe: (layer, prev2, prev1, probabilities) entries.")
       .def("set_expert_little", [](Model & mm, bool on) { live(mm); mm.residency->set_little(on); }, nb::arg("on"),
            "MoBiLE: while on, decode tokens compute only their top-k/2 experts.")
       .def("prefetch_expert_big", [](Model & mm) { live(mm); return mm.residency->prefetch_big(); },
            "MoBiLE's fallback: prefetches the last little token's whole top-k in every layer; returns how many.")
       .def_prop_ro("expert_residency_enabled", [](const Model & mm) { return (bool) mm.residency; });
}

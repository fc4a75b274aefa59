// Expert residency: turn on the byte-budgeted expert cache of a Model loaded with
// experts_on_demand, read its statistics, and report load errors after a decode.
#include "native.h"

#include "llama.h"
#include "../src/expert-residency.h"

#include <nanobind/stl/string.h>

std::string take_residency_error(Context & c) {
    if (!c.model || !c.model->residency) return "";
    std::string err = c.model->residency->take_error();
    if (!err.empty()) llama_memory_clear(llama_get_memory(c.ctx), true);
    return err;
}

namespace {

void enable(Model & m, uint64_t budget_bytes, const std::string & io, int io_threads, const std::string & policy) {
    if (!m.experts_on_demand) throw nb::value_error("the model was not loaded with experts_on_demand=True");
    if (m.residency) throw nb::value_error("expert residency is already enabled for this model");
    if (io_threads < 1) throw nb::value_error("io_threads must be >= 1");
    expert_residency_params params;
    params.budget_bytes = budget_bytes;
    params.io = expert_io_from_name(io);  // std::invalid_argument -> ValueError
    params.io_threads = io_threads;
    params.cache_policy = policy;
    m.residency = std::make_unique<expert_residency>(m.model, m.path, params);
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
    return out;
}

nb::dict info(const Model & m) {
    const expert_residency & r = live(m);
    nb::dict d;
    d["budget_bytes"] = r.budget_bytes();
    d["pool_bytes"] = r.pool_bytes();
    d["minimum_bytes"] = r.minimum_bytes();
    d["expert_bytes"] = r.expert_bytes();
    d["n_expert"] = r.n_expert();
    d["n_expert_used"] = r.n_expert_used();
    d["max_ubatch_tokens"] = r.max_ubatch_tokens();
    d["io"] = expert_io_name(r.io());
    d["io_threads"] = r.io_threads();
    d["cache_policy"] = r.policy_name();
    return d;
}

}  // namespace

void register_residency(nb::module_ & m) {
    nb::exception<expert_load_error>(m, "ExpertLoadError", PyExc_RuntimeError);
    nb::exception<expert_budget_error>(m, "ExpertBudgetError", PyExc_ValueError);
}

void add_residency_methods(nb::class_<Model> & cls) {
    cls.def("enable_expert_residency", &enable, nb::arg("budget_bytes"), nb::arg("io") = "direct",
            nb::arg("io_threads") = 1, nb::arg("cache_policy") = "lru",
            "Serve the experts from a cache of budget_bytes (the model must be loaded with experts_on_demand).")
       .def("expert_stats", &stats, "Per-layer and total expert cache counters.")
       .def("expert_residency_info", &info, "Budget, pool bytes, minimum, io mode, policy, ubatch cap.")
       .def("reset_expert_stats", [](Model & mm) { if (mm.residency) mm.residency->reset_stats(); })
       .def_prop_ro("expert_residency_enabled", [](const Model & mm) { return (bool) mm.residency; });
}

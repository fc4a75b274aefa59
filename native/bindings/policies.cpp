// The residency layer's pure policies, bound for calibration and tests: the precision rule, the
// layer planner, cache-aware routing, the predictor's decisions, the expert cache's bookkeeping,
// prefetching's meter and ledger, and split's link balance (no memory, no I/O).
// Calibration replays routing traces through these, so it computes exactly what the runtime does.
#include "native.h"

#include "../src/cache-routing.h"
#include "../src/cache-standin.h"
#include "../src/expert-cache.h"
#include "../src/expert-options.h"
#include "../src/layer-planner.h"
#include "../src/link-balance.h"
#include "../src/predictor.h"
#include "../src/prefetch-ledger.h"
#include "../src/prefetch-meter.h"

#include <nanobind/ndarray.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <vector>

namespace {

using routing_ids = nb::ndarray<const int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using routing_weights = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

expert_precision precision_from_name(const std::string & name) {
    if (name == "high") return expert_precision::high;
    if (name == "low") return expert_precision::low;
    if (name == "skip") return expert_precision::skip;
    throw nb::value_error(("unknown precision '" + name + "' (high, low, skip)").c_str());
}

// scores [n, k] (float64) of each token's selections, from routing weights [n, k]
nb::ndarray<nb::numpy, double> scores_of(routing_weights weights) {
    const size_t n = weights.shape(0), k = weights.shape(1);
    std::vector<double> out(n * k);
    for (size_t t = 0; t < n; t++) selection_scores(weights.data() + t * k, (int) k, out.data() + t * k);
    return to_numpy(std::move(out), { n, k });
}

// each selection's demand (int8 [n, k]: 2 HIGH, 1 LOW, 0 SKIP) from routing weights [n, k]
nb::ndarray<nb::numpy, int8_t> demands_of(routing_weights weights, double t1, double t2, bool use_low, bool use_skip) {
    const size_t n = weights.shape(0), k = weights.shape(1);
    std::vector<expert_precision> demand(n * k);
    for (size_t t = 0; t < n; t++) {
        choose_precisions(weights.data() + t * k, (int) k, { t1, t2, use_low, use_skip }, demand.data() + t * k);
    }
    std::vector<int8_t> out(demand.size());
    std::transform(demand.begin(), demand.end(), out.begin(), [](expert_precision d) { return (int8_t) d; });
    return to_numpy(std::move(out), { n, k });
}

// One layer of one ubatch as the runtime plans it, in one wave: (demands [n, k] as int8 2 HIGH /
// 1 LOW / 0 SKIP, [(expert, demand name)] of the distinct experts in order of first use).
nb::tuple plan(routing_ids ids, routing_weights weights, int n_expert, double t1, double t2, bool use_low, bool use_skip,
               const std::vector<std::string> & fixed, double prefill_low_share, int keep) {
    if (ids.shape(0) != weights.shape(0) || ids.shape(1) != weights.shape(1)) throw nb::value_error("ids and weights differ in shape");
    if (!fixed.empty() && (int) fixed.size() != n_expert) throw nb::value_error("fixed needs one precision per expert");
    const int64_t n = (int64_t) ids.shape(0);
    const int k = (int) ids.shape(1);
    std::vector<expert_precision> fixed_precision;
    for (const auto & name : fixed) fixed_precision.push_back(precision_from_name(name));
    plan_rules rules;
    rules.precision = { t1, t2, use_low, use_skip };
    rules.fixed = fixed_precision.empty() ? nullptr : fixed_precision.data();
    rules.prefill_low_share = prefill_low_share;
    rules.keep = keep;
    const layer_plan p = plan_layer(ids.data(), weights.data(), n, k, n_expert, rules, 1, 0,
                                    [](int, expert_precision) { return false; });
    if (!p.error.empty()) throw nb::value_error(p.error.c_str());
    std::vector<int8_t> demand(p.demand.size());
    std::transform(p.demand.begin(), p.demand.end(), demand.begin(), [](expert_precision d) { return (int8_t) d; });
    std::vector<std::pair<int, std::string>> wanted;
    for (const auto & [e, d] : p.waves[0]) wanted.emplace_back(e, expert_precision_name(d));
    return nb::make_tuple(to_numpy(std::move(demand), { (size_t) n, (size_t) k }), wanted);
}

// Cache-aware routing of one layer (ids int32 [n, k], weights float32 [n, k], probs float32
// [n, n_expert]) with the experts `cached` held: (ids, weights, each selection's scale), as the runtime routes.
nb::tuple cache_routing(routing_ids ids, routing_weights weights, routing_weights probs, const std::vector<int> & cached,
                        double lambda, bool normalized) {
    const size_t n = ids.shape(0), k = ids.shape(1), n_expert = probs.shape(1);
    if (weights.shape(0) != n || weights.shape(1) != k || probs.shape(0) != n) throw nb::value_error("ids, weights and probs differ in tokens");
    std::vector<int32_t> out_ids(ids.data(), ids.data() + n * k);
    std::vector<float> out_weights(weights.data(), weights.data() + n * k);
    std::vector<float> scale = route_to_cache(out_ids.data(), out_weights.data(), (int64_t) n, (int) k, probs.data(), (int) n_expert,
                                              lambda, normalized, [&](int e) { return std::find(cached.begin(), cached.end(), e) != cached.end(); });
    return nb::make_tuple(to_numpy(std::move(out_ids), { n, k }), to_numpy(std::move(out_weights), { n, k }),
                          to_numpy(std::move(scale), { n, k }));
}

// The calibrated stand-ins of one layer (ids int32 [n, k], weights float32 [n, k], cost float32
// [n_expert, n_expert], drop costs) with the experts `cached` held: (ids, dropped, changed), as the
// runtime routes.
nb::tuple stand_ins_of(routing_ids ids, routing_weights weights, routing_weights cost, double tau, const std::vector<int> & cached,
                       const std::vector<float> & drop) {
    const size_t n = ids.shape(0), k = ids.shape(1), n_expert = cost.shape(0);
    if (weights.shape(0) != n || weights.shape(1) != k) throw nb::value_error("ids and weights differ in shape");
    if (cost.shape(1) != n_expert) throw nb::value_error("cost must be n_expert x n_expert");
    std::vector<int32_t> out_ids(ids.data(), ids.data() + n * k);
    if (!drop.empty() && drop.size() != n_expert) throw nb::value_error("drop must have n_expert costs");
    std::vector<uint8_t> dropped(n * k, 0);
    const stand_in_table table = { (int) n_expert, std::vector<float>(cost.data(), cost.data() + n_expert * n_expert), drop, tau };
    const int changed = stand_in(out_ids.data(), dropped.data(), weights.data(), (int64_t) n, (int) k, table,
                                 [&](int e) { return std::find(cached.begin(), cached.end(), e) != cached.end(); });
    return nb::make_tuple(to_numpy(std::move(out_ids), { n, k }), to_numpy(std::move(dropped), { n, k }), changed);
}

nb::list placements_to_python(const std::vector<expert_cache::placement> & placed) {
    nb::list out;
    for (const auto & p : placed) out.append(nb::make_tuple(p.expert, expert_precision_name(p.precision), p.slot, p.load));
    return out;
}

// A prefetch_ledger beside the expert cache it follows, placing and reading ahead as the
// prefetch coordinator does (one pool group).
struct ledger_harness {
    ledger_harness(expert_cache & c, double low_cost) : cache(c), ledger(c, low_cost) {}
    expert_cache & cache;
    prefetch_ledger ledger;
};

}  // namespace

void register_policies(nb::module_ & m) {
    m.def("choose_precisions", [](const std::vector<float> & w, double t1, double t2, bool use_low, bool use_skip) {
            std::vector<expert_precision> out(w.size());
            choose_precisions(w.data(), (int) w.size(), { t1, t2, use_low, use_skip }, out.data());
            std::vector<std::string> names;
            for (auto x : out) names.push_back(expert_precision_name(x));
            return names;
        }, nb::arg("weights"), nb::arg("t1") = expert_options().t1, nb::arg("t2") = expert_options().t2,
        nb::arg("use_low") = true, nb::arg("use_skip") = true,
        "HOBBIT's demand (high/low/skip) for each of one token's selections, from their routing weights.");

    m.def("selection_scores", &scores_of, nb::arg("weights"),
          "HOBBIT's score s_i of each selection (float64 [n, k]) from routing weights (float32 [n, k]), as the runtime computes it.");

    m.def("precision_demands", &demands_of, nb::arg("weights"), nb::arg("t1") = expert_options().t1,
          nb::arg("t2") = expert_options().t2, nb::arg("use_low") = true, nb::arg("use_skip") = true,
          "Each selection's demand (int8 [n, k]: 2 high, 1 low, 0 skip) from routing weights (float32 [n, k]).");

    m.def("plan_layer", &plan, nb::arg("ids"), nb::arg("weights"), nb::arg("n_expert"), nb::arg("t1") = expert_options().t1,
          nb::arg("t2") = expert_options().t2,
          nb::arg("use_low") = true, nb::arg("use_skip") = true, nb::arg("fixed") = std::vector<std::string>(),
          nb::arg("prefill_low_share") = 0.0, nb::arg("keep") = 0,
          "The runtime's plan of one layer of one ubatch (ids int32 [n, k], weights float32 [n, k]): each "
          "selection's demand (int8 [n, k]: 2 high, 1 low, 0 skip) and the distinct experts with their demand. "
          "fixed: EdgeMoE's map (a precision name per expert); prefill_low_share: Fate's prefill rule; keep: "
          "MoBiLE's little pass (each token's heaviest selections kept; the others skip and are not wanted).");

    m.def("stand_in", &stand_ins_of, nb::arg("ids"), nb::arg("weights"), nb::arg("cost"), nb::arg("tau"), nb::arg("cached"),
          nb::arg("drop") = std::vector<float>(),
          "Cache-aware routing by calibrated stand-ins of one layer: ids int32 [n, k], the graph's weights float32 [n, k], "
          "cost float32 [n_expert, n_expert] and the bound tau, with the experts `cached` held; drop: the drop costs "
          "(n_expert; none: no selection is dropped). Returns (ids, dropped uint8 [n, k], selections changed).");

    m.def("route_to_cache", &cache_routing, nb::arg("ids"), nb::arg("weights"), nb::arg("probs"), nb::arg("cached"),
          nb::arg("cache_routing"), nb::arg("normalized") = true,
          "Cache-aware routing (Cache-Prior, arXiv 2412.00099) of one layer: ids int32 [n, k], the graph's weights float32 "
          "[n, k] and the router's probabilities float32 [n, n_expert], with the experts `cached` held and bonus "
          "cache_routing (lambda); normalized: the model normalizes its top-k weights. Returns (ids, weights, scale), "
          "scale each selection's weight over the graph's.");

    m.def("predict_layer", [](const std::vector<float> & logits, int k, double t1, double t2, bool use_low,
                              bool use_skip, int fate_extra, double fate_percentile) {
            if (k < 1 || k > (int) logits.size()) throw nb::value_error("k must be between 1 and the number of experts");
            std::vector<std::pair<int, std::string>> out;
            for (const auto & e : predict_layer(0, logits.data(), (int) logits.size(), k, { t1, t2, use_low, use_skip },
                                                fate_extra, fate_percentile)) {
                out.emplace_back(e.expert, expert_precision_name(e.precision));
            }
            return out;
        }, nb::arg("logits"), nb::arg("k"), nb::arg("t1") = expert_options().t1, nb::arg("t2") = expert_options().t2,
        nb::arg("use_low") = true, nb::arg("use_skip") = true, nb::arg("fate_extra") = 0,
        nb::arg("fate_percentile") = expert_options().fate_percentile,
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

    nb::class_<expert_cache>(m, "ExpertCache",
        "The expert cache's bookkeeping without memory or I/O (one pool group): the runtime's own placement "
        "and eviction code, for tests and trace replay.")
        .def("__init__", [](expert_cache * self, int high_slots, int low_slots, const std::string & policy,
                            const hobbit_weights & weights, bool low_serves_high, int n_layers, std::vector<int> layers,
                            int n_expert, int fate_shallow, int n_expert_used) {
                 if (layers.empty()) for (int il = 0; il < n_layers; il++) layers.push_back(il);
                 new (self) expert_cache({ { high_slots }, { low_slots }, enum_from_name<cache_policy_kind>(policy), weights,
                                           low_serves_high, n_layers, { layers }, n_expert, fate_shallow, n_expert_used });
             }, nb::arg("high_slots"), nb::arg("low_slots") = 0, nb::arg("policy") = name_of(expert_options().cache_policy),
             nb::arg("weights") = expert_options().policy_weights,
             nb::arg("low_serves_high") = expert_options().low_hit == low_hit_rule::accept, nb::arg("n_layers") = 1,
             nb::arg("layers") = std::vector<int>(), nb::arg("n_expert") = 0, nb::arg("fate_shallow") = expert_options().fate_shallow,
             nb::arg("n_expert_used") = 0,
             "layers: the MoE layers (default 0 .. n_layers - 1), n_expert and n_expert_used: experts per layer and per "
             "token, for the fate policy's split.")
        .def("place", [](expert_cache & c, int layer, const std::vector<std::pair<int, std::string>> & wanted) {
                 std::vector<expert_demand> w;
                 for (const auto & [e, p] : wanted) w.emplace_back(e, precision_from_name(p));
                 return placements_to_python(c.place(0, layer, w));
             }, nb::arg("layer"), nb::arg("wanted"),
             "Serves (expert, demand) pairs of one layer; returns (expert, precision, slot, load) per pair.")
        .def("advance_tokens", [](expert_cache & c, uint64_t n) { c.advance_tokens(n); })
        .def("start_sequence", [](expert_cache & c) { c.start_sequence(); })
        .def("cached", [](const expert_cache & c, int layer, int expert, const std::string & precision) {
                 return c.tier(0, precision_from_name(precision)).find(make_expert_key(layer, expert)) >= 0;
             });

    m.def("shallow_favoring_split", [](int n_slots, const std::vector<int> & layers, int n_expert, int n_shallow, int n_expert_used) {
              return shallow_favoring_split({ n_slots, layers, n_expert, n_shallow, n_expert_used });
          }, nb::arg("n_slots"), nb::arg("layers"), nb::arg("n_expert"), nb::arg("n_shallow") = expert_options().fate_shallow,
          nb::arg("n_expert_used") = 0,
          "Fate's split of a tier's slots over its layers (shallow ones first): slots per layer.");

    nb::class_<link_balance>(m, "LinkBalance",
                             "Split's share of a decode token's misses uploaded, refined by each decode layer's times "
                             "(native/src/link-balance.h).")
        .def(nb::init<double, bool>(), nb::arg("share"), nb::arg("adapts"))
        .def("divided", &link_balance::divided, nb::arg("uploaded"), nb::arg("on_cpu"))
        .def("arrived", &link_balance::arrived, nb::arg("cpu_ms"), nb::arg("wait_ms"))
        .def_prop_ro("share", &link_balance::share);

    nb::class_<prefetch_meter>(m, "PrefetchMeter",
                               "What decode prefetching saves and costs per rank, and whether a rank is worth reading "
                               "(native/src/prefetch-meter.h); experts as (layer, expert).")
        .def(nb::init<size_t>(), nb::arg("ghost_slots"))
        .def("issued", [](prefetch_meter & m, int rank, std::optional<std::pair<int, int>> displaced) {
                 m.issued(rank, displaced.has_value(), displaced ? make_expert_key(displaced->first, displaced->second) : 0);
             }, nb::arg("rank"), nb::arg("displaced") = nb::none())
        .def("used", &prefetch_meter::used, nb::arg("rank"), nb::arg("ahead"))
        .def("wasted", &prefetch_meter::wasted, nb::arg("rank"))
        .def("demanded", [](prefetch_meter & m, int layer, int expert, bool missed) {
                 return m.demanded(make_expert_key(layer, expert), missed);
             }, nb::arg("layer"), nb::arg("expert"), nb::arg("missed"))
        .def("evicted", &prefetch_meter::evicted)
        .def("worth", &prefetch_meter::worth, nb::arg("rank"))
        .def("useless", &prefetch_meter::useless);

    nb::class_<ledger_harness>(m, "PrefetchLedger",
                               "Whether decode prefetching read more than the same run without it, beside an ExpertCache "
                               "(native/src/prefetch-ledger.h).")
        .def(nb::init<expert_cache &, double>(), nb::arg("cache"), nb::arg("low_cost"), nb::keep_alive<1, 2>())
        .def("place", [](ledger_harness & h, int layer, const std::vector<std::pair<int, std::string>> & wanted) {
                 std::vector<expert_demand> w;
                 for (const auto & [e, p] : wanted) w.emplace_back(e, precision_from_name(p));
                 const auto placed = h.cache.place(0, layer, w);
                 h.ledger.placed(0, layer, w, placed);
                 return placements_to_python(placed);
             }, nb::arg("layer"), nb::arg("wanted"), "ExpertCache.place, followed by the ledger's shadow.")
        .def("guess", [](ledger_harness & h, int layer, int expert, const std::string & precision) {
                 const expert_precision p = precision_from_name(precision);
                 const bool read = h.cache.reserve(0, layer, expert, p).load;
                 if (read) h.ledger.guessed(layer, p);
                 return read;
             }, nb::arg("layer"), nb::arg("expert"), nb::arg("precision") = "high", "A judged guess read ahead (true) if not cached.")
        .def("read_ahead", [](ledger_harness & h, int layer, int expert, const std::string & precision) {
                 const expert_precision p = precision_from_name(precision);
                 const bool read = h.cache.reserve(0, layer, expert, p).load;
                 h.ledger.mirrored(0, layer, expert, p, /*evict*/ true, read);
                 return read;
             }, nb::arg("layer"), nb::arg("expert"), nb::arg("precision") = "high",
             "A read the run makes without decode prefetching too (a prefill's read-ahead).")
        .def_prop_ro("costs", [](const ledger_harness & h) { return h.ledger.costs(); });
}

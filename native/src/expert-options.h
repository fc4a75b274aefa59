// The expert-residency layer's options, each declared once in EDGEMOE_EXPERT_OPTIONS: type, name,
// default and help. The struct, the binding (pyedgemoe._native.ExpertOptions), the Engine's
// keyword arguments and the CLI's flags (--name-with-dashes) are all made from that list, so an
// option is added with one line here and the code that uses it (docs/architecture.md).
#pragma once

#include "precision-policy.h"

#include <array>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

enum class expert_io         { direct, buffered, mmap };
enum class cache_policy_kind { lru, lfu, lhu, fld, hobbit, edgemoe, fate, decay, adaptive };
enum class prefetch_mode     { none, hobbit, fate, edgemoe };
enum class low_hit_rule      { accept, reload };  // a cached LOW copy for a HIGH demand
// where expert math runs (HOBBIT sec. 4): the CPU; a GPU, misses uploaded (GPU-centric); a GPU for
// hits and the CPU for misses (CPU-GPU cooperative); a GPU for hits and the misses split between
// uploads and the CPU, in the ratio of the two rates, at once (split); or one of the three chosen at load
enum class compute_mode      { cpu, gpu, coop, split, automatic };

// each enum's names, in the order of its values: how the CLI and Python spell them
template <typename E> struct enum_names;
template <> struct enum_names<expert_io>         { static constexpr std::array<const char *, 3> values = { "direct", "buffered", "mmap" }; };
template <> struct enum_names<cache_policy_kind> { static constexpr std::array<const char *, 9> values = { "lru", "lfu", "lhu", "fld", "hobbit", "edgemoe", "fate", "decay", "adaptive" }; };
template <> struct enum_names<prefetch_mode>     { static constexpr std::array<const char *, 4> values = { "none", "hobbit", "fate", "edgemoe" }; };
template <> struct enum_names<low_hit_rule>      { static constexpr std::array<const char *, 2> values = { "accept", "reload" }; };
template <> struct enum_names<compute_mode>      { static constexpr std::array<const char *, 5> values = { "cpu", "gpu", "coop", "split", "auto" }; };

template <typename E> const char * name_of(E value) { return enum_names<E>::values[(size_t) value]; }

// The value named name; throws std::invalid_argument listing the names.
template <typename E> E enum_from_name(const std::string & name) {
    std::string all;
    for (size_t v = 0; v < enum_names<E>::values.size(); v++) {
        if (name == enum_names<E>::values[v]) return (E) v;
        all += (v ? ", " : "") + std::string(enum_names<E>::values[v]);
    }
    throw std::invalid_argument("unknown '" + name + "' (" + all + ")");
}

// Weights of HOBBIT's multidimensional cache priority (sec. 3.4, eq. 3): lru, lfu, lhu, fld.
using hobbit_weights = std::array<float, 4>;
inline constexpr hobbit_weights kEqualHobbitWeights = { 0.25f, 0.25f, 0.25f, 0.25f };

#define EDGEMOE_EXPERT_OPTIONS(X)                                                                                        \
    X(expert_io,         io,              expert_io::direct,      "how experts are read: direct (O_DIRECT), buffered, mmap") \
    X(int,               io_threads,      4,                      "expert reads in flight at once")                     \
    X(bool,              fill_cache,      true,                   "read experts into the expert cache at load (most routed first when calibrated)") \
    X(bool,              fill_background, true,                   "fill_cache while the prompt and the first tokens run, not before them (lossless runs; with LOW copies or skips: before)") \
    X(cache_policy_kind, cache_policy,    cache_policy_kind::lru, "expert cache eviction: lru, lfu, lhu, fld, hobbit, edgemoe, fate, decay or adaptive") \
    X(hobbit_weights,    policy_weights,  kEqualHobbitWeights,    "hobbit policy weights lru,lfu,lhu,fld")              \
    X(int,               fate_shallow,    -1,                     "fate policy: MoE layers cached first, as shallow (-1: the first sixth)") \
    X(bool,              low_precision,   false,                  "load unimportant missed experts in LOW precision")   \
    X(bool,              skip,            false,                  "skip the least important missed experts")            \
    X(double,            t1,              0.6,                    "HIGH while the expert's score <= T1 (HOBBIT sec. 3.2)") \
    X(double,            t2,              0.9,                    "LOW while the score <= T2, SKIP above")             \
    X(double,            low_cache,       0.25,                   "share of the expert cache for LOW copies, in (0, 1)") \
    X(bool,              static_precision, false,                 "EdgeMoE: each expert only in the precision calibrate --system edgemoe gave it") \
    X(double,            prefill_low_share, 0.0,                  "Fate: a prefill ubatch's least popular experts covering this share of its selections in LOW, popular ones first") \
    X(low_hit_rule,      low_hit,         low_hit_rule::accept,   "a cached LOW copy for a HIGH demand: accept it or reload HIGH") \
    X(std::string,       low_from,        "",                     "LOW copies from this standard GGUF (a lower quant)") \
    X(prefetch_mode,     prefetch,        prefetch_mode::none,    "expert prefetching: none, hobbit, fate or edgemoe (path statistics, calibrated)")           \
    X(int,               prefetch_depth,  2,                      "hobbit: MoE layers ahead to predict")                \
    X(double,            fate_percentile, 0.75,                   "fate: also prefetch experts above this quantile of the next layer's predicted probabilities") \
    X(int,               fate_extra,      -1,                     "fate: at most this many of them (-1: top-k), within what the compute between layers hides; with LOW copies or skips this many whatever the time (-1: none)") \
    X(double,            big_little,      0.0,                    "MoBiLE: decode with top-k/2, redo a token with top-k when its top probability is below this (0: off)") \
    X(double,            cache_routing,   0.0,                    "cache-aware routing: a cached expert takes an uncached one's place when its router logit is within this share of the token's logit spread (0: off, 1: always)") \
    X(double,            stand_in,        0.0,                    "cache-aware routing by calibrated stand-ins: a cached expert takes an uncached one's place, or none does, when that came near enough to its output on the calibration text, within this quantile of the calibration's own swap costs (0: off; needs calibrate --stand-ins)") \
    X(compute_mode,      mode,            compute_mode::cpu,      "where expert math runs: cpu, gpu (misses uploaded), coop (misses on the CPU), split (misses uploaded and on the CPU at once) or auto") \
    X(bool,              mlock,           false,                  "keep the weights and the expert cache in RAM, never swapped out (llama.cpp's --mlock; mapped experts and embedding rows stay in the page cache)") \
    X(double,            link_share,      -1.0,                   "mode split: the share of a decode token's misses uploaded, the others computed on the CPU meanwhile (more of a prefill's; -1: the ratio of the two rates measured at load, then of those each decode layer takes)")

struct expert_options {
#define EDGEMOE_DECLARE_OPTION(type, name, default_value, help) type name = default_value;
    EDGEMOE_EXPERT_OPTIONS(EDGEMOE_DECLARE_OPTION)
#undef EDGEMOE_DECLARE_OPTION

    precision_params precision() const { return { t1, t2, low_precision, skip }; }
    // With LOW copies, skips or cache-aware routing, what a token computes depends on what the cache
    // holds: then what is cached and evicted must not depend on how fast the reads went or the compute ran.
    bool lossy() const { return low_precision || skip || cache_routing > 0 || stand_in > 0; }
};

// Throws std::invalid_argument naming the first option out of its range.
void check_expert_options(const expert_options & o);
// Throws std::invalid_argument for options that the model (its LOW copies, its top-k, its routing) or
// the machine (a GPU device, or none) cannot run. fixed_routing: why the model's FFN needs the
// router's own experts ("" where another choice computes as well).
void check_options_fit(const expert_options & o, bool has_device, bool has_low, int n_expert_used,
                       const std::string & fixed_routing);

// A budget below the minimum (per group of same-shaped layers, one token's top-k experts).
struct expert_budget_error : std::invalid_argument {
    using std::invalid_argument::invalid_argument;
};

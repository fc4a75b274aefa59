// Which cached expert to evict. One interface, one small class per policy (like llama.cpp's
// samplers): a policy sees uses and insertions and names a victim; it never touches slots or I/O.
#pragma once

#include "expert-options.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

// A cached expert: (layer, expert) packed into one key.
using expert_key = uint64_t;
inline expert_key make_expert_key(int layer, int expert) { return ((uint64_t) (uint32_t) layer << 32) | (uint32_t) expert; }
inline int expert_key_layer(expert_key key) { return (int) (key >> 32); }
inline int expert_key_expert(expert_key key) { return (int) (uint32_t) key; }

// Keys no model has: beyond EXPERT_TABLE_MAX layers or experts, or negative. An error, not a row of
// gigabytes in an expert_table.
constexpr size_t EXPERT_TABLE_MAX = 1 << 16;
inline void check_expert_key(expert_key key) {
    if ((size_t) expert_key_layer(key) >= EXPERT_TABLE_MAX || (size_t) expert_key_expert(key) >= EXPERT_TABLE_MAX) {
        throw std::out_of_range("no layer " + std::to_string(expert_key_layer(key)) + ", expert " +
                                std::to_string(expert_key_expert(key)) + " in a model");
    }
}

// A record per expert in arrays ([layer][expert], grown on demand): a policy's bookkeeping without a
// hash or an allocation per expert. A decode's matrices leave little of it in the CPU's caches, and
// there a node-based map cost microseconds a use (docs/benchmarks.md, "What a policy costs in a decode").
template <typename T>
struct expert_table {
    std::vector<std::vector<T>> rows;

    T & operator[](expert_key key) {
        check_expert_key(key);
        const size_t layer = (size_t) expert_key_layer(key), expert = (size_t) expert_key_expert(key);
        if (rows.size() <= layer) rows.resize(layer + 1);
        if (rows[layer].size() <= expert) rows[layer].resize(expert + 1);
        return rows[layer][expert];
    }
    const T * find(expert_key key) const {  // null where never written
        const size_t layer = (size_t) expert_key_layer(key), expert = (size_t) expert_key_expert(key);
        return layer < rows.size() && expert < rows[layer].size() ? &rows[layer][expert] : nullptr;
    }
};

// Where the model is: tokens that entered the model in this sequence (T) and the MoE layer running now.
struct cache_clock {
    uint64_t token = 0;  // includes the ubatch being computed
    int layer = 0;
    int n_layers = 1;
    bool sweep = false;  // the ubatch being computed needs most experts of every layer (a prefill's)
};

// a prefill ubatch needs nearly every expert of a layer: t tokens routed top-k of n miss an
// expert with probability (1 - k/n)^t, below e^-2 from t*k = 2n
inline bool needs_most_experts(int64_t n_tokens, int n_expert_used, int n_expert) {
    return n_expert > 0 && n_tokens * n_expert_used >= 2 * (int64_t) n_expert;
}

struct cache_policy {
    virtual ~cache_policy() = default;
    virtual const char * name() const = 0;
    // key was requested and is cached (a hit), or was just loaded (after on_insert); high: it
    // served a HIGH-precision use
    virtual void on_use(expert_key key, bool high, const cache_clock & now) = 0;
    virtual void on_insert(expert_key key) = 0;
    virtual void on_evict(expert_key key) = 0;
    // the cached key to evict next, for `incoming`, among those for which evictable(key) is true;
    // false if none
    virtual bool victim(const std::function<bool(expert_key)> & evictable, const cache_clock & now, expert_key incoming,
                        expert_key * out) const = 0;
    // a new sequence starts: per-sequence records are forgotten (the cached set stays)
    virtual void reset_sequence() {}
};

// What a policy may know of its tier: slots, the MoE layers whose experts share them (ascending),
// experts per layer and per token, and Fate's shallow layers among them (-1: the first sixth,
// rounded up, fewer where the deep layers would be left less than a token's top-k each).
struct cache_tier_shape {
    int n_slots = 0;
    std::vector<int> layers;
    int n_expert = 0;
    int n_shallow = -1;
    int n_expert_used = 0;
};

// weights: HOBBIT's multidimensional priority's (for cache_policy_kind::hobbit)
std::unique_ptr<cache_policy> make_cache_policy(cache_policy_kind kind, const hobbit_weights & weights,
                                                const cache_tier_shape & shape);

// Fate's shallow-favoring split (Fate sec. 4.4) of shape's slots over its layers (same order):
// fewer slots than the shallow layers' experts go to the layers in order, each up to n_expert;
// else every shallow layer gets n_expert and the rest is split evenly over the deep layers (the
// remainder one each to the first).
std::vector<int> shallow_favoring_split(const cache_tier_shape & shape);

// the larger policies, a file each: EdgeMoE's frequency x layer distance (cache-policy-edgemoe.cpp),
// Fate's shallow-favoring split with an ARC per layer (cache-policy-fate.cpp), decayed frequency
// (cache-policy-decay.cpp), lru or decay by shadow caches of each (cache-policy-adaptive.cpp)
std::unique_ptr<cache_policy> make_edgemoe_policy();
std::unique_ptr<cache_policy> make_fate_policy(const cache_tier_shape & shape);
std::unique_ptr<cache_policy> make_decay_policy();
std::unique_ptr<cache_policy> make_adaptive_policy(const hobbit_weights & weights, const cache_tier_shape & shape);

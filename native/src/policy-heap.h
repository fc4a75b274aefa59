// A policy's cached experts in eviction order, for the policies that order them by a priority
// (decay, lfu, hobbit's weights, edgemoe's frequency): an indexed binary min-heap in one array,
// ordered by (priority, key). A use moves one node along a path of contiguous memory, and the first
// evictable expert is found by walking the heap best first from its root. (A std::set, a node an
// allocation, cost about 2 us a use in a decode, whose matrices leave little of it in the CPU's
// caches: docs/benchmarks.md, "What a policy costs in a decode".)
#pragma once

#include "cache-policy.h"

#include <algorithm>
#include <vector>

template <typename Priority>  // ordered by operator<
class policy_heap {
public:
    struct node {
        Priority priority;
        expert_key key;
        bool operator<(const node & o) const { return priority < o.priority || (!(o.priority < priority) && key < o.key); }
    };

    bool contains(expert_key key) const { return find(key) != nullptr; }
    const Priority * find(expert_key key) const {  // null where not held
        const slot * s = where_.find(key);
        return s && s->pos >= 0 ? &nodes_[(size_t) s->pos].priority : nullptr;
    }
    void insert(expert_key key, const Priority & priority) {
        if (contains(key)) return;
        nodes_.push_back({ priority, key });
        sift_up(nodes_.size() - 1);
    }
    void update(expert_key key, const Priority & priority) {
        if (!contains(key)) return;
        const size_t i = (size_t) where_[key].pos;
        nodes_[i].priority = priority;
        sift_up(i);
        sift_down((size_t) where_[key].pos);
    }
    void erase(expert_key key) {
        if (!contains(key)) return;
        const size_t i = (size_t) where_[key].pos;
        where_[key].pos = -1;
        const node last = nodes_.back();
        nodes_.pop_back();
        if (i == nodes_.size()) return;
        put(i, last);
        sift_up(i);
        sift_down((size_t) where_[last.key].pos);
    }
    const std::vector<node> & nodes() const { return nodes_; }  // in heap order, not sorted

    // the first node in (priority, key) order whose key is evictable, or null
    template <typename Evictable>
    const node * first(const Evictable & evictable) const {
        if (nodes_.empty()) return nullptr;
        if (evictable(nodes_[0].key)) return &nodes_[0];  // the common case, without the frontier's allocation
        const auto later = [&](size_t a, size_t b) { return nodes_[b] < nodes_[a]; };
        std::vector<size_t> frontier = { 0 };
        while (!frontier.empty()) {
            std::pop_heap(frontier.begin(), frontier.end(), later);
            const size_t i = frontier.back();
            frontier.pop_back();
            if (evictable(nodes_[i].key)) return &nodes_[i];
            for (size_t c = 2 * i + 1; c <= 2 * i + 2 && c < nodes_.size(); c++) {
                frontier.push_back(c);
                std::push_heap(frontier.begin(), frontier.end(), later);
            }
        }
        return nullptr;
    }

private:
    struct slot { int pos = -1; };
    std::vector<node> nodes_;
    expert_table<slot> where_;

    void put(size_t i, const node & n) { nodes_[i] = n; where_[n.key].pos = (int) i; }
    void sift_up(size_t i) {
        const node n = nodes_[i];
        while (i > 0 && n < nodes_[(i - 1) / 2]) { put(i, nodes_[(i - 1) / 2]); i = (i - 1) / 2; }
        put(i, n);
    }
    void sift_down(size_t i) {
        const node n = nodes_[i];
        for (size_t c; (c = 2 * i + 1) < nodes_.size(); i = c) {
            if (c + 1 < nodes_.size() && nodes_[c + 1] < nodes_[c]) c++;
            if (!(nodes_[c] < n)) break;
            put(i, nodes_[c]);
        }
        put(i, n);
    }
};

// The cached experts ordered within each layer, for the policies with a term that is the same for
// a whole layer, its distance from the layer running (decay, hobbit's weights, edgemoe): a miss
// weighs the layers' first evictable ones (a scan of every cached expert per miss cost 6-7 ms a
// token at 1536 slots).
template <typename Priority>
struct layer_heaps {
    std::vector<policy_heap<Priority>> by_layer;  // indexed by layer

    policy_heap<Priority> & of(expert_key key) {
        const size_t layer = (size_t) expert_key_layer(key);
        if (by_layer.size() <= layer) by_layer.resize(layer + 1);
        return by_layer[layer];
    }
};

// the layers from the one running now to `layer`, going forward: 0 for the running one, whose
// other experts wait a whole token, n_layers - 1 for the one just run
inline int layers_ahead(int layer, const cache_clock & now) {
    const int L = now.n_layers > 0 ? now.n_layers : 1;
    return ((layer - now.layer) % L + L) % L;
}

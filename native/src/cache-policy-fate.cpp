// Fate's shallow-favoring expert cache (Fate sec. 4.4): shallow layers predict their experts worst,
// so the tier's slots go to them first (shallow_favoring_split), and each layer manages its share
// with ARC, the Adaptive Replacement Cache (Megiddo & Modha, FAST '03): T1 holds experts used once
// since they came in, T2 those used again; the ghost lists B1 and B2 remember what T1 and T2
// evicted, and a ghost hit moves the target size p of T1 (up for B1, down for B2). A load into a
// layer below its share evicts from the layer most above its share; else from its own layer, by
// ARC's rule (T1's least recent when |T1| > p, or = p for a B2 ghost; else T2's).
#include "cache-policy.h"

#include <algorithm>
#include <list>
#include <map>
#include <unordered_map>
#include <unordered_set>

std::vector<int> shallow_favoring_split(const cache_tier_shape & shape) {
    const int L = (int) shape.layers.size(), E = shape.n_expert;
    std::vector<int> share(L, 0);
    if (L == 0) return share;
    int S = std::min(L, shape.n_shallow >= 0 ? shape.n_shallow : (L + 5) / 6);
    // our default's one change to the paper's: the deep layers keep room for a token's top-k each
    while (shape.n_shallow < 0 && S > 0 && shape.n_slots - S * E < (L - S) * shape.n_expert_used) S--;
    int left = shape.n_slots;
    if (left <= S * E) {
        for (int i = 0; i < S && left > 0; i++) left -= share[i] = std::min(E, left);
        return share;
    }
    for (int i = 0; i < S; i++) share[i] = E;
    left -= S * E;
    const int deep = L - S;
    for (int i = S; i < L; i++) share[i] = left / deep + (i - S < left % deep ? 1 : 0);
    return share;
}

namespace {

enum arc_list { T1, T2, B1, B2 };

struct arc_layer {
    int target = 0;     // c: the layer's share of slots
    double p = 0;       // ARC's target size of T1
    std::list<expert_key> lists[4];  // most recent first
    std::unordered_map<expert_key, std::pair<arc_list, std::list<expert_key>::iterator>> where;

    int cached() const { return (int) (lists[T1].size() + lists[T2].size()); }
    bool in(expert_key key, arc_list l) const { auto it = where.find(key); return it != where.end() && it->second.first == l; }
    void put(expert_key key, arc_list l) {
        drop(key);
        lists[l].push_front(key);
        where[key] = { l, lists[l].begin() };
    }
    void drop(expert_key key) {
        auto it = where.find(key);
        if (it == where.end()) return;
        lists[it->second.first].erase(it->second.second);
        where.erase(it);
    }
    // ARC's directory bounds: |T1| + |B1| <= c, all four <= 2c
    void trim_ghosts() {
        while (!lists[B1].empty() && (int) (lists[T1].size() + lists[B1].size()) > target) drop(lists[B1].back());
        while (!lists[B2].empty() && cached() + (int) (lists[B1].size() + lists[B2].size()) > 2 * target) drop(lists[B2].back());
    }
    // the least recent evictable key of T1 or T2, ARC's list first
    bool replace(const std::function<bool(expert_key)> & evictable, expert_key incoming, expert_key * out) const {
        const int t1 = (int) lists[T1].size();
        const bool from_t1 = t1 >= 1 && (t1 > p || (in(incoming, B2) && t1 == (int) p));
        for (arc_list l : { from_t1 ? T1 : T2, from_t1 ? T2 : T1 }) {
            for (auto it = lists[l].rbegin(); it != lists[l].rend(); ++it) {
                if (evictable(*it)) { *out = *it; return true; }
            }
        }
        return false;
    }
};

struct fate_policy final : cache_policy {
    std::map<int, arc_layer> layers;
    std::unordered_set<expert_key> fresh;  // inserted, first use not yet seen (it is not a reuse)

    explicit fate_policy(const cache_tier_shape & shape) {
        const std::vector<int> share = shallow_favoring_split(shape);
        for (size_t i = 0; i < shape.layers.size(); i++) layers[shape.layers[i]].target = share[i];
    }
    arc_layer & of(expert_key key) { return layers[expert_key_layer(key)]; }

    const char * name() const override { return "fate"; }
    void on_insert(expert_key key) override {
        arc_layer & a = of(key);
        const double b1 = (double) a.lists[B1].size(), b2 = (double) a.lists[B2].size();
        if (a.in(key, B1)) {
            a.p = std::min<double>(a.target, a.p + std::max(1.0, b2 / b1));
            a.put(key, T2);
        } else if (a.in(key, B2)) {
            a.p = std::max(0.0, a.p - std::max(1.0, b1 / b2));
            a.put(key, T2);
        } else {
            a.put(key, T1);
        }
        a.trim_ghosts();
        fresh.insert(key);
    }
    void on_use(expert_key key, bool, const cache_clock &) override {
        if (fresh.erase(key)) return;
        arc_layer & a = of(key);
        if (a.in(key, T1) || a.in(key, T2)) a.put(key, T2);
    }
    void on_evict(expert_key key) override {
        fresh.erase(key);
        arc_layer & a = of(key);
        if (a.in(key, T1)) a.put(key, B1);
        else if (a.in(key, T2)) a.put(key, B2);
        a.trim_ghosts();
    }

    bool victim(const std::function<bool(expert_key)> & evictable, const cache_clock &, expert_key incoming,
                expert_key * out) const override {
        auto own = layers.find(expert_key_layer(incoming));
        const bool below_share = own != layers.end() && own->second.cached() < own->second.target;
        // layers above their share, most above first
        std::vector<std::pair<int, const arc_layer *>> over;
        for (const auto & [il, a] : layers) {
            if (a.cached() > a.target) over.emplace_back(a.cached() - a.target, &a);
        }
        std::stable_sort(over.begin(), over.end(), [](const auto & x, const auto & y) { return x.first > y.first; });
        if (!below_share && own != layers.end() && own->second.replace(evictable, incoming, out)) return true;
        for (const auto & [excess, a] : over) {
            if (a->replace(evictable, incoming, out)) return true;
        }
        for (const auto & [il, a] : layers) {
            if (a.replace(evictable, incoming, out)) return true;
        }
        return false;
    }
};

}  // namespace

std::unique_ptr<cache_policy> make_fate_policy(const cache_tier_shape & shape) { return std::make_unique<fate_policy>(shape); }

// Decayed frequency: an expert is kept by how often it was used lately, each use worth half as much
// DECAY_HALF_LIFE tokens later; the least is evicted, ties to the least recently used. Between lfu
// (every use counts forever: experts that were hot early squat) and lru (only the last use counts:
// an expert used every other token goes as soon as a burst of others passes), it follows the drift
// of routing within a text. On the demo model's routing it needs 1.6x the loads of Belady's MIN at
// a 25 % cache where lru needs 1.9x (docs/benchmarks.md, "The cache against its limit").
//
// The score of an expert used at tokens t_i is sum 2^-((T - t_i) / H) at token T. Kept as
// level = log2(score at T) + T / H, which does not change while the expert goes unused, so levels
// compare across experts without decaying anything; records outlive evictions and sequences.
#include "cache-policy.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr double DECAY_HALF_LIFE = 16.0;  // tokens; 8 to 32 do about as well on the demo's routing

struct decay_policy final : cache_policy {
    // a cached expert in eviction order: the lowest level first, ties to the least recently used,
    // then the lower key
    struct node {
        double level;
        uint64_t last_use;
        expert_key key;
        bool operator<(const node & o) const {
            return level != o.level ? level < o.level : last_use != o.last_use ? last_use < o.last_use : key < o.key;
        }
    };
    struct record { double level = -INFINITY; uint64_t last_use = 0; int pos = -1; };  // pos: in heap, -1 uncached
    // The cached experts as a binary min-heap in one array, each record knowing its node: a use
    // moves one node along a path of contiguous memory (a std::set, a node an allocation, cost about
    // 2 us a use in a decode).
    std::vector<node> heap;
    expert_table<record> records;
    uint64_t use_clock = 0;
    double sequence_start = 0;  // tokens of the sequences before this one: the clock never goes back
    double last_token = 0;

    void put(size_t i, const node & n) { heap[i] = n; records[n.key].pos = (int) i; }
    void sift_up(size_t i) {
        const node n = heap[i];
        while (i > 0 && n < heap[(i - 1) / 2]) { put(i, heap[(i - 1) / 2]); i = (i - 1) / 2; }
        put(i, n);
    }
    void sift_down(size_t i) {
        const node n = heap[i];
        for (size_t c; (c = 2 * i + 1) < heap.size(); i = c) {
            if (c + 1 < heap.size() && heap[c + 1] < heap[c]) c++;
            if (!(heap[c] < n)) break;
            put(i, heap[c]);
        }
        put(i, n);
    }

    const char * name() const override { return "decay"; }
    void on_insert(expert_key key) override {
        record & r = records[key];
        if (r.pos >= 0) return;
        heap.push_back({ r.level, r.last_use, key });
        sift_up(heap.size() - 1);
    }
    void on_use(expert_key key, bool, const cache_clock & now) override {
        last_token = sequence_start + (double) now.token;
        const double age = last_token / DECAY_HALF_LIFE;
        record & r = records[key];
        r.level = std::log2(std::exp2(r.level - age) + 1.0) + age;
        r.last_use = ++use_clock;
        if (r.pos < 0) return;
        heap[r.pos].level = r.level;  // both only grow: the node moves down
        heap[r.pos].last_use = r.last_use;
        sift_down((size_t) r.pos);
    }
    void on_evict(expert_key key) override {
        record & r = records[key];
        if (r.pos < 0) return;
        const size_t i = (size_t) r.pos;
        r.pos = -1;
        const node last = heap.back();
        heap.pop_back();
        if (i == heap.size()) return;
        put(i, last);
        sift_up(i);
        sift_down((size_t) records[last.key].pos);
    }
    void reset_sequence() override { sequence_start = last_token + 1; }

    // the first evictable node in eviction order: the heap walked best first from its root
    bool victim(const std::function<bool(expert_key)> & evictable, const cache_clock &, expert_key,
                expert_key * out) const override {
        if (heap.empty()) return false;
        const auto later = [&](size_t a, size_t b) { return heap[b] < heap[a]; };
        std::vector<size_t> frontier = { 0 };
        while (!frontier.empty()) {
            std::pop_heap(frontier.begin(), frontier.end(), later);
            const size_t i = frontier.back();
            frontier.pop_back();
            if (evictable(heap[i].key)) { *out = heap[i].key; return true; }
            for (size_t c = 2 * i + 1; c <= 2 * i + 2 && c < heap.size(); c++) {
                frontier.push_back(c);
                std::push_heap(frontier.begin(), frontier.end(), later);
            }
        }
        return false;
    }
};

}  // namespace

std::unique_ptr<cache_policy> make_decay_policy() { return std::make_unique<decay_policy>(); }

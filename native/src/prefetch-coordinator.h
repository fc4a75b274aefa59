// What the residency layer keeps between layers: the pins on cached experts and the prefetch
// reads in flight (HOBBIT sec. 3.3). Pins release themselves (pin_set); each prefetch read
// pins its slot until it is done, cancelled or claimed by the compute, in one place.
#pragma once

#include "expert-cache.h"
#include "predictor.h"
#include "prefetch-ledger.h"
#include "prefetch-meter.h"
#include "prefetcher.h"
#include "stats.h"

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

// (expert, precision) of a cached copy: a pin or a read in flight is about this
using cached_copy = std::pair<expert_key, expert_precision>;
struct cached_copy_hash {
    size_t operator()(const cached_copy & c) const { return std::hash<expert_key>()(c.first) * 3 + (size_t) c.second; }
};

// Pins taken on an expert_cache, undone together by release() or the destructor.
class pin_set {
public:
    pin_set(expert_cache & cache, bool hard) : cache_(cache), hard_(hard) {}
    ~pin_set() { release(); }
    pin_set(const pin_set &) = delete;
    pin_set & operator=(const pin_set &) = delete;

    void add(const cached_copy & c) { cache_.pin(c.first, c.second, hard_); pins_.push_back(c); }
    void release() {
        for (const auto & [key, p] : pins_) cache_.unpin(key, p, hard_);
        pins_.clear();
    }
    void forget() { pins_.clear(); }  // after expert_cache::forget_all, which dropped every pin

private:
    expert_cache & cache_;
    bool hard_;
    std::vector<cached_copy> pins_;
};

// A layer's op tops the fill up; until the next op the loader threads read what is queued, so a
// queue of several reads per thread keeps the disk busy through a layer's compute.
constexpr int FILL_READS_PER_THREAD = 4;

class prefetch_coordinator {
public:
    // The reads that fill `slot` with expert e of layer il in precision p.
    using reads_fn = std::function<std::vector<expert_read>(int il, int e, expert_precision p, int slot)>;

    // group_of: per il, the pool group (-1: not a MoE layer). With n_threads > 0 prefetch reads
    // run on that many background threads; with 0 nothing is prefetched. timed: whether read times
    // may decide what is prefetched (lossless only: else the tokens would depend on them).
    prefetch_coordinator(expert_cache & cache, std::vector<int> group_of, int n_threads, reads_fn reads_of, bool timed);
    // Where read times may not judge, decode prefetching stops once it has read more than the run
    // would without it (prefetch-ledger.h); low_cost: a LOW expert's bytes over a HIGH one's. Before
    // anything is placed or read.
    void count_reads(double low_cost) {
        if (prefetcher_) ledger_ = std::make_unique<prefetch_ledger>(cache_, low_cost);
    }

    bool prefetching() const { return (bool) prefetcher_; }

    // The experts the running wave uses stay cached until release_wave().
    void use(const cached_copy & c) { wave_pins_.add(c); }
    void release_wave() { wave_pins_.release(); }
    // Layer il runs now: the experts predicted for it may go.
    void settle(int il);

    // A wave placed `c` (a hit): counts a prefetch used. If c's prefetch read has not finished,
    // returns its job when it has not started (the caller reads it with its loads, then calls
    // claimed_done) or waits for it (*waited = true; collect_finished() then takes it) and returns null.
    std::shared_ptr<prefetch_job> claim(const cached_copy & c, bool * waited);
    void claimed_done(const prefetch_job & job) { finish(job, true); }
    // A wave wants `c`, and where the CPU computes misses (coop, split), a prefetch of it not begun
    // by now is cancelled and its slot freed: the expert is a miss like the others, for the layer to
    // divide between the CPU and the link, rather than an upload the device's pass waits for. So
    // the link carries predicted experts from one layer's op to the next, and what it has not begun
    // goes where the rates send it. True if c's prefetch was given back.
    bool give_back(const cached_copy & c);
    // A placement evicted `c` from its tier: a prefetched copy never used was wasted (true).
    bool evicted(const cached_copy & c);

    // HOBBIT's walked predictions: each is pinned (softly) until its layer runs; those not cached
    // are prefetched into slots reserved for them, as far as slots can be evicted. `judged`
    // prefetches (decode's guesses) are measured by their place in `walked` (prefetch-meter.h), and
    // a place that costs more reads than it saves is no longer read; a prefill's read-ahead is
    // neither measured nor stopped (it would blur the judgement).
    void prefetch(const std::vector<predicted_expert> & walked, bool judged = false);

    // The cache's fill in the background: HIGH copies of order's experts ((il, expert), in order)
    // are read into free slots, never evicting and never holding more than half of those free;
    // top_up_fill() keeps up to FILL_READS_PER_THREAD x n_threads reads queued or in flight and is
    // called as layers run, so the fill goes on while the prompt and the first tokens compute.
    // A group's fill ends at its first expert with no free slot. Claimed like a prefetch.
    void start_fill(std::vector<std::pair<int, int>> order);
    void top_up_fill();
    const expert_fill_stats & fill_stats() const { return fill_stats_; }
    // Collects finished prefetch reads; returns the first read error ("" if none).
    std::string collect_finished();
    // Waits for every prefetch read queued or in flight, so that collect_finished() then unpins
    // them all: which slots are pinned, and so which ones a placement may evict, no longer depends
    // on how fast the reads went.
    void wait_in_flight() { if (prefetcher_) prefetcher_->wait_idle(); }
    // Cancels queued reads, waits for the running ones and frees the slots reserved for them.
    void drop_all();
    // expert_cache::place for a wave's on-demand experts; where the prefetch reads in flight hold
    // the slots it needs, they give way (drop_all) and it places again. Throws as place does.
    std::vector<expert_cache::placement> place(int group, int il, const std::vector<std::pair<int, expert_precision>> & wanted);
    // A read failed and the cache is about to forget every slot and pin: drops the reads in
    // flight and forgets the pins without undoing them.
    void forget();

    // a prefetch never delays an on-demand load: no new prefetch read starts in between
    void pause_for_loads() { if (prefetcher_) prefetcher_->pause(); }
    void resume_after_loads() { if (prefetcher_) prefetcher_->resume(); }

    const std::vector<expert_prefetch_stats> & stats() const { return stats_; }  // per il: the layer prefetched for
    // decode prefetching stopped for good: by the meter, the ledger, or stop_judged() (prefetch-trial.cpp)
    bool judged_useless() const { return stopped_ || meter_.useless() || (ledger_ && ledger_->costs()); }
    void stop_judged() { stopped_ = true; }
    void hold_judged(bool held) { held_ = held; }  // no judged prefetch is read while held
    prefetch_phase phase() const {
        return judged_useless() ? prefetch_phase::stopped : held_ ? prefetch_phase::held : prefetch_phase::reading;
    }
    bool timed() const { return timed_; }
    double busy_ms() const { return prefetcher_ ? prefetcher_->busy_ms() : 0.0; }
    void reset_stats();

private:
    // the job's read is over (placed: its expert is cached, read by the prefetcher or claimed by
    // the compute; not: cancelled): no longer in flight, unpinned
    void finish(const prefetch_job & job, bool placed);
    // the job was taken off the prefetcher's queue unread: finished, its slot freed, no longer unused
    void cancelled(const prefetch_job & job);

    expert_cache & cache_;
    std::vector<int> group_of_;
    reads_fn reads_of_;
    std::unordered_map<cached_copy, std::shared_ptr<prefetch_job>, cached_copy_hash> in_flight_;
    std::unordered_set<cached_copy, cached_copy_hash> unused_;  // prefetched, not used yet
    std::unordered_map<cached_copy, int, cached_copy_hash> judged_unused_;  // those of them judged: their rank
    pin_set wave_pins_;
    std::map<int, std::unique_ptr<pin_set>> predicted_pins_;     // by the layer predicted for
    std::vector<expert_prefetch_stats> stats_;
    prefetch_meter meter_;                         // judged ones, since the start (stats_ are reset)
    std::unique_ptr<prefetch_ledger> ledger_;      // count_reads()
    bool timed_, stopped_ = false, held_ = false;
    std::vector<std::pair<int, int>> fill_order_;  // (il, expert)
    size_t fill_next_ = 0;                         // the next in fill_order_ to read
    int fill_in_flight_ = 0, n_threads_ = 0;
    std::vector<bool> fill_full_;                  // per group: no free slot left
    std::chrono::steady_clock::time_point fill_started_;
    expert_fill_stats fill_stats_;
    std::unique_ptr<prefetcher> prefetcher_;  // last: stopped first, before the pins it reads into
};

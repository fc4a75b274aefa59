#include "prefetch-coordinator.h"

prefetch_coordinator::prefetch_coordinator(expert_cache & cache, std::vector<int> group_of, int n_threads, reads_fn reads_of,
                                           bool timed)
    : cache_(cache), group_of_(std::move(group_of)), reads_of_(std::move(reads_of)), wave_pins_(cache, true),
      stats_(group_of_.size()), meter_(cache.n_slots()), timed_(timed), n_threads_(n_threads) {
    if (n_threads > 0) prefetcher_ = std::make_unique<prefetcher>(n_threads);
}

void prefetch_coordinator::settle(int il) { predicted_pins_.erase(il); }

std::shared_ptr<prefetch_job> prefetch_coordinator::claim(const cached_copy & c, bool * waited) {
    auto it = in_flight_.find(c);
    // a read not started yet comes back to the layer, which reads it itself: nothing was read ahead
    std::shared_ptr<prefetch_job> job = it == in_flight_.end() ? nullptr : prefetcher_->claim(it->second);
    if (it != in_flight_.end() && !job) *waited = true;  // it was running and is over now: collect_finished() takes it
    if (unused_.erase(c)) {
        stats_[expert_key_layer(c.first)].used++;
        stats_[expert_key_layer(c.first)].late += job != nullptr;
    }
    if (auto judged = judged_unused_.find(c); judged != judged_unused_.end()) {
        meter_.used(judged->second, /*ahead*/ job == nullptr || !timed_);
        judged_unused_.erase(judged);
    }
    return job;
}

bool prefetch_coordinator::give_back(const cached_copy & c) {
    auto it = in_flight_.find(c);
    std::shared_ptr<prefetch_job> job = it == in_flight_.end() || it->second->fill ? nullptr : prefetcher_->claim(it->second);
    if (!job) return false;  // none, a fill's, or begun
    cancelled(*job);
    stats_[expert_key_layer(c.first)].given_back++;
    return true;
}

void prefetch_coordinator::cancelled(const prefetch_job & job) {
    finish(job, false);
    cache_.discard(group_of_[expert_key_layer(job.key)], job.key, job.precision);
    unused_.erase({ job.key, job.precision });
    if (judged_unused_.erase({ job.key, job.precision }) && ledger_) ledger_->cancelled(expert_key_layer(job.key), job.precision);
}

bool prefetch_coordinator::evicted(const cached_copy & c) {
    meter_.evicted();
    const bool wasted = unused_.erase(c);
    stats_[expert_key_layer(c.first)].wasted += wasted;
    if (auto judged = judged_unused_.find(c); judged != judged_unused_.end()) {
        meter_.wasted(judged->second);
        judged_unused_.erase(judged);
    }
    return wasted;
}

void prefetch_coordinator::prefetch(const std::vector<predicted_expert> & walked, bool judged) {
    if (judged && held_) return;
    for (size_t rank = 0; rank < walked.size(); rank++) {
        const predicted_expert & p = walked[rank];
        const expert_key key = make_expert_key(p.layer, p.expert);
        const int group = group_of_[p.layer];
        expert_precision pinned = cache_.serving_tier(group, key, p.precision);
        expert_cache::placement slot = { p.expert, p.precision, -1, false };
        if (pinned == expert_precision::skip) {
            if (judged && !meter_.worth((int) rank)) {
                stats_[p.layer].declined++;
                continue;
            }
            slot = cache_.reserve(group, p.layer, p.expert, p.precision);
        }
        // a prefill's read-ahead is read without decode prefetching too
        if (ledger_ && !judged) ledger_->mirrored(group, p.layer, p.expert, p.precision, /*evict*/ true, slot.load);
        if (pinned == expert_precision::skip) {
            if (!slot.load) continue;  // no slot can be evicted for it now
            // a cached expert it displaced (not a prefetch that went unused) may be missed for it
            const bool displaced = slot.has_evicted && !evicted({ slot.evicted, p.precision });
            if (judged) meter_.issued((int) rank, displaced, slot.evicted);
            if (judged && ledger_) ledger_->guessed(p.layer, p.precision);
            auto job = std::make_shared<prefetch_job>();
            job->key = key;
            job->precision = pinned = p.precision;
            job->reads = reads_of_(p.layer, p.expert, p.precision, slot.slot);
            in_flight_[{ key, p.precision }] = job;
            unused_.insert({ key, p.precision });
            if (judged) judged_unused_[{ key, p.precision }] = (int) rank;
            cache_.pin(key, p.precision, true);  // until the read is over (finish)
            stats_[p.layer].issued++;
            prefetcher_->submit(job);
        }
        auto & pins = predicted_pins_[p.layer];
        if (!pins) pins = std::make_unique<pin_set>(cache_, false);
        pins->add({ key, pinned });
    }
}

void prefetch_coordinator::start_fill(std::vector<std::pair<int, int>> order) {
    fill_order_ = std::move(order);
    fill_next_ = 0;
    fill_full_.assign(group_of_.size(), false);
    fill_started_ = std::chrono::steady_clock::now();
    fill_stats_ = expert_fill_stats();
    top_up_fill();
}

void prefetch_coordinator::top_up_fill() {
    const expert_precision high = expert_precision::high;
    while (prefetcher_ && fill_in_flight_ < FILL_READS_PER_THREAD * n_threads_ && fill_next_ < fill_order_.size()) {
        const auto [il, e] = fill_order_[fill_next_++];
        const int group = group_of_[il];
        if (fill_full_[group]) continue;
        const expert_key key = make_expert_key(il, e);
        if (in_flight_.count({ key, high })) continue;
        // at most half of the free slots at a time: the running layer's misses need some too
        const slot_table & tier = cache_.tier(group, high);
        if (tier.n_slots() - tier.n_used() <= fill_in_flight_) { fill_next_--; break; }
        const expert_cache::placement slot = cache_.reserve(group, il, e, high, /*evict*/ false);
        if (ledger_) ledger_->mirrored(group, il, e, high, /*evict*/ false, slot.load);
        if (!slot.load) {
            // cached already, or the group's tier is full
            if (cache_.serving_tier(group, key, high) == expert_precision::skip) fill_full_[group] = true;
            continue;
        }
        auto job = std::make_shared<prefetch_job>();
        job->key = key;
        job->precision = high;
        job->fill = true;
        job->reads = reads_of_(il, e, high, slot.slot);
        in_flight_[{ key, high }] = job;
        cache_.pin(key, high, true);  // until the read is over (finish)
        fill_in_flight_++;
        prefetcher_->submit(job);
    }
}

void prefetch_coordinator::finish(const prefetch_job & job, bool placed) {
    in_flight_.erase({ job.key, job.precision });
    cache_.unpin(job.key, job.precision, true);
    if (!job.fill) return;
    fill_in_flight_--;
    if (!placed) return;
    fill_stats_.experts++;
    fill_stats_.bytes_read += job.moved.bytes_read;  // none when the compute claimed it (its layer counts them)
    fill_stats_.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - fill_started_).count();
}

std::string prefetch_coordinator::collect_finished() {
    std::string error;
    if (!prefetcher_) return error;
    for (const auto & job : prefetcher_->take_finished()) {
        finish(*job, true);
        if (error.empty()) error = job->error;
        if (job->fill) continue;  // counted by finish
        expert_prefetch_stats & st = stats_[expert_key_layer(job->key)];
        st.bytes_read += job->moved.bytes_read;
        st.bytes_read_low += job->moved.bytes_read_low;
        st.bytes_uploaded += job->moved.bytes_uploaded;
        st.upload_ms += job->moved.upload_ms;
        st.load_ms += job->ms;
    }
    return error;
}

std::vector<expert_cache::placement> prefetch_coordinator::place(int group, int il,
                                                                const std::vector<std::pair<int, expert_precision>> & wanted) {
    std::vector<expert_cache::placement> placed;
    try {
        placed = cache_.place(group, il, wanted);
    } catch (const std::exception &) {
        drop_all();
        placed = cache_.place(group, il, wanted);
    }
    for (const auto & p : placed) {
        if (p.precision != expert_precision::skip) stats_[il].displaced += meter_.demanded(make_expert_key(il, p.expert), p.load);
    }
    if (ledger_) ledger_->placed(group, il, wanted, placed);
    return placed;
}

void prefetch_coordinator::drop_all() {
    if (!prefetcher_) return;
    for (const auto & job : prefetcher_->cancel_all()) cancelled(*job);
    for (const auto & job : prefetcher_->take_finished()) finish(*job, true);
}

void prefetch_coordinator::forget() {
    fill_order_.clear();  // the cache is emptied after a read error: the fill ends
    fill_next_ = 0;
    drop_all();
    wave_pins_.forget();
    for (auto & [il, pins] : predicted_pins_) pins->forget();
    predicted_pins_.clear();
}

void prefetch_coordinator::reset_stats() {
    for (auto & s : stats_) s = expert_prefetch_stats();
    if (prefetcher_) prefetcher_->reset_busy_ms();
}

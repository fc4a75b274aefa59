// Filling the expert cache before the first token: HIGH copies of each layer's most routed experts
// into the free slots of the HIGH tier. The same order serves the fill in the background
// (prefetch_coordinator::start_fill).
#pragma once

#include "expert-budget.h"
#include "expert-cache.h"
#include "expert-layout.h"
#include "expert-reads.h"
#include "host-tier.h"
#include "layer-planner.h"
#include "stats.h"

#include <functional>
#include <map>
#include <utility>
#include <vector>

// The fill's order: per group, its layers round-robin, each layer's experts in ranking[il]'s order
// (most routed first) then by id; (il, expert) pairs, without the experts EdgeMoE's map keeps LOW.
// Throws std::invalid_argument for an expert id out of range or listed twice.
std::vector<std::pair<int, int>> fill_order(const expert_layout & layout, const layer_rules & rules,
                                            const std::map<int, std::vector<int>> & ranking);

// Reads order's experts into the free HIGH slots of cache (of pools), never evicting: a group's
// fill ends where its tier is full. interrupted() is asked between reads of FILL_CHUNK_BYTES
// (expert-residency.h): true empties the cache and throws fill_interrupted. A read error empties
// the cache and throws std::runtime_error.
expert_fill_stats fill_cache(expert_cache & cache, const expert_layout & layout, const tier_pools & pools, expert_reader & reader,
                             const std::vector<std::pair<int, int>> & order, const std::function<bool()> & interrupted);

// Reads every expert copy (both precisions) into a host tier that holds them all, a layer at a
// time, before the first token: the later misses and prefetches are served from it, none from
// the file (a host tier filled lazily read most experts during the first requests). Nothing where
// the tier holds fewer. interrupted() is asked between layers: true empties the tier and throws
// fill_interrupted; a read error empties it and throws std::runtime_error.
expert_fill_stats fill_host_tier(host_tier & host, const expert_layout & layout, expert_reader & reader,
                                 const std::function<bool()> & interrupted);

// Prefetch strategies: which experts to read before a layer asks for them. One interface, one small
// class per strategy in a file of its own (like the cache policies of cache-policy.h). A strategy
// sees the layers run (their routing, their timing, and after each wave what the layer planned and
// the stacked routers predicted) and names experts; the reads, pins and claims are the
// coordinator's (prefetch-coordinator.h). A strategy keeps its own state (path tables, the
// overlap meter, the little pass's choices).
//
// The strategies of a residency (the registry: prefetch_strategies' constructor), in the order
// they run:
//   the decode prefetcher --prefetch names: hobbit, fate (prefetch-router.cpp), edgemoe
//   (prefetch-paths.cpp); none: no such strategy; with one, lossless, its trial (prefetch-trial.cpp:
//   on only where it makes the decode faster);
//   prefill's read-ahead of the next wave or layer (prefetch-read-ahead.cpp) and, with LOW copies,
//   of the next layer's experts as Fate's prefill guess plans them (prefetch-prefill-guess.cpp);
//   MoBiLE's prefetch for the big pass that redoes a token (prefetch-big-little.cpp).
#pragma once

#include "cache-policy.h"
#include "expert-options.h"
#include "layer-planner.h"
#include "predictor.h"

#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

class expert_cache;
class path_predictor;
class prefetch_coordinator;
class routing_recorder;
struct expert_layout;
struct moe_layer_layout;

// What a strategy may read and whom it asks for reads: the residency's parts, which outlive it.
struct prefetch_env {
    const expert_layout & layout;
    const expert_options & options;  // in effect
    const layer_rules & rules;       // the precisions a plan gives (EdgeMoE's static map among them)
    const expert_cache & cache;
    prefetch_coordinator & coordinator;
    routing_recorder & recorder;
    const expert_predictor * predictor;  // null: no stacked routers
};

// A layer's op has served one of its waves.
struct served_wave {
    const moe_layer_layout & layer;
    int wave;
    int64_t n_tokens;
    predicted_logits predicted;  // wave 0 of a layer with layers ahead, with a predictor; else none
    const std::vector<std::vector<expert_demand>> & planned_waves;  // the layer's plan
    bool pipelined;              // the layer's waves take half the slots each (the planner's wave_shape)

    bool next_wave_planned() const { return wave + 1 < (int) planned_waves.size() && !planned_waves[wave + 1].empty(); }
    // The MoE layer whose experts may be read now, into the slots this layer leaves: after the
    // layer's last wave (its only one, or the last of pipelined waves), the next layer when the
    // ubatch needs most of its experts; else null.
    const moe_layer_layout * next_layer_to_read(const expert_layout & layout) const;
};

class prefetch_strategy {
public:
    using clock = std::chrono::steady_clock;

    virtual ~prefetch_strategy() = default;
    virtual const char * name() const = 0;

    // a ubatch begins (its first MoE layer's op)
    virtual void on_ubatch() {}
    // layer l routed ids [n_tokens][k]; little: MoBiLE's little pass (the token computes top-k/2)
    virtual void on_routing(const moe_layer_layout & l, const std::vector<int32_t> & ids, bool little) {
        (void) l; (void) ids; (void) little;
    }
    // a layer's op began at t0 (its wave 0) in the ubatch-th ubatch; n experts were read on demand
    // in ms (wall time); a wave's op ended at `now`
    virtual void on_layer_began(clock::time_point t0, int32_t ubatch) { (void) t0; (void) ubatch; }
    virtual void on_experts_read(int n, double ms) { (void) n; (void) ms; }
    virtual void on_wave_ended(clock::time_point now, int32_t ubatch) { (void) now; (void) ubatch; }
    // a wave was served: the strategy's prefetches
    virtual void after_wave(const served_wave & w) { (void) w; }
    // the last token is about to be redone with its whole top-k (MoBiLE's big pass): prefetches
    // for it; returns how many (expert, layer) it asked for
    virtual int before_redo() { return 0; }
    // calibration's path statistics (EdgeMoE): a strategy that predicts from them keeps them
    virtual void set_path_statistics(std::shared_ptr<const path_predictor> paths) { (void) paths; }
};

// What the strategies for these options need predicted: the depths ahead whose guesses the
// routing recorder scores, and how many layers ahead the stacked routers predict (0: no predictor).
struct prediction_needs {
    int scored_depths = 0;
    int router_depth = 0;
};
prediction_needs predictions_needed(const expert_options & o, bool trace_routing, bool has_low);

// A residency's strategies, run in order; each call goes to every one.
class prefetch_strategies {
public:
    explicit prefetch_strategies(const prefetch_env & env);

    void on_ubatch() { for (auto & s : all_) s->on_ubatch(); }
    void on_routing(const moe_layer_layout & l, const std::vector<int32_t> & ids, bool little) {
        for (auto & s : all_) s->on_routing(l, ids, little);
    }
    void on_layer_began(prefetch_strategy::clock::time_point t0, int32_t ubatch) { for (auto & s : all_) s->on_layer_began(t0, ubatch); }
    void on_experts_read(int n, double ms) { for (auto & s : all_) s->on_experts_read(n, ms); }
    void on_wave_ended(prefetch_strategy::clock::time_point now, int32_t ubatch) { for (auto & s : all_) s->on_wave_ended(now, ubatch); }
    void after_wave(const served_wave & w) { for (auto & s : all_) s->after_wave(w); }
    int before_redo();
    void set_path_statistics(const std::shared_ptr<const path_predictor> & paths) { for (auto & s : all_) s->set_path_statistics(paths); }

private:
    std::vector<std::unique_ptr<prefetch_strategy>> all_;
};

// the strategies, a file each
std::unique_ptr<prefetch_strategy> make_router_prefetch(const prefetch_env & env, bool fate);  // prefetch-router.cpp
std::unique_ptr<prefetch_strategy> make_path_prefetch(const prefetch_env & env);               // prefetch-paths.cpp
std::unique_ptr<prefetch_strategy> make_read_ahead(const prefetch_env & env);                  // prefetch-read-ahead.cpp
std::unique_ptr<prefetch_strategy> make_prefill_guess(const prefetch_env & env);               // prefetch-prefill-guess.cpp
std::unique_ptr<prefetch_strategy> make_big_little_prefetch(const prefetch_env & env);         // prefetch-big-little.cpp
std::unique_ptr<prefetch_strategy> make_prefetch_trial(const prefetch_env & env);              // prefetch-trial.cpp

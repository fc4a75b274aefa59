#include "prefetch-strategy.h"

#include "expert-layout.h"
#include "prefetch-coordinator.h"

#include <algorithm>

const moe_layer_layout * served_wave::next_layer_to_read(const expert_layout & layout) const {
    if (next_wave_planned() || (planned_waves.size() > 1 && !pipelined)) return nullptr;
    const moe_layer_layout * after = layout.after(layer);
    return after && needs_most_experts(n_tokens, layout.n_expert_used, layout.n_expert) ? after : nullptr;
}

prediction_needs predictions_needed(const expert_options & o, bool trace_routing, bool has_low) {
    // HOBBIT's walk: prefetch_depth layers; Fate: the next layer; EdgeMoE: the next layer's guess
    // from its path statistics, no routers; none: the next layer with tracing (calibration scores
    // the guesses) or with LOW copies (Fate's prefill guess plans the next layer from them)
    switch (o.prefetch) {
        case prefetch_mode::hobbit:  return { std::max(1, o.prefetch_depth), std::max(1, o.prefetch_depth) };
        case prefetch_mode::fate:    return { 1, 1 };
        case prefetch_mode::edgemoe: return { 1, 0 };
        case prefetch_mode::none:    return { trace_routing || has_low ? 1 : 0, trace_routing || has_low ? 1 : 0 };
    }
    return {};
}

prefetch_strategies::prefetch_strategies(const prefetch_env & env) {
    // decode: the prefetcher --prefetch names
    switch (env.options.prefetch) {
        case prefetch_mode::none:    break;
        case prefetch_mode::hobbit:  all_.push_back(make_router_prefetch(env, /*fate*/ false)); break;
        case prefetch_mode::fate:    all_.push_back(make_router_prefetch(env, /*fate*/ true)); break;
        case prefetch_mode::edgemoe: all_.push_back(make_path_prefetch(env)); break;
    }
    // whether it makes the decode faster, else it stops (lossless only); where a time may not judge,
    // whether it reads more than the run would without it (prefetch-ledger.h)
    if (env.options.prefetch != prefetch_mode::none && env.coordinator.timed()) all_.push_back(make_prefetch_trial(env));
    if (env.options.prefetch != prefetch_mode::none && !env.coordinator.timed() && env.layout.high_bytes > 0) {
        env.coordinator.count_reads((double) env.layout.low_bytes / env.layout.high_bytes);
    }
    // prefill, and MoBiLE's redone tokens: whatever --prefetch says
    all_.push_back(make_read_ahead(env));
    all_.push_back(make_prefill_guess(env));
    all_.push_back(make_big_little_prefetch(env));
}

int prefetch_strategies::before_redo() {
    int asked = 0;
    for (auto & s : all_) asked += s->before_redo();
    return asked;
}

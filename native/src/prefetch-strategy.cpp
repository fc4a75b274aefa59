#include "prefetch-strategy.h"

#include "expert-layout.h"

const moe_layer_layout * served_wave::next_layer_to_read(const expert_layout & layout) const {
    if (next_wave_planned() || (planned_waves.size() > 1 && !pipelined)) return nullptr;
    const moe_layer_layout * after = layout.after(layer);
    return after && needs_most_experts(n_tokens, layout.n_expert_used, layout.n_expert) ? after : nullptr;
}

prefetch_strategies::prefetch_strategies(const prefetch_env & env) {
    // decode: the prefetcher --prefetch names
    switch (env.options.prefetch) {
        case prefetch_mode::none:    break;
        case prefetch_mode::hobbit:  all_.push_back(make_router_prefetch(env, /*fate*/ false)); break;
        case prefetch_mode::fate:    all_.push_back(make_router_prefetch(env, /*fate*/ true)); break;
        case prefetch_mode::edgemoe: all_.push_back(make_path_prefetch(env)); break;
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

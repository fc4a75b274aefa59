#include "expert-options.h"

#include <cstdio>
#include <stdexcept>
#include <string>

namespace {
std::string number(double x) {
    char buf[32];
    snprintf(buf, sizeof(buf), "%g", x);
    return buf;
}
}  // namespace

void check_expert_options(const expert_options & o) {
    auto require = [](bool ok, const std::string & why) { if (!ok) throw std::invalid_argument(why); };
    // a thread each: 100,000 of them took minutes to start (an NVMe queue keeps far fewer busy)
    constexpr int kMaxIoThreads = 256;
    require(o.io_threads >= 1 && o.io_threads <= kMaxIoThreads, "io_threads must be an integer in 1.." +
            std::to_string(kMaxIoThreads) + ", got " + std::to_string(o.io_threads));
    require(o.prefetch_depth >= 1, "prefetch_depth must be a positive integer, got " + std::to_string(o.prefetch_depth));
    require(o.low_cache > 0 && o.low_cache < 1, "low_cache must be a fraction in (0, 1), got " + number(o.low_cache));
    require(o.t1 >= 0 && o.t1 <= 1, "t1 must be between 0 and 1, got " + number(o.t1));
    require(o.t2 >= 0 && o.t2 <= 1, "t2 must be between 0 and 1, got " + number(o.t2));
    require(o.t1 <= o.t2, "t1 (" + number(o.t1) + ") must not exceed t2 (" + number(o.t2) + ")");
    require(o.fate_percentile >= 0 && o.fate_percentile <= 1, "fate_percentile must be between 0 and 1, got " + number(o.fate_percentile));
    require(o.fate_extra >= -1, "fate_extra must be -1 (the default) or a count");
    require(o.fate_shallow >= -1, "fate_shallow must be -1 (the first sixth) or a count of layers");
    require(o.prefill_low_share >= 0 && o.prefill_low_share < 1,
            "prefill_low_share must be a fraction in [0, 1), got " + number(o.prefill_low_share));
    require(o.big_little == 0 || (o.big_little > 0 && o.big_little < 1),
            "big_little must be 0 (off) or a probability threshold between 0 and 1, got " + number(o.big_little));
    require(o.link_share == -1 || (o.link_share >= 0 && o.link_share <= 1),
            "link_share must be between 0 and 1, or -1 (from the rates measured at load and as the decode runs), got " + number(o.link_share));
    require(o.cache_routing >= 0 && o.cache_routing <= 1,
            "cache_routing must be between 0 (off) and 1 (a cached expert always first), got " + number(o.cache_routing));
    require(o.stand_in >= 0 && o.stand_in <= 1,
            "stand_in must be a quantile between 0 (off) and 1, got " + number(o.stand_in));
    require(o.cache_routing == 0 || o.stand_in == 0,
            "cache_routing and stand_in are two rules for the same choice: give one of them");
    float sum = 0;
    for (float w : o.policy_weights) { require(w >= 0, "policy weights must be non-negative"); sum += w; }
    require(sum > 0, "policy weights must have a positive sum");
}

void check_options_fit(const expert_options & o, bool has_device, bool has_low, int n_expert_used,
                       const std::string & fixed_routing) {
    if ((o.mode == compute_mode::cpu) != !has_device) {
        throw std::invalid_argument(has_device ? "--mode cpu takes no device" : std::string("--mode ") + name_of(o.mode) +
                                    " needs a GPU device (a build with GGML_VULKAN=1 or GGML_CUDA=1)");
    }
    if (o.static_precision && !has_low) {
        throw std::invalid_argument("static_precision needs LOW expert copies (a multi-precision GGUF or low_from)");
    }
    if (o.big_little > 0 && n_expert_used < 2) {
        throw std::invalid_argument("big_little needs a model that routes each token to 2 or more experts");
    }
    if ((o.cache_routing > 0 || o.stand_in > 0) && !fixed_routing.empty()) {
        throw std::invalid_argument(std::string(o.cache_routing > 0 ? "cache_routing" : "stand_in") +
                                    " changes which experts a token uses, and this model's experts need the "
                                    "router's own choice: " + fixed_routing);
    }
}

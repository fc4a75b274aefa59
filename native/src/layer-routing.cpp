#include "layer-routing.h"

#include "ggml.h"

bool reads_weights(const layer_rules & rules, bool big_little, bool tracing) {
    return rules.precision.use_low || rules.precision.use_skip || big_little || rules.cache_routing > 0 ||
           !rules.stand_ins.empty() || tracing;
}

layer_routing read_routing(const ggml_tensor * ids, const ggml_tensor * weights) {
    GGML_ASSERT(ids->type == GGML_TYPE_I32 && (!weights || weights->type == GGML_TYPE_F32));
    const int64_t k = ids->ne[0], n_tokens = ids->ne[1];
    layer_routing r{ std::vector<int32_t>(n_tokens * k), std::vector<float>(n_tokens * k, 0.0f) };
    for (int64_t t = 0; t < n_tokens; t++) {
        for (int64_t i = 0; i < k; i++) {
            r.ids[t * k + i] = *(const int32_t *) ((const char *) ids->data + i * ids->nb[0] + t * ids->nb[1]);
            if (weights) r.weights[t * k + i] = *(const float *) ((const char *) weights->data + i * weights->nb[1] + t * weights->nb[2]);
        }
    }
    return r;
}

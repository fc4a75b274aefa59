// Sampler: llama.cpp's sampler chain, in the order llama.cpp's own tools use
// (penalties -> top-k -> top-p -> min-p -> temperature -> dist; greedy when temperature <= 0).
#include "native.h"

#include "llama.h"

Sampler::~Sampler() {
    if (chain) llama_sampler_free(chain);
}

namespace {

void create(Sampler * self, const Model & model, float temperature, int top_k, float top_p, float min_p,
            float repeat_penalty, int penalty_last_n, uint32_t seed) {
    llama_sampler_chain_params params = llama_sampler_chain_default_params();
    params.no_perf = true;
    llama_sampler * chain = llama_sampler_chain_init(params);
    const llama_vocab * vocab = llama_model_get_vocab(model.model);
    if (repeat_penalty != 1.0f && penalty_last_n != 0) {
        llama_sampler_chain_add(chain, llama_sampler_init_penalties(
            llama_vocab_n_tokens(vocab), penalty_last_n, repeat_penalty, 0.0f, 0.0f));
    }
    if (temperature <= 0.0f) {
        llama_sampler_chain_add(chain, llama_sampler_init_greedy());
    } else {
        if (top_k > 0) llama_sampler_chain_add(chain, llama_sampler_init_top_k(top_k));
        if (top_p < 1.0f) llama_sampler_chain_add(chain, llama_sampler_init_top_p(top_p, 1));
        if (min_p > 0.0f) llama_sampler_chain_add(chain, llama_sampler_init_min_p(min_p, 1));
        llama_sampler_chain_add(chain, llama_sampler_init_temp(temperature));
        llama_sampler_chain_add(chain, llama_sampler_init_dist(seed));
    }
    new (self) Sampler();
    self->chain = chain;
}

}  // namespace

void register_sampler(nb::module_ & m) {
    nb::class_<Sampler>(m, "Sampler")
        .def("__init__", &create, nb::arg("model"), nb::arg("temperature"), nb::arg("top_k"),
             nb::arg("top_p"), nb::arg("min_p"), nb::arg("repeat_penalty"), nb::arg("penalty_last_n"),
             nb::arg("seed"))
        // Samples from the logits of output i of the last llama_decode (-1: its last) and records
        // the pick (for penalties).
        .def("sample", [](Sampler & s, Context & c, int i) { return llama_sampler_sample(s.chain, c.ctx, i); },
             nb::arg("context"), nb::arg("i") = -1)
        .def("accept", [](Sampler & s, llama_token t) { llama_sampler_accept(s.chain, t); }, nb::arg("token"))
        .def("reset", [](Sampler & s) { llama_sampler_reset(s.chain); });
}

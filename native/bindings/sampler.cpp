// Sampler: llama.cpp's sampler chain, in the order llama.cpp's own tools use
// (penalties -> grammar -> top-k -> top-p -> min-p -> temperature -> dist; greedy when
// temperature <= 0). The grammar (GBNF, llama.cpp's grammar sampler) comes right after the
// penalties, as in llama-cpp-python's chain: only tokens it allows reach the others.
#include "native.h"

#include "llama.h"

Sampler::~Sampler() {
    if (chain) llama_sampler_free(chain);
}

namespace {

void create(Sampler * self, const Model & model, float temperature, int top_k, float top_p, float min_p,
            float repeat_penalty, int penalty_last_n, uint32_t seed, const std::string & grammar) {
    llama_sampler_chain_params params = llama_sampler_chain_default_params();
    params.no_perf = true;
    llama_sampler * chain = llama_sampler_chain_init(params);
    const llama_vocab * vocab = llama_model_get_vocab(model.model);
    llama_sampler * penalties = nullptr;
    if (repeat_penalty != 1.0f && penalty_last_n != 0) {
        penalties = llama_sampler_init_penalties(llama_vocab_n_tokens(vocab), penalty_last_n, repeat_penalty, 0.0f, 0.0f);
        llama_sampler_chain_add(chain, penalties);
    }
    if (!grammar.empty()) {
        log_clear_recent();
        llama_sampler * constrained = llama_sampler_init_grammar(vocab, grammar.c_str(), "root");
        if (!constrained) {
            llama_sampler_free(chain);
            const std::string why = log_recent_errors();
            throw nb::value_error(("the grammar does not parse" + (why.empty() ? "" : ": " + why)).c_str());
        }
        llama_sampler_chain_add(chain, constrained);
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
    self->penalties = penalties;
}

}  // namespace

void register_sampler(nb::module_ & m) {
    nb::class_<Sampler>(m, "Sampler")
        .def("__init__", &create, nb::arg("model"), nb::arg("temperature"), nb::arg("top_k"),
             nb::arg("top_p"), nb::arg("min_p"), nb::arg("repeat_penalty"), nb::arg("penalty_last_n"),
             nb::arg("seed"), nb::arg("grammar") = "")
        // Samples from the logits of output i of the last llama_decode (-1: its last) and records
        // the pick (for the penalties and the grammar).
        .def("sample", [](Sampler & s, Context & c, int i) { return llama_sampler_sample(s.chain, c.ctx, i); },
             nb::arg("context"), nb::arg("i") = -1)
        // A token of the prompt, for the penalties only: the grammar constrains the generated text.
        .def("accept_prompt", [](Sampler & s, llama_token t) { if (s.penalties) llama_sampler_accept(s.penalties, t); },
             nb::arg("token"))
        .def("reset", [](Sampler & s) { llama_sampler_reset(s.chain); });
}

// Sampler: llama.cpp's sampler chain, in the order llama.cpp's own tools use
// (logit bias -> penalties -> grammar -> DRY -> top-n-sigma -> top-k -> typical -> top-p -> min-p ->
// XTC -> temperature (dynamic with a range) -> dist; greedy after DRY and XTC when temperature <= 0;
// with Mirostat, temperature -> mirostat in place of the truncations and dist, as llama.cpp's common
// sampler). A sampler left at its "off" value is not in the chain. The grammar (GBNF, llama.cpp's
// grammar sampler) comes right after the penalties, as in llama-cpp-python's chain: only tokens it
// allows reach the others. An order given (llama-server's `samplers`, llama.cpp's --samplers) is
// llama.cpp's common sampler's: logit bias, grammar, those samplers in that order, dist. A reasoning
// budget (llama.cpp's --reasoning-budget, common/reasoning-budget.cpp) comes first, as in llama.cpp's
// common sampler: once a thought has taken its tokens, it forces the message and the end-of-thinking tag.
#include "native.h"

#include "llama.h"
#include "reasoning-budget.h"

#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <functional>
#include <unistd.h>

Sampler::~Sampler() {
    if (chain) llama_sampler_free(chain);
}

namespace {

// What f() writes to stderr, kept from the terminal: llama.cpp's grammar parser says why a grammar
// does not parse with fprintf(stderr) (llama_grammar_parser::parse), not through its log.
std::string stderr_of(const std::function<void()> & f) {
    fflush(stderr);
    FILE * caught = tmpfile();
    const int saved = caught ? dup(2) : -1;
    if (saved < 0) {
        if (caught) fclose(caught);
        f();
        return "";
    }
    dup2(fileno(caught), 2);
    f();
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    std::string text;
    rewind(caught);
    for (int c; (c = fgetc(caught)) != EOF;) text += (char) c;
    fclose(caught);
    return text;
}

// Where a grammar starts, for llama.cpp's tool call formats (chat.cpp's ChatTurn): lazy, it constrains the
// text from the first trigger (a pattern the text matches, or a token) on; prefill, text the grammar
// has seen already (the generation prompt, which the template put in the prompt).
struct GrammarStart {
    bool lazy = false;
    std::vector<std::string> patterns;
    std::vector<llama_token> tokens;
    std::string prefill;
};

// text's tokens, special tokens parsed, no BOS (common_tokenize(vocab, text, false, true)).
std::vector<llama_token> tokens_of(const llama_vocab * vocab, const std::string & text) {
    std::vector<llama_token> tokens(text.size() + 2);
    const int n = llama_tokenize(vocab, text.data(), (int32_t) text.size(), tokens.data(), (int32_t) tokens.size(),
                                 false, true);
    tokens.resize(n < 0 ? 0 : n);
    return tokens;
}

// prefill's tokens as common/sampling.cpp gives them to a tool call grammar (a space some tokenizers
// put before a first special token left out).
std::vector<llama_token> prefill_tokens(const llama_vocab * vocab, const std::string & text) {
    std::vector<llama_token> tokens = tokens_of(vocab, text);
    if (!tokens.empty() && !text.empty() && !std::isspace((unsigned char) text[0])) {
        char piece[256];
        const int len = llama_token_to_piece(vocab, tokens[0], piece, sizeof(piece), 0, true);
        if (len > 0 && std::isspace((unsigned char) piece[0])) tokens.erase(tokens.begin());
    }
    return tokens;
}

// The grammar sampler of GBNF text; ValueError saying why it does not parse.
llama_sampler * grammar_sampler(const llama_vocab * vocab, const std::string & grammar, const GrammarStart & start) {
    log_clear_recent();
    llama_sampler * sampler = nullptr;
    std::string why = stderr_of([&] {
        if (!start.lazy) {
            sampler = llama_sampler_init_grammar(vocab, grammar.c_str(), "root");
            return;
        }
        std::vector<const char *> patterns;
        for (const auto & p : start.patterns) patterns.push_back(p.c_str());
        sampler = llama_sampler_init_grammar_lazy_patterns(vocab, grammar.c_str(), "root", patterns.data(),
                                                           patterns.size(), start.tokens.data(), start.tokens.size());
    });
    if (sampler && !start.lazy) {
        try {
            for (llama_token t : prefill_tokens(vocab, start.prefill)) llama_sampler_accept(sampler, t);
        } catch (const std::exception & e) {
            llama_sampler_free(sampler);
            throw nb::value_error((std::string("the grammar does not take the generation prompt: ") + e.what()).c_str());
        }
    }
    if (sampler) return sampler;
    why = why.substr(0, why.find('\n'));  // "parse: error parsing grammar: ...", then the grammar
    why = why.substr(why.find(": ") == std::string::npos ? 0 : why.find(": ") + 2);
    const std::string logged = log_recent_errors();  // "failed to parse grammar", a missing root
    throw nb::value_error((why.empty() ? logged : why).c_str());
}

void create(Sampler * self, const Model & model, float temperature, int top_k, float top_p, float min_p,
            float typical_p, float repeat_penalty, float frequency_penalty, float presence_penalty,
            int penalty_last_n, uint32_t seed, const std::string & grammar,
            const std::vector<std::pair<llama_token, float>> & logit_bias, int mirostat, float mirostat_tau,
            float mirostat_eta, bool grammar_lazy, const std::vector<std::string> & trigger_patterns,
            const std::vector<llama_token> & trigger_tokens, const std::string & grammar_prefill,
            float dry_multiplier, float dry_base, int dry_allowed_length, int dry_penalty_last_n,
            const std::vector<std::string> & dry_sequence_breakers, float xtc_probability, float xtc_threshold,
            float top_n_sigma, float dynatemp_range, float dynatemp_exponent, const std::vector<std::string> & order,
            int reasoning_budget, const std::string & thinking_start, const std::vector<std::string> & thinking_ends,
            const std::string & reasoning_message, bool reasoning_control) {
    const GrammarStart start{grammar_lazy, trigger_patterns, trigger_tokens, grammar_prefill};
    const llama_vocab * vocab = llama_model_get_vocab(model.model);
    const int n_vocab = llama_vocab_n_tokens(vocab);
    std::vector<llama_logit_bias> biases;
    for (const auto & [token, bias] : logit_bias) biases.push_back({token, bias});
    std::vector<llama_token> biased;
    for (const auto & b : biases) biased.push_back(b.token);
    check_token_ids(biased, n_vocab);
    if (mirostat < 0 || mirostat > 2) throw nb::value_error("mirostat must be 0, 1 or 2");
    llama_sampler_chain_params params = llama_sampler_chain_default_params();
    params.no_perf = true;
    llama_sampler * chain = llama_sampler_chain_init(params);
    // reasoning_control: a budget without a limit, which end_reasoning() can end (llama-server's)
    llama_sampler * budget = nullptr;
    if ((reasoning_budget >= 0 || reasoning_control) && !thinking_start.empty() && !thinking_ends.empty()) {
        std::vector<llama_tokens> ends;
        for (const auto & tag : thinking_ends) ends.push_back(tokens_of(vocab, tag));
        llama_tokens forced = tokens_of(vocab, reasoning_message);
        forced.insert(forced.end(), ends.front().begin(), ends.front().end());
        budget = common_reasoning_budget_init(vocab, {tokens_of(vocab, thinking_start)}, ends, forced,
                                              reasoning_budget < 0 ? INT32_MAX : reasoning_budget);
        // the generation prompt may open the thought (a template ending in <think>)
        for (llama_token t : prefill_tokens(vocab, grammar_prefill)) llama_sampler_accept(budget, t);
        llama_sampler_chain_add(chain, budget);
    }
    if (!biases.empty()) llama_sampler_chain_add(chain, llama_sampler_init_logit_bias(n_vocab, (int32_t) biases.size(), biases.data()));
    // an order given (each name once): llama.cpp's common sampler, its samplers in that order
    const bool ordered = !order.empty() && mirostat == 0;
    auto in_order = [&](const char * name) { return std::find(order.begin(), order.end(), name) != order.end(); };
    llama_sampler * penalties = nullptr;
    if ((repeat_penalty != 1.0f || frequency_penalty != 0.0f || presence_penalty != 0.0f) && penalty_last_n != 0 &&
        (!ordered || in_order("penalties"))) {
        penalties = llama_sampler_init_penalties(n_vocab, penalty_last_n, repeat_penalty, frequency_penalty,
                                                 presence_penalty);
        if (!ordered) llama_sampler_chain_add(chain, penalties);
    }
    if (!grammar.empty()) {
        try {
            llama_sampler_chain_add(chain, grammar_sampler(vocab, grammar, start));
        } catch (...) {
            if (ordered && penalties) llama_sampler_free(penalties);
            llama_sampler_free(chain);
            throw;
        }
    }
    // DRY ("don't repeat yourself"): a token extending a repetition of the recent text longer than
    // allowed_length is penalized multiplier * base ^ (length - allowed_length); breakers end one
    llama_sampler * repetition = nullptr;
    if (mirostat == 0 && dry_multiplier != 0.0f && dry_base >= 1.0f && dry_penalty_last_n != 0 &&
        (!ordered || in_order("dry"))) {
        std::vector<const char *> breakers;
        for (const auto & b : dry_sequence_breakers) breakers.push_back(b.c_str());
        repetition = llama_sampler_init_dry(vocab, dry_multiplier, dry_base, dry_allowed_length, dry_penalty_last_n,
                                            breakers.data(), breakers.size());
        if (!ordered) llama_sampler_chain_add(chain, repetition);
    }
    // XTC draws with its own generator, seeded as the distribution's (llama.cpp's common sampler)
    auto add_xtc = [&] {
        if (xtc_probability > 0.0f) llama_sampler_chain_add(chain, llama_sampler_init_xtc(xtc_probability, xtc_threshold, 1, seed));
    };
    if (ordered) {
        for (const auto & name : order) {  // the names are checked in Python (generation.SAMPLER_NAMES)
            if (name == "penalties" && penalties) llama_sampler_chain_add(chain, penalties);
            else if (name == "dry" && repetition) llama_sampler_chain_add(chain, repetition);
            else if (name == "top_n_sigma") llama_sampler_chain_add(chain, llama_sampler_init_top_n_sigma(top_n_sigma));
            else if (name == "top_k") llama_sampler_chain_add(chain, llama_sampler_init_top_k(top_k));
            else if (name == "typ_p") llama_sampler_chain_add(chain, llama_sampler_init_typical(typical_p, 1));
            else if (name == "top_p") llama_sampler_chain_add(chain, llama_sampler_init_top_p(top_p, 1));
            else if (name == "min_p") llama_sampler_chain_add(chain, llama_sampler_init_min_p(min_p, 1));
            else if (name == "xtc") add_xtc();
            else if (name == "temperature") llama_sampler_chain_add(chain, llama_sampler_init_temp_ext(temperature, dynatemp_range, dynatemp_exponent));
            else if (name == "infill") llama_sampler_chain_add(chain, llama_sampler_init_infill(vocab));
        }
        llama_sampler_chain_add(chain, llama_sampler_init_dist(seed));
    } else if (temperature <= 0.0f) {
        add_xtc();
        llama_sampler_chain_add(chain, llama_sampler_init_greedy());
    } else if (mirostat != 0) {
        llama_sampler_chain_add(chain, llama_sampler_init_temp(temperature));
        llama_sampler_chain_add(chain, mirostat == 1
            ? llama_sampler_init_mirostat(n_vocab, seed, mirostat_tau, mirostat_eta, 100)  // m = 100: llama.cpp's
            : llama_sampler_init_mirostat_v2(seed, mirostat_tau, mirostat_eta));
    } else {
        if (top_n_sigma > 0.0f) llama_sampler_chain_add(chain, llama_sampler_init_top_n_sigma(top_n_sigma));
        if (top_k > 0) llama_sampler_chain_add(chain, llama_sampler_init_top_k(top_k));
        if (typical_p < 1.0f) llama_sampler_chain_add(chain, llama_sampler_init_typical(typical_p, 1));
        if (top_p < 1.0f) llama_sampler_chain_add(chain, llama_sampler_init_top_p(top_p, 1));
        if (min_p > 0.0f) llama_sampler_chain_add(chain, llama_sampler_init_min_p(min_p, 1));
        add_xtc();
        llama_sampler_chain_add(chain, llama_sampler_init_temp_ext(temperature, dynatemp_range, dynatemp_exponent));
        llama_sampler_chain_add(chain, llama_sampler_init_dist(seed));
    }
    new (self) Sampler();
    self->chain = chain;
    self->penalties = penalties;
    self->repetition = repetition;
    self->reasoning = budget;
}

// The chain's pick from logits (n_vocab of them), recorded (for the penalties and the grammar), as
// llama_sampler_sample picks from a context's, without the GIL (a grammar's stacks can take long). A
// pick no token is allowed for (a grammar nothing satisfies, such as an empty range [5-1], or every
// logit -inf) is a ValueError: llama.cpp takes a ruled-out token then, and its grammar aborts on an
// end of generation or throws on another.
llama_token pick(Sampler & s, const float * logits, int n_vocab) {
    gil_released release;
    s.candidates.resize(n_vocab);
    for (int t = 0; t < n_vocab; ++t) s.candidates[t] = {t, logits[t], 0.0f};
    llama_token_data_array array = {s.candidates.data(), s.candidates.size(), -1, false};
    llama_sampler_apply(s.chain, &array);
    if (array.selected < 0 || array.selected >= (int64_t) array.size || !(array.data[array.selected].logit > -INFINITY)) {
        throw nb::value_error("no token is allowed here: the grammar (or the logits) rule out every one; a grammar "
                              "nothing satisfies, such as an empty character range [5-1]?");
    }
    const llama_token token = array.data[array.selected].id;
    llama_sampler_accept(s.chain, token);
    return token;
}

// Samples from logits given (llama-cpp-python's logits processors changed them).
llama_token sample_logits(Sampler & s, nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu> logits,
                          int n_vocab) {
    if ((int) logits.shape(0) != n_vocab) {
        throw nb::value_error(("the logits have " + std::to_string(logits.shape(0)) + " values, the vocabulary " +
                               std::to_string(n_vocab) + " tokens").c_str());
    }
    return pick(s, logits.data(), n_vocab);
}

// Samples from the logits of output i of the context's last llama_decode (-1: its last).
llama_token sample(Sampler & s, Context & c, int i) {
    const float * logits = llama_get_logits_ith(c.ctx, i);
    if (!logits) throw nb::value_error(("the last decode has no output " + std::to_string(i)).c_str());
    return pick(s, logits, c.n_vocab);
}

}  // namespace

void register_sampler(nb::module_ & m) {
    nb::class_<Sampler>(m, "Sampler")
        .def("__init__", &create, nb::arg("model"), nb::arg("temperature"), nb::arg("top_k"),
             nb::arg("top_p"), nb::arg("min_p"), nb::arg("typical_p"), nb::arg("repeat_penalty"),
             nb::arg("frequency_penalty"), nb::arg("presence_penalty"), nb::arg("penalty_last_n"),
             nb::arg("seed"), nb::arg("grammar") = "", nb::arg("logit_bias") = std::vector<std::pair<llama_token, float>>(),
             nb::arg("mirostat") = 0, nb::arg("mirostat_tau") = 5.0f, nb::arg("mirostat_eta") = 0.1f,
             nb::arg("grammar_lazy") = false, nb::arg("trigger_patterns") = std::vector<std::string>(),
             nb::arg("trigger_tokens") = std::vector<llama_token>(), nb::arg("grammar_prefill") = "",
             nb::arg("dry_multiplier") = 0.0f, nb::arg("dry_base") = 1.75f, nb::arg("dry_allowed_length") = 2,
             nb::arg("dry_penalty_last_n") = 64, nb::arg("dry_sequence_breakers") = std::vector<std::string>(),
             nb::arg("xtc_probability") = 0.0f, nb::arg("xtc_threshold") = 0.1f, nb::arg("top_n_sigma") = -1.0f,
             nb::arg("dynatemp_range") = 0.0f, nb::arg("dynatemp_exponent") = 1.0f,
             nb::arg("order") = std::vector<std::string>(), nb::arg("reasoning_budget") = -1,
             nb::arg("thinking_start") = "", nb::arg("thinking_ends") = std::vector<std::string>(),
             nb::arg("reasoning_message") = "", nb::arg("reasoning_control") = false)
        // Samples from the logits of output i of the last llama_decode (-1: its last) and records
        // the pick (for the penalties and the grammar).
        .def("sample", &sample, nb::arg("context"), nb::arg("i") = -1)
        .def("sample_logits", [](Sampler & s, Context & c, nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu> logits) {
                 return sample_logits(s, logits, c.n_vocab);
             }, nb::arg("context"), nb::arg("logits"))
        // A token of the prompt, for the penalties and DRY only: the grammar constrains the generated text.
        .def("accept_prompt", [](Sampler & s, llama_token t) {
                 for (llama_sampler * seen : {s.penalties, s.repetition}) if (seen) llama_sampler_accept(seen, t);
             }, nb::arg("token"))
        .def("reset", [](Sampler & s) { llama_sampler_reset(s.chain); })
        // Ends the thought being written now (its budget's message and end tag forced from the next
        // pick on); false where none is (llama-server's reasoning_end control).
        .def("end_reasoning", [](Sampler & s) { return common_reasoning_budget_force(s.reasoning); });
}

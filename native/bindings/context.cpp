// Context: a llama_context (KV cache, compute buffers) and decoding batches of tokens.
#include "native.h"

#include "llama.h"
#include "llama-ext.h"
#include "../src/expert-residency.h"
#include "../src/expert-store.h"

#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <utility>
#include <vector>

Context::~Context() {
    if (ctx) llama_free(ctx);
}

namespace {

using Logits = nb::ndarray<nb::numpy, float, nb::ndim<2>>;
using Embeddings = Logits;
using Given = std::optional<float>;  // a RoPE parameter; unset: llama.cpp's default (the model's)

void set_if_given(float & field, const Given & value) {
    if (value) field = *value;
}

// What sizes a context's memory: n_ctx cells, n_seq_max sequences (each with a KV cache of its own
// of n_ctx / n_seq_max cells, llama-server's -np), ubatches, the KV type, flash attention, swa_full.
llama_context_params memory_params(uint32_t n_ctx, uint32_t n_batch, uint32_t n_ubatch, int flash_attn, int kv_type,
                                   uint32_t n_seq_max, bool swa_full) {
    llama_context_params params = llama_context_default_params();
    params.swa_full = swa_full;  // false: sliding-window layers keep their window's positions alone
    params.n_ctx = n_ctx;
    params.n_seq_max = n_seq_max;
    params.n_batch = n_batch;
    params.n_ubatch = std::min(n_ubatch, n_batch);
    params.flash_attn_type = (llama_flash_attn_type) flash_attn;
    params.type_k = (ggml_type) kv_type;
    params.type_v = (ggml_type) kv_type;
    return params;
}

void create(Context * self, Model & model, uint32_t n_ctx, uint32_t n_batch, uint32_t n_ubatch,
            int n_threads, int n_threads_batch, int flash_attn, int kv_type, uint32_t n_seq_max,
            std::optional<int> rope_scaling_type, Given rope_freq_base, Given rope_freq_scale,
            std::optional<uint32_t> yarn_orig_ctx, Given yarn_ext_factor, Given yarn_attn_factor,
            Given yarn_beta_fast, Given yarn_beta_slow, const std::vector<std::pair<std::string, float>> & loras,
            std::optional<int> pooling_type, bool swa_full) {
    llama_context_params params = memory_params(n_ctx, n_batch, n_ubatch, flash_attn, kv_type, n_seq_max, swa_full);
    if (pooling_type) params.pooling_type = static_cast<enum llama_pooling_type>(*pooling_type);  // embed()'s rows; else the model's
    if (rope_scaling_type) params.rope_scaling_type = (llama_rope_scaling_type) *rope_scaling_type;
    if (yarn_orig_ctx) params.yarn_orig_ctx = *yarn_orig_ctx;
    set_if_given(params.rope_freq_base, rope_freq_base);
    set_if_given(params.rope_freq_scale, rope_freq_scale);
    set_if_given(params.yarn_ext_factor, yarn_ext_factor);
    set_if_given(params.yarn_attn_factor, yarn_attn_factor);
    set_if_given(params.yarn_beta_fast, yarn_beta_fast);
    set_if_given(params.yarn_beta_slow, yarn_beta_slow);
    params.n_threads = n_threads;
    params.n_threads_batch = n_threads_batch;
    params.no_perf = true;
    // Slot ids may be negative (a row a pass skips), which only the CPU's mul_mat_id skips (patch
    // 0004): a GPU backend must not be handed the expert ops of an offloaded model.
    if (model.residency) params.op_offload = false;
    log_clear_recent();
    llama_context * ctx;
    {
        gil_released release;
        ctx = llama_init_from_model(model.model, params);
    }
    if (!ctx) throw_with_log("failed to create a context");
    // LoRA adapters: loaded into the model (freed with it), applied by the context at their scales
    std::vector<llama_adapter_lora *> adapters;
    std::vector<float> scales;
    for (const auto & [path, scale] : loras) {
        log_clear_recent();
        llama_adapter_lora * adapter = llama_adapter_lora_init(model.model, path.c_str());
        if (!adapter) {
            llama_free(ctx);
            throw_with_log("failed to load the LoRA adapter " + path);
        }
        adapters.push_back(adapter);
        scales.push_back(scale);
    }
    if (!adapters.empty() && llama_set_adapters_lora(ctx, adapters.data(), adapters.size(), scales.data()) != 0) {
        llama_free(ctx);
        throw_with_log("failed to apply the LoRA adapters");
    }
    new (self) Context();
    self->ctx = ctx;
    self->model = &model;
    self->n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model.model));
}

void check_positions(const Context & self, int seq, int first, int last) {
    const int n_ctx = (int) llama_n_ctx_seq(self.ctx);
    if (first < 0 || last >= n_ctx) {
        throw nb::value_error(("positions " + std::to_string(first) + ".." + std::to_string(last) +
                               " do not fit the context of " + std::to_string(n_ctx) + " tokens").c_str());
    }
    if (seq < 0 || seq >= (int) llama_n_seq_max(self.ctx)) {
        throw nb::value_error(("sequence " + std::to_string(seq) + " out of range [0, " +
                               std::to_string(llama_n_seq_max(self.ctx)) + ")").c_str());
    }
}

// One llama_decode (without the GIL): its status, and why an expert failed to load ("" when none did).
std::pair<int32_t, std::string> run_decode(Context & self, const llama_batch & batch) {
    log_clear_recent();
    if (self.model->mapped_file) {
        try {
            self.model->mapped_file->check_unchanged();
        } catch (const std::runtime_error & e) {  // as a failed expert read: the KV cache is dropped
            llama_memory_clear(llama_get_memory(self.ctx), true);
            return { 0, self.model->path + ": " + e.what() };
        }
    }
    const int32_t status = llama_decode(self.ctx, batch);
    return { status, status == 0 ? take_residency_error(self) : std::string() };
}

void raise_if_failed(const std::pair<int32_t, std::string> & result) {
    if (!result.second.empty()) throw expert_load_error(result.second);
    if (result.first != 0) throw_with_log("llama_decode failed with status " + std::to_string(result.first));
}

// Tokens [start, start + count) of `tokens` into batch, at positions pos0 + start.. of sequence seq;
// outputs: every token's, else only the last of `tokens`.
void fill_batch(llama_batch & batch, const std::vector<llama_token> & tokens, int start, int count, int pos0, int seq,
                bool every_output) {
    batch.n_tokens = count;
    for (int i = 0; i < count; i++) {
        batch.token[i] = tokens[start + i];
        batch.pos[i] = pos0 + start + i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = seq;
        batch.logits[i] = every_output || (start + i == (int) tokens.size() - 1);
    }
}

// Decodes `tokens` at positions pos0.. of sequence seq, n_batch tokens per llama_decode.
// Returns the logits of every token ([n, n_vocab]) when all_logits, else of the last one ([1, n_vocab]).
Logits decode(Context & self, const std::vector<llama_token> & tokens, int pos0, bool all_logits, int seq) {
    const int n = (int) tokens.size();
    if (n == 0) throw nb::value_error("decode needs at least one token");
    check_positions(self, seq, pos0, pos0 + n - 1);
    check_token_ids(tokens, self.n_vocab);
    const int n_batch = (int) llama_n_batch(self.ctx);
    const size_t n_rows = all_logits ? n : 1;
    float * out = new float[n_rows * self.n_vocab];
    nb::capsule owner(out, [](void * p) noexcept { delete[] (float *) p; });

    std::pair<int32_t, std::string> result;
    {
        gil_released release;
        llama_batch batch = llama_batch_init(n_batch, 0, 1);
        for (int start = 0; start < n; start += n_batch) {
            const int count = std::min(n_batch, n - start);
            fill_batch(batch, tokens, start, count, pos0, seq, all_logits);
            result = run_decode(self, batch);
            if (result.first != 0 || !result.second.empty()) break;
            if (all_logits) {
                std::memcpy(out + (size_t) start * self.n_vocab, llama_get_logits(self.ctx),
                            sizeof(float) * count * self.n_vocab);
            } else if (start + count == n) {
                std::memcpy(out, llama_get_logits_ith(self.ctx, count - 1), sizeof(float) * self.n_vocab);
            }
        }
        llama_batch_free(batch);
    }
    raise_if_failed(result);
    return Logits(out, {n_rows, (size_t) self.n_vocab}, owner);
}

// One step of several sequences (or of one, a speculative guess checked) in one llama_decode: tokens[i]
// at positions[i] of sequence seqs[i], every one an output (Sampler.sample(context, i) picks from the
// i-th). Their experts load once, under the decode's rules, not a prompt's.
void decode_step(Context & self, const std::vector<llama_token> & tokens, const std::vector<int> & positions,
                 const std::vector<int> & seqs) {
    const int n = (int) tokens.size();
    if (n == 0 || positions.size() != tokens.size() || seqs.size() != tokens.size()) {
        throw nb::value_error("decode_step needs one position and one sequence per token, and a token");
    }
    if (n > (int) llama_n_batch(self.ctx)) {
        throw nb::value_error(("decode_step of " + std::to_string(n) + " tokens exceeds n_batch " +
                               std::to_string(llama_n_batch(self.ctx))).c_str());
    }
    check_token_ids(tokens, self.n_vocab);
    for (int i = 0; i < n; i++) check_positions(self, seqs[i], positions[i], positions[i]);
    std::pair<int32_t, std::string> result;
    {
        gil_released release;
        llama_batch batch = llama_batch_init(n, 0, 1);
        batch.n_tokens = n;
        for (int i = 0; i < n; i++) {
            batch.token[i] = tokens[i];
            batch.pos[i] = positions[i];
            batch.n_seq_id[i] = 1;
            batch.seq_id[i][0] = seqs[i];
            batch.logits[i] = true;
        }
        if (self.model->residency) self.model->residency->set_decode_batch(true);
        result = run_decode(self, batch);
        if (self.model->residency) self.model->residency->set_decode_batch(false);
        llama_batch_free(batch);
    }
    raise_if_failed(result);
}

// The embeddings of `tokens` evaluated at positions 0.. of sequence seq (which must hold nothing), in one
// llama_decode with the context's embeddings on for it: a row per token where the context pools none
// (the model's pooling type), else the sequence's pooled row. [rows, n_embd].
Embeddings embed(Context & self, const std::vector<llama_token> & tokens, int seq) {
    const int n = (int) tokens.size();
    if (n == 0) throw nb::value_error("embed needs at least one token");
    if (n > (int) llama_n_batch(self.ctx)) {
        throw nb::value_error(("embed of " + std::to_string(n) + " tokens exceeds n_batch " +
                               std::to_string(llama_n_batch(self.ctx))).c_str());
    }
    check_positions(self, seq, 0, n - 1);
    check_token_ids(tokens, self.n_vocab);
    const bool pooled = llama_pooling_type(self.ctx) != LLAMA_POOLING_TYPE_NONE;
    const size_t n_embd = (size_t) llama_model_n_embd(self.model->model);
    const size_t n_rows = pooled ? 1 : n;
    float * out = new float[n_rows * n_embd];
    nb::capsule owner(out, [](void * p) noexcept { delete[] (float *) p; });
    std::pair<int32_t, std::string> result;
    {
        gil_released release;
        llama_batch batch = llama_batch_init(n, 0, 1);
        fill_batch(batch, tokens, 0, n, 0, seq, true);
        llama_set_embeddings(self.ctx, true);
        result = run_decode(self, batch);
        llama_set_embeddings(self.ctx, false);
        llama_batch_free(batch);
        if (result.first == 0 && result.second.empty()) {
            for (size_t r = 0; r < n_rows; r++) {
                const float * row = pooled ? llama_get_embeddings_seq(self.ctx, seq) : llama_get_embeddings_ith(self.ctx, (int) r);
                std::memcpy(out + r * n_embd, row, sizeof(float) * n_embd);
            }
        }
    }
    raise_if_failed(result);
    return Embeddings(out, {n_rows, n_embd}, owner);
}

// What sequence seq holds (its KV cache), as llama_state_seq_get_data writes it; partial: only the
// memory that cannot drop a part (sliding-window caches, recurrent states), a context checkpoint's.
nb::bytes sequence_state(const Context & c, int seq, bool partial) {
    const llama_state_seq_flags flags = partial ? LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY : 0;
    std::vector<uint8_t> data(llama_state_seq_get_size_ext(c.ctx, seq, flags));
    log_clear_recent();
    const size_t n = llama_state_seq_get_data_ext(c.ctx, data.data(), data.size(), seq, flags);
    if (n == 0 && !data.empty()) throw_with_log("cannot read the sequence's state");
    return nb::bytes(data.data(), n);
}

// Sequence seq holds what sequence_state gave (of a context of the same model and settings).
void set_sequence_state(Context & c, int seq, const nb::bytes & data, bool partial) {
    const llama_state_seq_flags flags = partial ? LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY : 0;
    log_clear_recent();
    if (llama_state_seq_set_data_ext(c.ctx, (const uint8_t *) data.c_str(), data.size(), seq, flags) != data.size()) {
        throw_if_remote_lost();
        throw nb::value_error("the saved state does not fit this context (another model, or other settings)");
    }
}

// Whether sequence seq's KV cache holds the positions of tokens, each of the vocabulary: a damaged
// file can load. (A window-sized cache of sliding-window layers holds the last window's at least; a
// recurrent or hybrid model's state is one cell, at the last position.)
bool holds(const Context & c, int seq, const std::vector<llama_token> & tokens) {
    const llama_memory_t memory = llama_get_memory(c.ctx);
    const llama_pos n = (llama_pos) tokens.size(), first = llama_memory_seq_pos_min(memory, seq);
    const bool in_vocab = std::all_of(tokens.begin(), tokens.end(), [&](llama_token t) { return t >= 0 && t < c.n_vocab; });
    if (n == 0) return llama_memory_seq_pos_max(memory, seq) == -1;
    const llama_model * model = c.model->model;
    // the last positions the memory holds at least (0: all of them)
    const llama_pos kept = llama_model_is_recurrent(model) || llama_model_is_hybrid(model) ? 1 : llama_model_n_swa(model);
    return in_vocab && llama_memory_seq_pos_max(memory, seq) == n - 1 &&
           (kept == 0 ? first == 0 : first >= 0 && first <= std::max(0, n - kept));
}

// A session file, llama.cpp's (llama_state_save_file: its tokens, then the context's state: the KV
// cache): what llama-completion's --prompt-cache writes and reads, so either reads the other's.
void save_state_file(Context & c, const std::string & path, const std::vector<llama_token> & tokens) {
    log_clear_recent();
    bool ok;
    {
        gil_released release;
        ok = llama_state_save_file(c.ctx, path.c_str(), tokens.data(), tokens.size());
    }
    if (!ok) throw_with_log("cannot write the state file " + path);
}

// The context's state from a session file (replacing what it held); the tokens it was made of.
std::vector<llama_token> load_state_file(Context & c, const std::string & path) {
    std::vector<llama_token> tokens(llama_n_ctx(c.ctx));
    size_t n = 0;
    log_clear_recent();
    bool ok;
    {
        gil_released release;
        ok = llama_state_load_file(c.ctx, path.c_str(), tokens.data(), tokens.size(), &n);
    }
    if (c.model->residency) c.model->residency->start_sequence();  // a sequence begins anew, as after clear()
    llama_memory_t memory = llama_get_memory(c.ctx);
    if (!ok) {
        llama_memory_clear(memory, true);
        throw_with_log("cannot load the state file " + path + " (cut short, of another model, a larger context, or another -fa or KV cache type?)");
    }
    tokens.resize(n);
    if (!holds(c, 0, tokens)) {
        llama_memory_clear(memory, true);
        throw std::runtime_error("the state file " + path + " is damaged: its tokens and its state disagree");
    }
    return tokens;
}

// llama.cpp's own account of its buffers, per buffer type (e.g. "Vulkan0", "CPU")
std::vector<nb::dict> memory_breakdown(const Context & c) {
    std::vector<nb::dict> out;
    for (const auto & [buft, data] : llama_get_memory_breakdown(c.ctx)) {
        nb::dict d;
        d["buffer_type"] = ggml_backend_buft_name(buft);
        d["model"] = data.model;
        d["context"] = data.context;
        d["compute"] = data.compute;
        out.push_back(d);
    }
    return out;
}

// llama.cpp's memory of contexts of the model at path, one of each size in n_ctxs (its KV cache and
// recurrent states, in every buffer type), as llama.cpp's own memory fit (common/fit.cpp) measures
// it: the model's header and the contexts created without allocating (no_alloc), the sizes they
// would take read back. So every layout llama.cpp has is counted as it is (sliding windows, MLA's K
// without V, hybrid models' recurrent layers). kv_overrides: as Model's.
std::vector<size_t> context_memory_bytes(const std::string & path, const std::vector<std::string> & kv_overrides,
                                         const std::vector<uint32_t> & n_ctxs, uint32_t n_batch, uint32_t n_ubatch,
                                         int flash_attn, int kv_type, uint32_t n_seq_max, bool swa_full) {
    llama_model_params model_params = llama_model_default_params();
    model_params.no_alloc = true;
    model_params.load_mode = LLAMA_LOAD_MODE_NONE;
    model_params.use_extra_bufts = false;
    ggml_backend_dev_t cpu_only[] = { nullptr };  // the sizes are the same wherever the layers go
    model_params.devices = cpu_only;
    std::vector<llama_model_kv_override> overrides = parse_kv_overrides(kv_overrides);
    if (!overrides.empty()) model_params.kv_overrides = overrides.data();
    gil_released release;
    log_muted muted;  // the run's log (-lv 3) would show these contexts, of sizes the run never asked for
    log_clear_recent();
    llama_model * model = llama_model_load_from_file(path.c_str(), model_params);
    if (!model) throw_with_log("failed to load model from " + path);
    std::vector<size_t> out;
    for (const uint32_t n_ctx : n_ctxs) {
        log_clear_recent();  // the load's warnings (a vocabulary's) are not the context's reason
        llama_context * ctx = llama_init_from_model(
            model, memory_params(n_ctx, n_batch, n_ubatch, flash_attn, kv_type, n_seq_max, swa_full));
        if (!ctx) {
            llama_model_free(model);
            throw_with_log("failed to create a context");
        }
        size_t bytes = 0;
        for (const auto & [buft, data] : llama_get_memory_breakdown(ctx)) bytes += data.context;
        llama_free(ctx);
        out.push_back(bytes);
    }
    llama_model_free(model);
    return out;
}

}  // namespace

// Sequence seq's state in a slot file, llama-server's (llama_state_seq_save_file: the tokens, then
// the sequence's KV cache; its /slots/N?action=save and restore); the bytes written.
size_t save_sequence_file(Context & c, const std::string & path, int seq, const std::vector<llama_token> & tokens) {
    log_clear_recent();
    size_t written;
    {
        gil_released release;
        written = llama_state_seq_save_file(c.ctx, path.c_str(), seq, tokens.data(), tokens.size());
    }
    if (written == 0) throw_with_log("cannot write the slot file " + path);
    return written;
}

// Sequence seq holds what a slot file holds (replacing what it held): its tokens and the bytes read.
std::pair<std::vector<llama_token>, size_t> load_sequence_file(Context & c, const std::string & path, int seq) {
    llama_memory_t memory = llama_get_memory(c.ctx);
    llama_memory_seq_rm(memory, seq, -1, -1);
    if (llama_n_seq_max(c.ctx) == 1 && c.model->residency) c.model->residency->start_sequence();
    std::vector<llama_token> tokens(llama_n_ctx_seq(c.ctx));
    size_t n = 0, read;
    log_clear_recent();
    {
        gil_released release;
        read = llama_state_seq_load_file(c.ctx, path.c_str(), seq, tokens.data(), tokens.size(), &n);
    }
    tokens.resize(read == 0 ? 0 : n);
    if (read == 0 || !holds(c, seq, tokens)) {
        llama_memory_seq_rm(memory, seq, -1, -1);
        if (read == 0) throw_with_log("cannot load the slot file " + path + " (cut short, of another model, a larger "
                                      "context, or another -fa or KV cache type?)");
        throw std::runtime_error("the slot file " + path + " is damaged: its tokens and its state disagree");
    }
    return {tokens, read};
}

void register_context(nb::module_ & m) {
    m.def("context_memory_bytes", &context_memory_bytes, nb::arg("path"), nb::arg("kv_overrides"), nb::arg("n_ctxs"),
          nb::arg("n_batch"), nb::arg("n_ubatch"), nb::arg("flash_attn"), nb::arg("kv_type"), nb::arg("n_seq_max"),
          nb::arg("swa_full"), "llama.cpp's KV cache and recurrent states of a context of each size in n_ctxs of the "
          "model at path, in bytes, measured without allocating them.");
    nb::class_<Context>(m, "Context")
        .def("__init__", &create, nb::arg("model"), nb::arg("n_ctx"), nb::arg("n_batch") = 512,
             nb::arg("n_ubatch") = 512, nb::arg("n_threads") = 4, nb::arg("n_threads_batch") = 4,
             nb::arg("flash_attn") = (int) LLAMA_FLASH_ATTN_TYPE_AUTO, nb::arg("kv_type") = (int) GGML_TYPE_F16,
             nb::arg("n_seq_max") = 1, nb::arg("rope_scaling_type") = nb::none(),
             nb::arg("rope_freq_base") = nb::none(), nb::arg("rope_freq_scale") = nb::none(),
             nb::arg("yarn_orig_ctx") = nb::none(), nb::arg("yarn_ext_factor") = nb::none(),
             nb::arg("yarn_attn_factor") = nb::none(), nb::arg("yarn_beta_fast") = nb::none(),
             nb::arg("yarn_beta_slow") = nb::none(),
             nb::arg("loras") = std::vector<std::pair<std::string, float>>(), nb::arg("pooling_type") = nb::none(),
             nb::arg("swa_full") = true, nb::keep_alive<1, 2>())
        .def("decode", &decode, nb::arg("tokens"), nb::arg("pos0"), nb::arg("all_logits") = false, nb::arg("seq") = 0)
        .def("decode_step", &decode_step, nb::arg("tokens"), nb::arg("positions"), nb::arg("seqs"))
        .def("output_logits", [](Context & c, int i) {
                 const float * logits = llama_get_logits_ith(c.ctx, i);
                 if (!logits) throw nb::index_error(("no output " + std::to_string(i) + " in the last decode").c_str());
                 return to_numpy(std::vector<float>(logits, logits + c.n_vocab), { (size_t) c.n_vocab });
             }, nb::arg("i") = -1, "The logits of output i of the last llama_decode (-1: its last), [n_vocab].")
        .def("embed", &embed, nb::arg("tokens"), nb::arg("seq") = 0)
        .def_prop_ro("pooling_type", [](const Context & c) { return (int) llama_pooling_type(c.ctx); },
                     "llama.cpp's pooling type of embed()'s rows (0: none, a row per token; the model's).")
        .def("sequence_state", &sequence_state, nb::arg("seq") = 0, nb::arg("partial") = false)
        .def("set_sequence_state", &set_sequence_state, nb::arg("seq"), nb::arg("data"), nb::arg("partial") = false)
        .def("holds", &holds, nb::arg("seq"), nb::arg("tokens"),
             "Whether sequence seq's KV cache holds the positions of tokens, each of the vocabulary.")
        .def("save_state_file", &save_state_file, nb::arg("path"), nb::arg("tokens"))
        .def("load_state_file", &load_state_file, nb::arg("path"))
        .def("save_sequence_file", &save_sequence_file, nb::arg("path"), nb::arg("seq"), nb::arg("tokens"))
        .def("load_sequence_file", &load_sequence_file, nb::arg("path"), nb::arg("seq"))
        .def("clear", [](Context & c) {
                 llama_memory_clear(llama_get_memory(c.ctx), true);
                 if (c.model->residency) c.model->residency->start_sequence();
             }, "Forget every sequence (the KV cache); the expert cache's per-sequence records restart.")
        .def("truncate", [](Context & c, int pos, int seq) {
                 if (seq < 0 || seq >= (int) llama_n_seq_max(c.ctx)) throw nb::value_error("sequence out of range");
                 // a window-sized cache of sliding-window layers may have dropped positions the next one
                 // attends to: then nothing is kept (llama-server's check, without its checkpoints)
                 const llama_pos first = llama_memory_seq_pos_min(llama_get_memory(c.ctx), seq);
                 if (pos > 0 && first > std::max(0, pos - llama_model_n_swa(c.model->model))) return false;
                 bool ok = llama_memory_seq_rm(llama_get_memory(c.ctx), seq, pos, -1);
                 if (ok && pos == 0 && llama_n_seq_max(c.ctx) == 1 && c.model->residency) {
                     c.model->residency->start_sequence();
                 }
                 return ok;
             }, nb::arg("pos"), nb::arg("seq") = 0, "Drop positions >= pos of sequence seq; false where the rest "
             "cannot be kept (nothing dropped).")
        .def("set_n_threads", [](Context & c, int n_threads, int n_threads_batch) {
                 llama_set_n_threads(c.ctx, n_threads, n_threads_batch);
             }, nb::arg("n_threads"), nb::arg("n_threads_batch"), "Threads for the next decode / prefill calls.")
        .def_prop_ro("n_ctx", [](const Context & c) { return llama_n_ctx(c.ctx); })
        .def_prop_ro("n_ctx_seq", [](const Context & c) { return llama_n_ctx_seq(c.ctx); })
        .def_prop_ro("n_seq_max", [](const Context & c) { return llama_n_seq_max(c.ctx); })
        .def_prop_ro("n_batch", [](const Context & c) { return llama_n_batch(c.ctx); })
        .def_prop_ro("n_vocab", [](const Context & c) { return c.n_vocab; })
        .def("memory_breakdown", &memory_breakdown,
             "What llama.cpp allocated per buffer type (model weights, context, compute buffers), in bytes; "
             "the expert cache's pools are not in it (expert_residency_info has them).");
}

// Model: loading (mmap), vocabulary, chat template and metadata.
#include "native.h"

#include "common.h"
#include "ggml-backend.h"
#include "llama.h"
#include "../src/expert-format.h"
#include "../src/expert-residency.h"
#include "../src/expert-store.h"
#include "llama-model.h"

#include <nanobind/stl/map.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <map>
#include <stdexcept>
#include <vector>

Model::~Model() {
    residency.reset();  // unregisters its tensors before they go
    if (model) llama_model_free(model);
}

namespace {

// Mapped experts are computed a whole matrix at a time: llama.cpp advises its on-demand tensors
// MADV_RANDOM (read by rows), which would fault them in a page at a time; readahead again.
void advise_whole_reads(const llama_model * model) {
    const uintptr_t page = (uintptr_t) sysconf(_SC_PAGESIZE);
    for (const auto & [name, t] : llama_internal_get_tensor_map(model)) {
        if (!is_expert_tensor_name(name)) continue;
        const uintptr_t begin = (uintptr_t) t->data & ~(page - 1);
        posix_madvise((void *) begin, (uintptr_t) t->data + ggml_nbytes(t) - begin, POSIX_MADV_NORMAL);
    }
}

const llama_vocab * vocab_of(const Model & m) { return llama_model_get_vocab(m.model); }

// experts_on_demand: the stacked expert tensors stay in the file (patch 0003: lazy mode ON maps
// them without reading or prefetching), for an expert cache (enable_expert_residency) to read.
// device: a ggml device name for every layer (as -ngl 99 -dev NAME), or several, "A,B" (-dev A,B: llama.cpp
// spreads the layers over them by their free memory); "" keeps the model on the CPU.
// repack false: no repacked copies of the weights (llama.cpp's --no-repack), which are anonymous
// memory, so a mapped model's weights stay in the page cache, where the kernel can drop them.
// tensor_split: the layers' shares per device, in device order (llama.cpp's --tensor-split); empty: by
// the devices' free memory.
// experts_mapped: the CPU computes the experts from the mapped file (the page cache holds what fits)
// and every other weight is read into memory, where the kernel cannot drop it between tokens under
// a memory cap; embedding_mapped leaves the input embedding mapped too, beside mapped experts or a
// CPU's expert cache (a run reads the rows of the tokens it sees; not where it is also the output).
// kv_overrides: llama.cpp's --override-kv items, KEY=TYPE:VALUE (checked by pyedgemoe.kv_overrides).
// mlock: llama.cpp's --mlock, its weights' host memory locked (an expert cache's: its own option).
// chat_template: a template in place of the file's (llama.cpp's --chat-template), as the model's
// metadata, whence every reader of it takes it (llama_model_chat_template, common_chat_templates_init).
// vocab_only: the vocabulary and header alone, no weights (llama-tokenize's load): no context then.
void load(Model * self, const std::string & path, bool use_mmap, bool experts_on_demand, const std::string & device,
          bool repack, const std::vector<float> & tensor_split, bool experts_mapped, bool embedding_mapped,
          const std::vector<std::string> & kv_overrides, bool mlock, const std::string & chat_template,
          bool vocab_only) {
    if (experts_mapped && (use_mmap || experts_on_demand || !device.empty()))
        throw nb::value_error("experts_mapped reads the other weights into memory: not with use_mmap, "
                              "experts_on_demand or a device");
    if (embedding_mapped && !(experts_mapped || (experts_on_demand && device.empty())))
        throw nb::value_error("embedding_mapped goes with experts_mapped or, on the CPU, experts_on_demand");
    llama_model_params params = llama_model_default_params();
    std::vector<float> split(llama_max_devices(), 0.0f);
    if (!tensor_split.empty()) {
        if (tensor_split.size() > split.size()) throw nb::value_error("tensor_split: more shares than devices");
        std::copy(tensor_split.begin(), tensor_split.end(), split.begin());
        params.tensor_split = split.data();
    }
    std::vector<std::string> names;
    std::vector<ggml_backend_dev_t> devices;  // none: the CPU only
    for (size_t start = 0; start < device.size();) {
        const size_t end = std::min(device.find(',', start), device.size());
        names.push_back(device.substr(start, end - start));
        devices.push_back(ggml_backend_dev_by_name(names.back().c_str()));
        if (!devices.back()) throw nb::value_error(("no ggml device named '" + names.back() + "'").c_str());
        params.n_gpu_layers = -1;  // all
        start = end + 1;
    }
    devices.push_back(nullptr);
    params.devices = devices.data();
    std::vector<llama_model_kv_override> overrides = parse_kv_overrides(kv_overrides);
    if (!overrides.empty()) params.kv_overrides = overrides.data();
    params.load_mode = use_mmap ? (mlock ? LLAMA_LOAD_MODE_MMAP_MLOCK : LLAMA_LOAD_MODE_MMAP)
                                : (mlock ? LLAMA_LOAD_MODE_MLOCK : LLAMA_LOAD_MODE_NONE);
    params.use_extra_bufts = repack;
    params.vocab_only = vocab_only;
    if (experts_on_demand || experts_mapped) params.lazy_mode = LLAMA_LAZY_MODE_ON;
    params.lazy_token_embd = embedding_mapped;
    log_clear_recent();
    llama_model * model;
    {
        gil_released release;
        model = llama_model_load_from_file(path.c_str(), params);
    }
    if (!model) throw_with_log("failed to load model from " + path);  // a worker lost: its error alone
    const std::string log = log_recent_errors();
    if (const size_t at = log.find("failed to mlock"); mlock && at != std::string::npos) {
        llama_model_free(model);  // llama.cpp warns and goes on unlocked: asked for, that is an error here
        throw std::runtime_error("--mlock: " + log.substr(at, log.find('\n', at) - at) + " (the limit: ulimit -l)");
    }
    if (experts_mapped) advise_whole_reads(model);
    if (!chat_template.empty()) model->gguf_kv["tokenizer.chat_template"] = chat_template;
    new (self) Model();
    self->model = model;
    if (use_mmap || experts_mapped || embedding_mapped) {
        self->mapped_file = std::make_unique<expert_store>(path, expert_io::buffered);
    }
    self->path = path;
    self->experts_on_demand = experts_on_demand;
    self->devices = names;
    self->repack = repack;
}

// The most bytes dev addresses in one tensor (Vulkan: maxStorageBufferRange; 128 MiB on lavapipe),
// 0 where it takes any size ggml describes: a larger expert pool would stop ggml's scheduler.
static uint64_t max_tensor_bytes(ggml_backend_dev_t dev) {
    ggml_init_params params = { ggml_tensor_overhead() + 64, nullptr, /*no_alloc*/ true };
    ggml_context * ctx = ggml_init(params);
    ggml_tensor * probe = ggml_new_tensor_1d(ctx, GGML_TYPE_I8, 1);
    auto fits = [&](uint64_t n) {
        probe->ne[0] = (int64_t) n;
        probe->nb[1] = probe->nb[2] = probe->nb[3] = n;
        return ggml_backend_dev_supports_op(dev, probe);
    };
    uint64_t lo = 0, hi = 1ull << 46;  // fits(lo); 64 TiB: no limit
    if (fits(hi)) hi = 0;
    while (hi > 0 && hi - lo > 1) {
        const uint64_t mid = lo + (hi - lo) / 2;
        (fits(mid) ? lo : hi) = mid;
    }
    ggml_free(ctx);
    return hi == 0 ? 0 : lo;
}

// The ggml devices this build has: name, description, type ("cpu", "gpu", "igpu", "accel"), memory,
// and the most bytes one tensor may take there (0: no limit).
std::vector<nb::dict> devices() {
    static const char * types[] = { "cpu", "gpu", "igpu", "accel", "meta" };
    std::vector<nb::dict> out;
    for (size_t i = 0; i < ggml_backend_dev_count(); i++) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        size_t free = 0, total = 0;
        ggml_backend_dev_memory(dev, &free, &total);
        const int type = (int) ggml_backend_dev_type(dev);
        nb::dict d;
        d["name"] = ggml_backend_dev_name(dev);
        d["description"] = ggml_backend_dev_description(dev);
        d["type"] = type < 5 ? types[type] : "other";
        d["free_bytes"] = free;
        d["total_bytes"] = total;
        d["max_tensor_bytes"] = max_tensor_bytes(dev);
        out.push_back(d);
    }
    return out;
}

// Tokenizing and detokenizing run without the GIL: a long text takes seconds, during which other
// Python threads (a server's event loop) go on. The vocabulary is read-only once loaded, so this may
// run beside a decode on another thread (llama-server tokenizes on its HTTP threads likewise).
// text's bytes as they are (not UTF-8 too: llama.cpp's own reading of them, as llama-cpp-python passes them)
std::vector<llama_token> tokenize(const Model & m, const nb::bytes & bytes, bool add_special, bool parse_special) {
    const std::string_view text(bytes.c_str(), bytes.size());
    if (text.size() > (size_t) INT32_MAX) throw nb::value_error("text too long to tokenize (2 GiB or more)");
    std::vector<llama_token> tokens;
    int32_t got = 0;
    {
        gil_released release;
        const int32_t n = -llama_tokenize(vocab_of(m), text.data(), (int32_t) text.size(), nullptr, 0, add_special, parse_special);
        tokens.resize(std::max(n, 0));
        if (n > 0) got = llama_tokenize(vocab_of(m), text.data(), (int32_t) text.size(), tokens.data(), n, add_special, parse_special);
    }
    if (got < 0) throw std::runtime_error("tokenization failed");
    tokens.resize(got);
    return tokens;
}

} // namespace

std::vector<llama_model_kv_override> parse_kv_overrides(const std::vector<std::string> & items) {
    std::vector<llama_model_kv_override> overrides;
    for (const auto & item : items) {
        if (!string_parse_kv_override(item.c_str(), overrides))
            throw nb::value_error(("malformed metadata override '" + item + "'").c_str());
    }
    if (!overrides.empty()) {
        overrides.emplace_back();
        overrides.back().key[0] = 0;  // the list's end
    }
    return overrides;
}

void check_token_ids(const std::vector<llama_token> & tokens, int n_vocab) {
    for (llama_token t : tokens) {
        if (t >= 0 && t < n_vocab) continue;
        // pyedgemoe's typed error for bad input (a ValueError too), as the Python side raises it
        nb::object error = nb::module_::import_("pyedgemoe.errors").attr("InvalidOptionError");
        PyErr_SetString(error.ptr(), ("token id " + std::to_string(t) + " out of range [0, " +
                                      std::to_string(n_vocab) + ")").c_str());
        throw nb::python_error();
    }
}

namespace {

nb::bytes token_to_piece(const Model & m, llama_token token, bool special) {
    check_token_ids({token}, llama_vocab_n_tokens(vocab_of(m)));
    char buf[256];
    int32_t n = llama_token_to_piece(vocab_of(m), token, buf, sizeof(buf), 0, special);
    if (n >= 0) return nb::bytes(buf, n);
    std::string big(-n, '\0');
    n = llama_token_to_piece(vocab_of(m), token, big.data(), (int32_t) big.size(), 0, special);
    return nb::bytes(big.data(), n);
}

nb::bytes detokenize(const Model & m, const std::vector<llama_token> & tokens, bool remove_special, bool unparse_special) {
    check_token_ids(tokens, llama_vocab_n_tokens(vocab_of(m)));
    if (tokens.size() > (size_t) INT32_MAX / 16) throw nb::value_error("too many tokens to detokenize at once");
    std::string text;
    int32_t n;
    {
        gil_released release;
        text.resize(tokens.size() * 8 + 16);
        n = llama_detokenize(vocab_of(m), tokens.data(), (int32_t) tokens.size(), text.data(), (int32_t) text.size(), remove_special, unparse_special);
        if (n < 0) {
            text.resize(-n);
            n = llama_detokenize(vocab_of(m), tokens.data(), (int32_t) tokens.size(), text.data(), (int32_t) text.size(), remove_special, unparse_special);
        }
    }
    return nb::bytes(text.data(), n);
}

// llama.cpp's built-in (non-Jinja) template engine; returns None when the model's template
// is not one it recognises, so Python can fall back to rendering the Jinja template.
nb::object apply_chat_template(const Model & m, const std::vector<std::pair<std::string, std::string>> & messages, bool add_assistant) {
    const char * tmpl = llama_model_chat_template(m.model, nullptr);
    if (!tmpl) return nb::none();
    std::vector<llama_chat_message> chat;
    size_t total = 0;
    for (const auto & [role, content] : messages) {
        chat.push_back({role.c_str(), content.c_str()});
        total += role.size() + content.size();
    }
    std::string buf(2 * total + 256, '\0');
    int32_t n = llama_chat_apply_template(tmpl, chat.data(), chat.size(), add_assistant, buf.data(), (int32_t) buf.size());
    if (n < 0) return nb::none();
    if ((size_t) n > buf.size()) {
        buf.resize(n);
        n = llama_chat_apply_template(tmpl, chat.data(), chat.size(), add_assistant, buf.data(), (int32_t) buf.size());
    }
    return nb::str(buf.data(), n);
}

std::map<std::string, std::string> metadata(const Model & m) {
    std::map<std::string, std::string> out;
    int32_t count = llama_model_meta_count(m.model);
    std::vector<char> key(512), val(4096);
    for (int32_t i = 0; i < count; i++) {
        if (llama_model_meta_key_by_index(m.model, i, key.data(), key.size()) < 0) continue;
        int32_t n = llama_model_meta_val_str_by_index(m.model, i, val.data(), val.size());
        if (n < 0) continue;
        if ((size_t) n >= val.size()) {
            val.resize(n + 1);
            llama_model_meta_val_str_by_index(m.model, i, val.data(), val.size());
        }
        out.emplace(key.data(), std::string(val.data()));
    }
    return out;
}

std::string description(const Model & m) {
    char buf[256];
    int32_t n = llama_model_desc(m.model, buf, sizeof(buf));
    return std::string(buf, n > 0 ? std::min<size_t>(n, sizeof(buf) - 1) : 0);
}

nb::object optional_token(llama_token t) { return t == LLAMA_TOKEN_NULL ? nb::object(nb::none()) : nb::object(nb::int_(t)); }

}  // namespace

void register_model(nb::module_ & m) {
    nb::class_<Model> cls(m, "Model");
    cls
        .def("__init__", &load, nb::arg("path"), nb::arg("use_mmap") = true, nb::arg("experts_on_demand") = false,
             nb::arg("device") = "", nb::arg("repack") = true, nb::arg("tensor_split") = std::vector<float>(),
             nb::arg("experts_mapped") = false, nb::arg("embedding_mapped") = false,
             nb::arg("kv_overrides") = std::vector<std::string>(), nb::arg("mlock") = false,
             nb::arg("chat_template") = "", nb::arg("vocab_only") = false)
        .def_ro("devices", &Model::devices)
        .def_ro("path", &Model::path)
        .def("tokenize", &tokenize, nb::arg("text"), nb::arg("add_special"), nb::arg("parse_special"))
        .def("token_to_piece", &token_to_piece, nb::arg("token"), nb::arg("special") = false)
        .def("detokenize", &detokenize, nb::arg("tokens"), nb::arg("remove_special") = false, nb::arg("unparse_special") = false)
        .def("apply_chat_template", &apply_chat_template, nb::arg("messages"), nb::arg("add_assistant") = true)
        .def_prop_ro("chat_template", [](const Model & m) -> nb::object {
            const char * t = llama_model_chat_template(m.model, nullptr);
            return t ? nb::object(nb::str(t)) : nb::none();
        })
        .def("metadata", &metadata)
        .def_prop_ro("description", &description)
        .def_prop_ro("n_vocab", [](const Model & m) { return llama_vocab_n_tokens(vocab_of(m)); })
        .def_prop_ro("n_ctx_train", [](const Model & m) { return llama_model_n_ctx_train(m.model); })
        .def_prop_ro("n_embd", [](const Model & m) { return llama_model_n_embd(m.model); })
        .def_prop_ro("n_layer", [](const Model & m) { return llama_model_n_layer(m.model); })
        .def_prop_ro("n_params", [](const Model & m) { return llama_model_n_params(m.model); })
        .def_prop_ro("size_bytes", [](const Model & m) { return llama_model_size(m.model); })
        .def_prop_ro("bos", [](const Model & m) { return optional_token(llama_vocab_bos(vocab_of(m))); })
        .def_prop_ro("eos", [](const Model & m) { return optional_token(llama_vocab_eos(vocab_of(m))); })
        .def_prop_ro("nl", [](const Model & m) { return optional_token(llama_vocab_nl(vocab_of(m))); })
        .def_prop_ro("add_bos", [](const Model & m) { return llama_vocab_get_add_bos(vocab_of(m)); })
        .def_prop_ro("fim_tokens", [](const Model & m) {
                 const llama_vocab * v = vocab_of(m);
                 nb::dict tokens;
                 tokens["pre"] = optional_token(llama_vocab_fim_pre(v));
                 tokens["suf"] = optional_token(llama_vocab_fim_suf(v));
                 tokens["mid"] = optional_token(llama_vocab_fim_mid(v));
                 tokens["rep"] = optional_token(llama_vocab_fim_rep(v));
                 tokens["sep"] = optional_token(llama_vocab_fim_sep(v));
                 return tokens;
             }, "The fill-in-the-middle tokens by role (pre, suf, mid, rep, sep), None where the model has none.")
        .def("is_eog", [](const Model & m, llama_token t) { return llama_vocab_is_eog(vocab_of(m), t); }, nb::arg("token"));
    add_residency_methods(cls);
    m.def("devices", &devices, "The ggml devices of this build (name, description, type, free_bytes, total_bytes, "
                               "max_tensor_bytes: the most one tensor may take there, 0 for no limit).");
}

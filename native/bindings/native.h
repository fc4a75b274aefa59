// pyedgemoe._native: a thin nanobind layer over llama.h (and ggml's gguf.h).
// Each bindings/*.cpp registers one concern; the friendly API lives in pyedgemoe/engine.py.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

class expert_residency;
class expert_store;

struct llama_model;
struct llama_context;
struct llama_sampler;
struct llama_token_data;
struct llama_model_kv_override;

namespace nb = nanobind;

// Releases the GIL for llama.cpp's work (nb::gil_scoped_release, which the bindings use in its place).
// A thread other than the main one that comes back while Python finalizes waits for the process's
// end: CPython (before 3.14) ends such a thread as it takes the GIL, with pthread_exit, whose
// unwinding through these frames (a destructor: noexcept) ended the process in std::terminate.
// Once the exit began (exiting_threads_wait), such a thread waits before llama.cpp's work instead,
// and the exit waits for the work in flight: else it ran on while the process tore down what it
// reads (a segfault at exit, seen once: a daemon thread tokenizing).
// awaited = false: a call that does not return (a server's loop), which the exit does not wait for.
struct gil_released {
    explicit gil_released(bool awaited = true);
    ~gil_released();
    gil_released(const gil_released &) = delete;
    gil_released & operator=(const gil_released &) = delete;
private:
    PyThreadState * state;
    bool awaited;
};
void gil_released_install(nb::module_ & m);  // at import: which thread is the main one; exiting_threads_wait

// A numpy array that owns v's data.
template <typename T>
nb::ndarray<nb::numpy, T> to_numpy(std::vector<T> && v, std::initializer_list<size_t> shape) {
    auto * data = new std::vector<T>(std::move(v));
    nb::capsule owner(data, [](void * p) noexcept { delete (std::vector<T> *) p; });
    return nb::ndarray<nb::numpy, T>(data->data(), shape, owner);
}

// errors.cpp: llama.cpp's log goes through here, so failures can quote the reason it logged.
void log_install();
// llama.cpp's aborts (GGML_ASSERT, GGML_ABORT, an uncaught exception) print one `error:` line and
// exit 1; PYEDGEMOE_NATIVE_BACKTRACE=1 keeps ggml's own report.
void abort_install();
void log_set_verbose(bool verbose);
// The last error/warning lines llama.cpp logged since log_clear_recent(), joined by newlines.
std::string log_recent_errors();
void log_clear_recent();
// While one lives, what llama.cpp logs on this thread is only remembered (log_recent_errors), not
// printed: a measurement's load and contexts are not the run's.
struct log_muted {
    log_muted();
    ~log_muted();
};
// A remote device lost (an RPC worker; patch 0006), where llama.cpp logged it since log_clear_recent():
// its error line, alone, which pyedgemoe raises as RemoteDeviceError (rpc.cpp).
void throw_if_remote_lost();
// what, with the errors llama.cpp logged since log_clear_recent() (a remote device lost: that alone).
[[noreturn]] void throw_with_log(const std::string & what);

// Owns a llama_model; contexts keep their Model alive (nb::keep_alive).
struct Model {
    llama_model * model = nullptr;
    std::string path;
    bool experts_on_demand = false;                 // loaded with the expert tensors left in the file
    std::vector<std::string> devices;               // the devices its layers are on, in order (none: the CPU)
    bool repack = true;                             // repacked copies of weights (not --no-repack)
    std::unique_ptr<expert_residency> residency;   // the expert cache, when offloading is on
    // the file, where a run reads weights from its mapping (llama.cpp's, mapped experts, the input
    // embedding's rows): checked unchanged before each decode, so that another file's bytes, or a
    // page past a truncated end (SIGBUS), are an error instead
    std::unique_ptr<expert_store> mapped_file;
    ~Model();
};

// llama.cpp's --override-kv items (KEY=TYPE:VALUE) as its loader takes them, the list ended by an
// empty key (none: empty); a malformed one is a ValueError naming it.
std::vector<llama_model_kv_override> parse_kv_overrides(const std::vector<std::string> & items);

// Owns a llama_context over a Model.
struct Context {
    llama_context * ctx = nullptr;
    Model * model = nullptr;  // kept alive by nb::keep_alive
    int n_vocab = 0;
    ~Context();
};

// Owns a llama_sampler chain.
struct Sampler {
    llama_sampler * chain = nullptr;
    llama_sampler * penalties = nullptr;  // in the chain, or none: the prompt's tokens go to it and DRY alone
    llama_sampler * repetition = nullptr;  // DRY, in the chain, or none
    llama_sampler * reasoning = nullptr;  // the reasoning budget, in the chain, or none
    std::vector<llama_token_data> candidates;  // a pick's, kept between picks (as llama.cpp's chain keeps its own)
    ~Sampler();
};

void register_errors(nb::module_ & m);
void register_model(nb::module_ & m);
void register_context(nb::module_ & m);
void register_sampler(nb::module_ & m);
void register_grammar(nb::module_ & m);
void register_chat(nb::module_ & m);
void register_gguf_info(nb::module_ & m);
void register_quantize(nb::module_ & m);
void register_residency(nb::module_ & m);
void register_rpc(nb::module_ & m);
void register_policies(nb::module_ & m);  // called by register_residency
void add_residency_methods(nb::class_<Model> & cls);  // called by register_model
// After a llama_decode: "" or why an expert failed to load; then the KV cache was cleared (it holds
// values computed without that expert).
std::string take_residency_error(Context & c);
// Raises pyedgemoe.errors.InvalidOptionError for the first id outside [0, n_vocab) (the GIL held).
void check_token_ids(const std::vector<int32_t> & tokens, int n_vocab);  // llama_token ids
// Raised to Python as pyedgemoe._native.ExpertLoadError (a RuntimeError).
struct expert_load_error : std::runtime_error { using std::runtime_error::runtime_error; };

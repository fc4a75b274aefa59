#include "native.h"

#include "llama.h"

NB_MODULE(_native, m) {
    m.doc() = "pyedgemoe native layer: vendored llama.cpp behind a thin binding";
    log_install();
    abort_install();
    gil_released_install(m);
    nb::set_leak_warnings(false);  // objects a daemon thread held at exit are not leaks of the bindings
    llama_backend_init();

    m.def("llama_version", []() { return std::string(llama_version()); });
    m.def("system_info", []() { return std::string(llama_print_system_info()); });
    m.def("supports_gpu_offload", &llama_supports_gpu_offload);

    register_errors(m);
    register_model(m);
    register_context(m);
    register_sampler(m);
    register_grammar(m);
    register_chat(m);
    register_gguf_info(m);
    register_quantize(m);
    register_residency(m);
    register_rpc(m);
}

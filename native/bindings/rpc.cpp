// ggml's RPC backend (docs/distributed.md): the devices of remote `rpc-server`s joining this
// process's device list (llama.cpp's --rpc), and this process serving its own CPU as one.
#include "native.h"

#include "ggml-backend.h"
#include "ggml-rpc.h"

#include <nanobind/stl/vector.h>

#include <csignal>

namespace {

// Registers the devices of the rpc-server at endpoint ("host:port") and returns their names
// ("RPC0", ...), which --device and llama.cpp's device list then know. Again for the same
// endpoint: the same names. Throws ValueError when the server cannot be reached.
std::vector<std::string> rpc_add_server(const std::string & endpoint) {
    ggml_backend_reg_t reg = nullptr;
    {
        gil_released release;  // connecting can take the connect timeout
        reg = ggml_backend_rpc_add_server(endpoint.c_str());
    }
    if (!reg) throw nb::value_error(("the RPC server " + endpoint + " has no devices").c_str());
    bool registered = false;  // ggml_backend_rpc_add_server gives the same reg for an endpoint again
    for (size_t i = 0; i < ggml_backend_reg_count(); i++) registered = registered || ggml_backend_reg_get(i) == reg;
    if (!registered) ggml_backend_register(reg);
    std::vector<std::string> names;
    for (size_t i = 0; i < ggml_backend_reg_dev_count(reg); i++) names.emplace_back(ggml_backend_dev_name(ggml_backend_reg_dev_get(reg, i)));
    return names;
}

// Serves this machine's CPU to RPC clients at endpoint until the process is stopped (SIGINT or
// SIGTERM end it: the server's loop does not return). cache_dir: where the server keeps tensors
// clients sent by hash ("" = none).
void rpc_serve(const std::string & endpoint, const std::string & cache_dir, int n_threads) {
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (!cpu) throw std::runtime_error("this build has no CPU device to serve");
    std::signal(SIGINT, SIG_DFL);  // Python's handler would only run once the loop returned
    gil_released release(false);  // the loop does not return
    ggml_backend_rpc_start_server(endpoint.c_str(), cache_dir.empty() ? nullptr : cache_dir.c_str(),
                                  (size_t) n_threads, 1, &cpu);
    throw std::runtime_error("the RPC server at " + endpoint + " stopped (is the port in use?)");
}

}  // namespace

void register_rpc(nb::module_ & m) {
    // a worker lost or silent past GGML_RPC_TIMEOUT_S (patch 0006): pyedgemoe.errors.RemoteDeviceError
    nb::register_exception_translator([](const std::exception_ptr & p, void *) {
        try {
            std::rethrow_exception(p);
        } catch (const std::runtime_error & e) {
            if (std::string(e.what()).rfind("RPC server ", 0) != 0) throw;
            nb::object cls = nb::module_::import_("pyedgemoe.errors").attr("RemoteDeviceError");
            PyErr_SetString(cls.ptr(), e.what());
        }
    });
    m.def("rpc_add_server", &rpc_add_server, nb::arg("endpoint"),
          "Register the devices of the rpc-server at host:port; returns their names (RPC0, ...).");
    m.def("rpc_serve", &rpc_serve, nb::arg("endpoint"), nb::arg("cache_dir") = "", nb::arg("n_threads") = 1,
          "Serve this machine's CPU to RPC clients at host:port (does not return).");
}

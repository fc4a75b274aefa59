// gil_released: nb::gil_scoped_release, safe for a thread that comes back while Python finalizes.
#include "native.h"

#include <pthread.h>
#include <pythread.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>

namespace {
unsigned long g_main_thread = 0;  // threading.main_thread()'s ident: the thread that finalizes
std::atomic<bool> g_exiting{false};  // the program's exit began (exiting_threads_wait)
std::atomic<int> g_in_flight{0};  // threads between gil_released's construction and destruction

bool main_thread() { return PyThread_get_thread_ident() == g_main_thread; }

bool finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
    return Py_IsFinalizing();
#else
    return _Py_IsFinalizing();
#endif
}
}  // namespace

void gil_released_install(nb::module_ & m) {
    g_main_thread = nb::cast<unsigned long>(nb::module_::import_("threading").attr("main_thread")().attr("ident"));
    // a forked child has the forking thread alone, its main thread (as Python's threading has it), and
    // none in flight: the parent's others would keep its exit waiting for them, for nothing
    pthread_atfork(nullptr, nullptr, [] {
        g_main_thread = PyThread_get_thread_ident();
        g_in_flight = 0;
    });
    // A thread that has come back and waits for the GIL when finalization begins is ended there too:
    // from the exit's start (atexit, pyedgemoe.native_exit) such threads wait before they ask for it;
    // the exit goes on once the work in flight ended (at most timeout_s).
    m.def("exiting_threads_wait", [](double timeout_s) {
        g_exiting = true;
        nb::gil_scoped_release release;
        const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
        while (g_in_flight > 0 && std::chrono::steady_clock::now() < end) {
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
    }, nb::arg("timeout_s"));
}

// The count goes up before the flag is read and the exit sets the flag before it reads the count
// (both sequentially consistent): a thread the exit does not wait for sees the flag.
gil_released::gil_released(bool awaited) : state(PyEval_SaveThread()), awaited(awaited) {
    if (awaited) ++g_in_flight;
    if (g_exiting && !main_thread()) {
        if (awaited) --g_in_flight;
        for (;;) pause();  // the process ends around it
    }
}

gil_released::~gil_released() {
    if (awaited) --g_in_flight;
    if (!main_thread()) {
        while (g_exiting || finalizing()) pause();  // the process ends around it
    }
    PyEval_RestoreThread(state);
}

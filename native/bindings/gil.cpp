// gil_released: nb::gil_scoped_release, safe for a thread that comes back while Python finalizes.
#include "native.h"

#include <pythread.h>
#include <unistd.h>

#include <atomic>

namespace {
unsigned long g_main_thread = 0;  // threading.main_thread()'s ident: the thread that finalizes
std::atomic<bool> g_exiting{false};  // the program's exit began (exiting_threads_wait)

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
    // A thread that has come back and waits for the GIL when finalization begins is ended there too:
    // from the exit's start (atexit, pyedgemoe.native_exit) such threads wait before they ask for it.
    m.def("exiting_threads_wait", []() { g_exiting = true; });
}

gil_released::gil_released() : state(PyEval_SaveThread()) {}

gil_released::~gil_released() {
    if (PyThread_get_thread_ident() != g_main_thread) {
        while (g_exiting || finalizing()) pause();  // the process ends around it
    }
    PyEval_RestoreThread(state);
}

// gil_released: nb::gil_scoped_release, safe for a thread that comes back while Python finalizes.
#include "native.h"

#include <pythread.h>
#include <unistd.h>

namespace {
unsigned long g_main_thread = 0;  // threading.main_thread()'s ident: the thread that finalizes

bool finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
    return Py_IsFinalizing();
#else
    return _Py_IsFinalizing();
#endif
}
}  // namespace

void gil_released_install() {
    g_main_thread = nb::cast<unsigned long>(nb::module_::import_("threading").attr("main_thread")().attr("ident"));
}

gil_released::gil_released() : state(PyEval_SaveThread()) {}

gil_released::~gil_released() {
    if (PyThread_get_thread_ident() != g_main_thread) {
        while (finalizing()) pause();  // the process ends around it
    }
    PyEval_RestoreThread(state);
}

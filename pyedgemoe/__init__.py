"""pyedgemoe: run Mixture-of-Experts LLMs whose experts do not fit in fast memory."""
import os as _os
import signal as _signal
import sys as _sys
import threading as _threading


def _import_native():
    """The native module (or another build of it: PYEDGEMOE_NATIVE, e.g. the Vulkan variant `make
    native-vulkan` builds beside the installed one; make test runs the device tests with it), imported
    at its first use (`from pyedgemoe import _native`, through __getattr__).

    Ctrl-C while nanobind creates the module's types (its enums are Python's) is a KeyboardInterrupt
    there, which nanobind cannot recover from: the process aborted (SIGABRT, a core dump). So the
    main thread holds SIGINT back while the module is imported, and raises it again once it is there,
    where the importer's code takes it (the command's: exit status 130, __main__)."""
    import importlib
    import importlib.util

    path = _os.environ.get("PYEDGEMOE_NATIVE")
    held = [] if _threading.current_thread() is _threading.main_thread() and _signal.getsignal(_signal.SIGINT) \
        is not None else None  # None: the handler is not Python's to swap (set natively), or not this thread's
    previous = _signal.signal(_signal.SIGINT, lambda *_: held.append(True)) if held is not None else None
    try:
        if path:
            spec = importlib.util.spec_from_file_location("pyedgemoe._native", path)
            native = _sys.modules["pyedgemoe._native"] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(native)
        else:
            native = importlib.import_module("pyedgemoe._native")
    finally:
        if held is not None:
            _signal.signal(_signal.SIGINT, previous)
    globals()["_native"] = native
    if held:
        _signal.raise_signal(_signal.SIGINT)  # to the handler restored: KeyboardInterrupt by default
    return native


from pyedgemoe.errors import (
    ConversionError,
    ContextOverflowError,
    EngineBusyError,
    EngineClosedError,
    ExpertLoadError,
    ForkedEngineError,
    InvalidOptionError,
    ModelLoadError,
    PyEdgeMoEError,
    RemoteDeviceError,
)

# the names of the modules below, imported at their first use: `pyedgemoe` (the command) starts
# without them, so that Ctrl-C while it starts is its exit status 130 (__main__)
_LAZY = {
    "pyedgemoe.engine": ("Engine",),
    "pyedgemoe.expert_options": ("ExpertOptions",),
    "pyedgemoe.llama": ("Llama", "LlamaGrammar", "LlamaState", "LlamaTokenizer"),
    "pyedgemoe.llama_cache": ("LlamaCache", "LlamaDiskCache", "LlamaRAMCache"),
    "pyedgemoe.speculative": ("LlamaDraftModel", "LlamaPromptLookupDecoding"),
    "pyedgemoe.token_sampler": ("LogitsProcessorList", "StoppingCriteriaList"),
}


def __getattr__(name: str):
    if name == "_native":
        return _import_native()
    module = next((m for m, names in _LAZY.items() if name in names), None)
    if module is None:
        raise AttributeError(f"module 'pyedgemoe' has no attribute {name!r}")
    import importlib

    value = globals()[name] = getattr(importlib.import_module(module), name)
    return value


# the lazy names (llama-cpp-python's among them: `from llama_cpp import ...` -> `from pyedgemoe import ...`)
# and the errors
__all__ = [*(name for names in _LAZY.values() for name in names), "PyEdgeMoEError", "ModelLoadError",
           "ContextOverflowError", "EngineBusyError", "EngineClosedError", "ExpertLoadError", "InvalidOptionError",
           "ConversionError", "ForkedEngineError", "RemoteDeviceError"]

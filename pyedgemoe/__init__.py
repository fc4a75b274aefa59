"""pyedgemoe: run Mixture-of-Experts LLMs whose experts do not fit in fast memory."""
import os as _os

if _os.environ.get("PYEDGEMOE_NATIVE"):
    # another build of the native module, e.g. the Vulkan variant `make native-vulkan` builds
    # beside the installed one (make test runs the device tests with it)
    import importlib.util as _util
    import sys as _sys

    _spec = _util.spec_from_file_location("pyedgemoe._native", _os.environ["PYEDGEMOE_NATIVE"])
    _sys.modules["pyedgemoe._native"] = _util.module_from_spec(_spec)
    _spec.loader.exec_module(_sys.modules["pyedgemoe._native"])
from pyedgemoe.errors import (
    ConversionError,
    ContextOverflowError,
    EngineBusyError,
    EngineClosedError,
    ExpertLoadError,
    InvalidOptionError,
    ModelLoadError,
    PyEdgeMoEError,
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
           "ConversionError"]

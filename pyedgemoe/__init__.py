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
    ExpertLoadError,
    InvalidOptionError,
    ModelLoadError,
    PyEdgeMoEError,
)
from pyedgemoe.engine import Engine
from pyedgemoe.expert_options import ExpertOptions
from pyedgemoe.llama import Llama, LlamaGrammar, LlamaState, LlamaTokenizer
from pyedgemoe.llama_cache import LlamaCache, LlamaDiskCache, LlamaRAMCache
from pyedgemoe.speculative import LlamaDraftModel, LlamaPromptLookupDecoding
from pyedgemoe.token_sampler import LogitsProcessorList, StoppingCriteriaList

__all__ = [
    "Engine",
    "ExpertOptions",
    # llama-cpp-python's names (`from llama_cpp import ...` -> `from pyedgemoe import ...`)
    "Llama",
    "LlamaGrammar",
    "LlamaState",
    "LlamaTokenizer",
    "LlamaCache",
    "LlamaRAMCache",
    "LlamaDiskCache",
    "LlamaDraftModel",
    "LlamaPromptLookupDecoding",
    "LogitsProcessorList",
    "StoppingCriteriaList",
    "PyEdgeMoEError",
    "ModelLoadError",
    "ContextOverflowError",
    "EngineBusyError",
    "ExpertLoadError",
    "InvalidOptionError",
    "ConversionError",
]

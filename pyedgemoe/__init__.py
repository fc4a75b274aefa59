"""pyedgemoe: run Mixture-of-Experts LLMs whose experts do not fit in fast memory."""
from pyedgemoe.errors import (
    ConversionError,
    ContextOverflowError,
    InvalidOptionError,
    ModelLoadError,
    PyEdgeMoEError,
)
from pyedgemoe.engine import Engine
from pyedgemoe.expert_options import ExpertOptions

__all__ = [
    "Engine",
    "ExpertOptions",
    "PyEdgeMoEError",
    "ModelLoadError",
    "ContextOverflowError",
    "InvalidOptionError",
    "ConversionError",
]

"""Errors a user can cause: each is one clear line on the CLI."""


class PyEdgeMoEError(Exception):
    """Base class of every error pyedgemoe raises on purpose."""


class ModelLoadError(PyEdgeMoEError, ValueError):
    """The model file is missing, not a GGUF, truncated, corrupt or of an unsupported architecture
    (a ValueError, as llama-cpp-python's load failures)."""


class ContextOverflowError(PyEdgeMoEError, ValueError):
    """The prompt (plus what was asked to be generated) does not fit the context window (a
    ValueError, as llama-cpp-python's "Requested tokens ... exceed context window")."""


class InvalidOptionError(PyEdgeMoEError, ValueError):
    """An option has a value outside its valid range."""


class ConversionError(PyEdgeMoEError):
    """A checkpoint or GGUF cannot be converted (missing files, bad shapes, unsupported
    architecture, disk full); no output file is left behind."""


class ExpertLoadError(PyEdgeMoEError, RuntimeError):
    """An expert could not be read from the model file (truncated, replaced, I/O error) while
    running; the message names the layer, the expert and the file offset."""


class TextTooShortError(InvalidOptionError):
    """The text tokenizes to fewer tokens than a perplexity run needs (llama.cpp's rule: at least
    two chunks of n_ctx tokens); the message gives both counts."""


class EngineBusyError(PyEdgeMoEError, RuntimeError):
    """The Engine's one sequence is held by a generation this same thread left open (a streamed
    generation neither taken to its end nor closed): another would wait on it forever."""


class RemoteDeviceError(PyEdgeMoEError, RuntimeError):
    """A remote device's worker (`--rpc`, docs/distributed.md) could not be reached, was lost, or gave
    no reply within its timeout; the message names it. The Engine can only be closed afterwards."""

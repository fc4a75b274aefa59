"""Errors a user can cause: each is one clear line on the CLI."""


class PyEdgeMoEError(Exception):
    """Base class of every error pyedgemoe raises on purpose."""


class ModelLoadError(PyEdgeMoEError, ValueError):
    """The model file is missing, not a GGUF, truncated, corrupt or of an unsupported architecture
    (a ValueError, as llama-cpp-python's load failures)."""


class ContextOverflowError(PyEdgeMoEError, ValueError):
    """The prompt (plus what was asked to be generated) does not fit the context window (a
    ValueError, as llama-cpp-python's "Requested tokens ... exceed context window"). n_prompt_tokens
    and n_ctx (a sequence's positions; 0 where the message is about something else) are llama-server's
    fields of its error."""

    def __init__(self, message: str, n_prompt_tokens: int = 0, n_ctx: int = 0):
        super().__init__(message)
        self.n_prompt_tokens, self.n_ctx = n_prompt_tokens, n_ctx

    @classmethod
    def of_prompt(cls, n_prompt: int, n_more: int, n_ctx: int, n_parallel: int = 1,
                  n_ctx_total: int = 0) -> "ContextOverflowError":
        """A prompt of n_prompt tokens that leaves no room for n_more generated ones in a sequence's
        n_ctx positions (with n_parallel > 1: its share of the context's n_ctx_total)."""
        room = f" with room for {n_more} generated" if n_more else ""
        share = f", each sequence's share of n_ctx {n_ctx_total} across n_parallel {n_parallel}" \
            if n_parallel > 1 else ""
        fix = "raise n_ctx / --ctx" + (", or lower n_parallel / --parallel" if n_parallel > 1 else "")
        return cls(f"prompt of {n_prompt} tokens does not fit the context of {n_ctx} tokens{room}{share} ({fix})",
                   n_prompt, n_ctx)


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


class EngineClosedError(PyEdgeMoEError, RuntimeError):
    """A use of an Engine (or a Llama) after close(), or of what it made (a stream, a batch)."""


class ForkedEngineError(PyEdgeMoEError, RuntimeError):
    """A computation, in a forked child process, of an Engine made before the fork: its threads (OpenMP's, an
    expert cache's, a batcher's) and a GPU's state stayed in the parent (pyedgemoe.native_exit)."""


class RemoteDeviceError(PyEdgeMoEError, RuntimeError):
    """A remote device's worker (`--rpc`, docs/distributed.md) could not be reached, was lost, or gave
    no reply within its timeout; the message names it. The Engine can only be closed afterwards."""

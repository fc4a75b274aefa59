"""llama.cpp's prompt cache (llama-completion's `--prompt-cache FNAME`, `--prompt-cache-all`,
`--prompt-cache-ro`; `pyedgemoe run`): the state of a prompt's evaluation, its KV cache, kept in a
file between runs, so that a run whose prompt begins with the same tokens evaluates only the rest.
Where the experts stream from storage a long prompt's prefill is the slow part of a run; the cache
skips it. The file is llama.cpp's session file (llama_state_save_file): one llama-completion wrote
for the same model and context size loads here, and the other way round. It holds the KV cache
only: the expert cache, the precision and the device are the run's own, and the tokens that follow
are those of a run without it (lossless)."""
from __future__ import annotations

import os

from pyedgemoe.errors import InvalidOptionError


class PromptCache:
    """The prompt cache at path for an Engine (one sequence): loaded when made (where the file has
    anything), saved by save() after a generation: the prompt's state (with save_all, the generated
    text's too), unless read_only."""

    def __init__(self, engine, path: str | os.PathLike, save_all: bool = False, read_only: bool = False) -> None:
        engine._single_sequence("a prompt cache")
        self.engine, self.path, self.save_all, self.read_only = engine, os.fspath(path), save_all, read_only
        self.tokens: list[int] = []  # those the file holds the state of
        if os.path.isfile(self.path) and os.path.getsize(self.path) > 0:
            sequence = engine._decoder.sequences[0]
            try:
                with engine._sequence_turn():
                    engine._decoder.load_file(self.path, sequence)
            except RuntimeError as e:
                raise InvalidOptionError(f"prompt cache {self.path}: {str(e).splitlines()[0]}") from None
            self.tokens = list(sequence.tokens)
        elif os.path.exists(self.path) and not os.path.isfile(self.path):
            raise InvalidOptionError(f"prompt cache {self.path}: not a file")

    def save(self, n_prompt: int) -> int:
        """Writes the state of the last generation's prompt of n_prompt tokens (save_all: and of what it
        generated and evaluated) unless read_only or the file holds those already; the tokens written
        (0: none)."""
        sequence = self.engine._decoder.sequences[0]
        n = len(sequence.tokens) if self.save_all else min(n_prompt, len(sequence.tokens))
        if self.engine.plan.checkpoint_bytes and not self.save_all:
            # a memory that cannot drop tokens (recurrent states) keeps the prompt less its last
            # token: the same prompt again evaluates that one for its logits, not all of them
            n = min(n, n_prompt - 1)
        if self.read_only or n == 0 or sequence.tokens[:n] == self.tokens:
            return 0
        try:
            with self.engine._sequence_turn():
                self.engine._decoder.save_file(self.path, sequence, n)
        except RuntimeError as e:
            raise InvalidOptionError(f"prompt cache {self.path}: {str(e).splitlines()[0]}") from None
        self.tokens = sequence.tokens[:n]
        return n

"""A model's vocabulary and header, as the Engine gives them (llama_vocab's API over the native
Model): tokenize, detokenize, a token's bytes, the special tokens, the metadata. Vocabulary is the
part of the Engine that needs the model alone, not its context."""
from __future__ import annotations

from abc import ABC, abstractmethod

from pyedgemoe.generation import as_token_ids
from pyedgemoe.text_stream import utf8


class Vocabulary(ABC):
    """The vocabulary methods of an object that holds a native Model."""

    @abstractmethod
    def _live_model(self):
        """The native Model (raising once its owner is closed)."""

    @property
    def n_vocab(self) -> int:
        return self._live_model().n_vocab

    @property
    def metadata(self) -> dict[str, str]:
        return self._live_model().metadata()

    def token_bos(self) -> int | None:
        """The model's beginning-of-sequence token; None where it has none (token_eos, token_nl alike)."""
        return self._live_model().bos

    def token_eos(self) -> int | None:
        return self._live_model().eos

    def token_nl(self) -> int | None:
        return self._live_model().nl

    def fim_tokens(self) -> dict[str, int | None]:
        """The fill-in-the-middle tokens by role: pre, suf, mid, rep and sep (llama-server's /infill)."""
        return self._live_model().fim_tokens

    @property
    def add_bos(self) -> bool:
        """Whether the model puts BOS before tokenized text (llama_vocab_get_add_bos)."""
        return self._live_model().add_bos

    def is_eog(self, token: int) -> bool:
        """Whether token ends a generation (EOS, EOT, ...)."""
        return self._live_model().is_eog(token)

    def tokenize(self, text: str | bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        """Token ids of text; add_bos: the model's BOS first (if it uses one); special: <|im_start|> is one."""
        return self._live_model().tokenize(utf8(text).decode("utf-8", errors="replace"), add_bos, special)

    def detokenize(self, tokens: list[int], special: bool = False) -> str:
        """The text of tokens; bytes that are not UTF-8 are dropped, as in generated text (TextStream)."""
        return self._live_model().detokenize(as_token_ids(tokens), False, special).decode("utf-8", errors="ignore")

    def token_piece(self, token: int, special: bool = False) -> bytes:
        """The bytes of one token (special: a special token's text too)."""
        return self._live_model().token_to_piece(as_token_ids([token], "a token")[0], special)

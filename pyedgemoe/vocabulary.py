"""A model's vocabulary and header, as the Engine gives them (llama_vocab's API over the native
Model): tokenize, detokenize, a token's bytes, the special tokens, the metadata. Vocabulary is the
part of the Engine that needs the model alone, not its context; VocabularyFile is it without the
weights, a GGUF's vocabulary loaded alone as llama-tokenize loads it (`pyedgemoe tokenize`,
llama-cpp-python's Llama(vocab_only=True))."""
from __future__ import annotations

import os
from abc import ABC, abstractmethod

from pyedgemoe import _native, kv_overrides
from pyedgemoe.errors import InvalidOptionError, ModelLoadError
from pyedgemoe.generation import as_token_ids
from pyedgemoe.model_info import read_model_info
from pyedgemoe.native_exit import closed_error
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
    def n_embd(self) -> int:
        """The width of the model's hidden state (and of its embeddings)."""
        return self._live_model().n_embd

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

    # The native Model has no accessor of this one: it is read from the header as llama_vocab::load
    # reads it (the header's key, else the default of the tokenizer's kind).
    def token_sep(self) -> int | None:
        """The model's separator token (llama_vocab_sep, BERT's [SEP]); None where it has none:
        tokenizer.ggml.seperator_token_id (llama.cpp's spelling), else 102 for a WordPiece ("bert")
        vocabulary; an id outside the vocabulary is none."""
        metadata = self.metadata
        given = metadata.get("tokenizer.ggml.seperator_token_id", "")
        sep = int(given) if given.isdigit() else 102 if metadata.get("tokenizer.ggml.model") == "bert" else None
        return sep if sep is not None and sep < self.n_vocab else None

    @property
    def add_eos(self) -> bool:
        """Whether the model puts EOS after tokenized text (llama_vocab_get_add_eos, --override-kv's
        value included; the native Model has no accessor of it: what tokenizing nothing gives past BOS)."""
        model = self._live_model()
        return len(model.tokenize(b"", True, False)) > int(model.add_bos)

    def is_eog(self, token: int) -> bool:
        """Whether token ends a generation (EOS, EOT, ...)."""
        return self._live_model().is_eog(token)

    def tokenize(self, text: str | bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        """Token ids of text (bytes as they are, those not UTF-8 as llama.cpp reads them, as llama-cpp-python
        passes them); add_bos: the model's BOS first (if it uses one); special: <|im_start|> is one (each by
        its truth, as llama-cpp-python's C booleans take them)."""
        return self._live_model().tokenize(utf8(text), bool(add_bos), bool(special))

    def first_tokens(self, text: str, n: int | None) -> list[int]:
        """The first n tokens of text as tokenize(text) (BOS first, special tokens as text) cuts it
        (None: all): only as much of the text tokenized as they need, doubling (50 MB tokenized whole
        took 3 GB and 40 s, for a prefix)."""
        size = len(text) if n is None else n * 8
        while True:
            tokens = self.tokenize(text[:size], add_bos=True, special=False)
            # 64 tokens past the cut: where the prefix ends, its last tokens may be cut otherwise than the text's
            if size >= len(text) or len(tokens) > n + 64:
                return tokens[:n]
            size *= 2

    def detokenize(self, tokens: list[int], special: bool = False) -> str:
        """The text of tokens; bytes that are not UTF-8 are dropped, as in generated text (TextStream)."""
        return self._live_model().detokenize(as_token_ids(tokens), False, bool(special)).decode("utf-8", errors="ignore")

    def token_piece(self, token: int, special: bool = False) -> bytes:
        """The bytes of one token (special: a special token's text too)."""
        return self._live_model().token_to_piece(as_token_ids([token], "a token")[0], bool(special))


class VocabularyFile(Vocabulary):
    """The vocabulary of the GGUF at path, without its weights; override_kv: the model's metadata
    replaced, llama.cpp's KEY=TYPE:VALUE text or a dict (pyedgemoe.kv_overrides), as the Engine takes it."""

    def __init__(self, path: str | os.PathLike, override_kv: str | dict | None = None) -> None:
        read_model_info(path)  # a file that is not a GGUF llama.cpp loads (or no path): the Engine's clear error
        self.path = os.fspath(path)
        overrides = kv_overrides.items(kv_overrides.canonical(override_kv)) if override_kv else []
        try:
            self._model = _native.Model(self.path, use_mmap=False, vocab_only=True, kv_overrides=overrides)
        except ValueError as e:
            raise InvalidOptionError(str(e)) from None
        except RuntimeError as e:
            raise ModelLoadError(str(e)) from None

    def _live_model(self):
        if self._model is None:
            raise closed_error("this vocabulary is closed")
        return self._model

    @property
    def closed(self) -> bool:
        return self._model is None

    def close(self) -> None:
        self._model = None

"""llama-server's own completion API beside OpenAI's: POST /completion (and /completions) and POST
/infill (fill in the middle, as code editors' plugins ask for it), their bodies and answers as the
pinned llama-server's (tools/server/README.md there): `content`, `stop`, `stop_type`,
`stopping_word`, `tokens`, `tokens_predicted`, `tokens_evaluated`, `timings`, ... and with n_probs
`completion_probabilities`; streamed, `data:` events each with the text of new tokens, the last with
`stop: true` and the totals, and no OpenAI `[DONE]`. It runs on the server's engine thread
(EngineQueue): the prompt's tokens are made there, and the text a token at a time as llama-server
makes it (_Slot: bytes that are not UTF-8 as U+FFFD, n_predict exact, the end-of-generation token
counted)."""
from __future__ import annotations

import math
import time
from typing import Iterator

from pyedgemoe.generation import RANDOM_SEED, SamplingParams
from pyedgemoe.server.openai_errors import APIError

# llama-server's names of SamplingParams' settings
_SAMPLING_NAMES = {"mirostat": "mirostat_mode", "repeat_last_n": "penalty_last_n"}
# what an /infill prompt holds that its body gives, besides the sampling
_INFILL_FIELDS = ("input_prefix", "input_suffix", "input_extra")


def prompt_tokens(engine, prompt: str | list[int | str]) -> list[int]:
    """llama-server's tokens of a prompt (its tokenize_mixed): each text with its special tokens
    parsed, the model's BOS before the first part where that is text; token ids as they are."""
    parts = [prompt] if isinstance(prompt, str) else prompt
    tokens: list[int] = []
    for i, part in enumerate(parts):
        tokens += engine.tokenize(part, add_bos=i == 0, special=True) if isinstance(part, str) else [part]
    return tokens


def infill_tokens(engine, fields: dict, prompt: str, n_batch: int) -> list[int]:
    """llama-server's /infill prompt (its format_prompt_infill, the repository-level pattern of
    Qwen2.5-Coder): the other files (input_extra) as far as the context leaves room, then
    [FIM_PRE] prefix prompt [FIM_SUF] suffix [FIM_MID], the prefix's last 3/4 of a batch and the
    suffix's first 1/4 taken."""
    fim = engine.fim_tokens()
    missing = [role for role in ("pre", "suf", "mid") if fim[role] is None]
    if missing:
        raise APIError(400, f"infill is not supported by this model: it has no fill-in-the-middle {', '.join(missing)} "
                       "token (a code model's GGUF has them)", "not_supported")

    def text(t: str, special: bool = False) -> list[int]:
        return engine.tokenize(t, add_bos=False, special=special)

    extra = [fim["rep"], *text("myproject\n")] if fim["rep"] is not None else []
    for chunk in fields.get("input_extra") or []:
        if fim["sep"] is not None:
            extra += [fim["sep"], *text(chunk.get("filename", "tmp") + "\n")]
        else:
            extra += text("\n\n--- snippet ---\n\n")
        extra += text(chunk["text"])
    if fim["sep"] is not None:
        extra += [fim["sep"], *text("filename\n")]
    prefix, suffix, middle = text(fields["input_prefix"]), text(fields["input_suffix"]), text(prompt, special=True)
    n_prefix = min(len(prefix), 3 * (n_batch // 4))
    n_suffix = min(len(suffix), max(0, n_batch // 4 - (2 + len(middle))))
    n_extra = min(max(0, engine.n_ctx - n_batch + 2), len(extra))  # llama-server's n_predict: -1
    bos = [engine.token_bos()] if engine.add_bos and engine.token_bos() is not None else []
    return (extra[len(extra) - n_extra:] + bos + [fim["pre"], *prefix[len(prefix) - n_prefix:], *middle]
            + [fim["suf"], *suffix[:n_suffix]] + [fim["mid"]])


def completion_chunks(engine, tokens: list[int], options: dict, stream: bool, model_id: str) -> Iterator[dict]:
    """The answer to a /completion (or /infill) of tokens, options its body's settings as
    request_params checked them: streamed, llama-server's event for each token whose text is
    whole UTF-8 and a last one with the totals; else that one with the whole text. Bad settings
    raise here, before the first chunk."""
    options = dict(options)
    max_tokens = options.pop("max_tokens", None)
    stop = options.pop("stop", [])
    n_probs = options.pop("n_probs", options.pop("logprobs", 0))  # llama-server's other name, popped either way
    ignore_eos = options.pop("ignore_eos", False)
    return_tokens = options.pop("return_tokens", False)
    fields = options.pop("response_fields", [])
    slot = _Slot(engine, [s.encode() for s in stop], options.pop("n_indent", 0), options.pop("t_max_predict_ms", 0))
    for theirs, ours in _SAMPLING_NAMES.items():
        if theirs in options:
            options[ours] = options.pop(theirs)
    if options.get("penalty_last_n") == -1:  # llama-server's: the context's size
        options["penalty_last_n"] = engine.n_ctx
    if "logit_bias" in options:
        options["logit_bias"] = _token_biases(engine, options["logit_bias"])
    sampling = SamplingParams.of(options)
    generation, picks = engine._generation(tokens, max_tokens, sampling, ignore_eos, n_probs=n_probs or None)
    settings = _settings(sampling, max_tokens, stop, n_probs, ignore_eos, stream)
    return _chunks(engine, slot, generation, picks, stream, return_tokens, n_probs, settings, model_id, fields)


class _Slot:
    """llama-server's text of a generation, a token at a time (its process_token): the text is
    sent once it is whole UTF-8, but what may begin a stop string; a stop string ends it, cut off;
    so does a line less indented than n_indent (the line cut off), and a line ending after
    t_max_predict_ms of generation (code editors' plugins ask for both)."""

    def __init__(self, engine, stop: list[bytes], n_indent: int = 0, t_max_predict_ms: int = 0) -> None:
        self._engine, self._stop = engine, stop
        self.text, self.sent = b"", 0  # the generated bytes, and how many of them were sent
        self.tokens: list[int] = []
        self.stopping_word: bytes | None = None
        self.has_new_line, self.limited = False, False  # a line break was sent; n_indent or the time ended it
        self._n_indent, self._seconds, self._line, self._start = n_indent, t_max_predict_ms / 1000, 0, None

    def take(self, token: int, is_eog: bool = False) -> bytes | None:
        """The text to send with token (b"" while a stop string may begin), None while the text
        ends in a cut character."""
        self._start = self._start or time.perf_counter()
        piece = self._engine.token_piece(token)
        self.text += piece
        self.tokens.append(token)
        if _whole_utf8(self.text) < len(self.text):
            return None
        start = min(self.sent, len(self.text))
        tail = self.text[start:]
        at, word = _full_stop(tail, len(piece), self._stop)
        if at is not None:
            self.stopping_word = word
            self.text = self.text[:start + at]
        elif not is_eog and _partial_stop(tail, self._stop) is not None:
            return b""
        out = self.text[start:]
        self.sent += len(out)
        return out

    def check_limits(self, sent: bytes | None) -> None:
        """After a token whose text sent was `sent`: the indentation of the last whole line, the time."""
        if self.has_new_line and self._n_indent > 0:
            if self._line > 0:
                pos = self._line
                while pos < len(self.text) and self.text[pos] in b" \t":
                    pos += 1
                if pos < len(self.text) and pos - self._line < self._n_indent:
                    self.text, self.limited = self.text[:pos], True
            line = self.text.find(b"\n", self._line)
            self._line = line + 1 if line >= 0 else self._line
        if sent and b"\n" in sent:
            self.has_new_line = True
            if 0 < self._seconds < time.perf_counter() - self._start:
                self.limited = True


def _chunks(engine, slot: _Slot, generation, picks: Iterator[int], stream: bool, return_tokens: bool,
            n_probs: int, settings: dict, model_id: str, fields: list[str]) -> Iterator[dict]:
    n_prompt = len(generation.prompt)
    probabilities = []  # n_probs: of each token whose text was sent (the end-of-generation token's too)

    def event(token: int, is_eog: bool = False) -> Iterator[dict]:
        logprob = (generation.end[1] if is_eog else generation.logprobs[len(slot.tokens)]) if n_probs else None
        text = slot.take(token, is_eog)
        slot.check_limits(text)
        if text is None:
            return
        if n_probs:
            probabilities.append(_probability(engine, logprob, text))
        if stream:
            chunk = {"index": 0, "content": _text(text), "tokens": [token], "stop": False, "id_slot": 0,
                     "tokens_predicted": len(slot.tokens), "tokens_evaluated": n_prompt}
            if n_probs:
                chunk["completion_probabilities"] = probabilities[-1:]
            yield chunk

    try:
        for token in picks:
            yield from event(token)
            if slot.stopping_word is not None or slot.limited:
                break
    finally:  # a stop string, or the client gone: the Engine's sequence is free at once
        picks.close()
    if generation.end is not None:  # picked after the last token taken (not when a stop or limit ended it)
        yield from event(generation.end[0], is_eog=True)
    if stream and slot.sent < len(slot.text):  # what a stop string might have begun, once it cannot
        yield {"index": 0, "content": _text(slot.text[slot.sent:]), "tokens": [], "stop": False, "id_slot": 0,
               "tokens_predicted": len(slot.tokens), "tokens_evaluated": n_prompt}
    stop_type = "eos" if generation.end is not None else "word" if slot.stopping_word is not None else "limit"
    text = _text(slot.text)
    last = {"index": 0, "content": "" if stream else text, "tokens": slot.tokens if return_tokens and not stream else [],
            "id_slot": 0, "stop": True, "model": model_id, "tokens_predicted": len(slot.tokens),
            "tokens_evaluated": n_prompt, "generation_settings": settings,
            "prompt": engine.detokenize(generation.prompt, special=True), "has_new_line": slot.has_new_line,
            "truncated": False, "stop_type": stop_type, "stopping_word": _text(slot.stopping_word or b""),
            "tokens_cached": n_prompt + max(len(slot.tokens) - 1, 0),
            "timings": _timings(generation.timings, len(slot.tokens))}
    if n_probs and not stream:
        # as llama-server: without a stop string's tokens, as many as its text makes
        cut = len(engine.tokenize(last["stopping_word"], add_bos=False)) if slot.stopping_word else 0
        last["completion_probabilities"] = probabilities[:max(0, len(probabilities) - cut)]
    yield _fields(last, fields) if fields else last


def _fields(answer: dict, paths: list[str]) -> dict:
    """llama-server's response_fields: the values at these paths ("timings/prompt_n"), by path."""
    out = {}
    for path in paths:
        value, found = answer, True
        for key in path.split("/"):
            found = found and isinstance(value, dict) and key in value
            value = value[key] if found else None
        if found:
            out[path] = value
    return out


def _text(raw: bytes) -> str:
    """Bytes as llama-server's JSON writes them: those that are not UTF-8 as U+FFFD."""
    return raw.decode("utf-8", errors="replace")


def _whole_utf8(text: bytes) -> int:
    """llama-server's validate_utf8: the length of text without a character cut at its end."""
    for i in range(1, min(4, len(text)) + 1):
        c = text[-i]
        if (c & 0xE0 == 0xC0 and i < 2) or (c & 0xF0 == 0xE0 and i < 3) or (c & 0xF8 == 0xF0 and i < 4):
            return len(text) - i
    return len(text)


def _full_stop(tail: bytes, last_piece: int, stop: list[bytes]) -> tuple[int | None, bytes | None]:
    """The first stop string in the text not yet sent, searched where the last token could have
    completed it (llama-server's find_stopping_strings, full): where, and which."""
    found = (None, None)
    for word in stop:
        at = tail.find(word, max(0, len(tail) - len(word) - last_piece))
        if at >= 0 and (found[0] is None or at < found[0]):
            found = (at, word)
    return found


def _partial_stop(tail: bytes, stop: list[bytes]) -> int | None:
    """Where a stop string may begin at the end of the text (llama-server's partial stop)."""
    found = None
    for word in stop:
        for n in range(min(len(tail), len(word)), 0, -1):
            if tail.endswith(word[:n]):
                found = len(tail) - n if found is None else min(found, len(tail) - n)
                break
    return found


def _token_biases(engine, pairs: list[tuple[int | str, float]]) -> list[tuple[int, float]]:
    """logit_bias's pairs by token id: a text's bias on each of its tokens, as llama-server's."""
    return [(token, bias) for key, bias in pairs
            for token in (engine.tokenize(key, add_bos=False) if isinstance(key, str) else [key])]


def _probability(engine, t, sent: bytes) -> dict:
    """llama-server's completion_probabilities entry of a token (its TokenLogprob) whose text sent
    was `sent`: its id, that text and its bytes, its log-probability, and the n_probs most likely
    tokens' (top_logprobs, each with its own text)."""
    def entry(token: int, logprob: float, text: bytes) -> dict:
        return {"id": token, "token": _text(text[:_whole_utf8(text)]), "bytes": list(text),
                "logprob": logprob if logprob > -math.inf else -3.4028234663852886e38}  # JSON has no -inf
    return {**entry(t.token, t.logprob, sent),
            "top_logprobs": [entry(i, lp, engine.token_piece(i)) for i, lp in t.top]}


def _timings(t, predicted: int) -> dict:
    """llama-server's timings of a GenerationStats whose generation picked `predicted` tokens (the
    end-of-generation one counted); with speculative decoding, the guessed tokens checked and taken."""
    prompt_n, prompt_ms, predicted_ms = t.n_prompt_tokens - t.n_cached_prompt_tokens, t.prefill_seconds * 1e3, \
        t.decode_seconds * 1e3
    drafts = {"draft_n": t.n_draft_tokens, "draft_n_accepted": t.n_draft_accepted} if t.n_draft_tokens else {}
    return {"cache_n": t.n_cached_prompt_tokens, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": t.prefill_tokens_per_second, "predicted_n": predicted, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / predicted if predicted else 0.0,
            "predicted_per_second": predicted / t.decode_seconds if t.decode_seconds > 0 else 0.0, **drafts}


def _settings(sampling: SamplingParams, max_tokens: int | None, stop: list[str], n_probs: int, ignore_eos: bool,
              stream: bool) -> dict:
    """llama-server's generation_settings: the settings the generation ran with."""
    n_predict = -1 if max_tokens is None else max_tokens
    return {"seed": RANDOM_SEED if sampling.seed is None else sampling.seed, "temperature": sampling.temperature,
            "top_k": sampling.top_k, "top_p": sampling.top_p, "min_p": sampling.min_p, "typical_p": sampling.typical_p,
            "repeat_last_n": sampling.penalty_last_n, "repeat_penalty": sampling.repeat_penalty,
            "presence_penalty": sampling.presence_penalty, "frequency_penalty": sampling.frequency_penalty,
            "mirostat": sampling.mirostat_mode, "mirostat_tau": sampling.mirostat_tau,
            "mirostat_eta": sampling.mirostat_eta, "max_tokens": n_predict, "n_predict": n_predict,
            "ignore_eos": ignore_eos, "stream": stream, "n_probs": n_probs, "stop": stop,
            "grammar": sampling.grammar or ""}


def split_infill(options: dict) -> tuple[dict, dict]:
    """An /infill body's settings apart: (its input_* fields, the rest)."""
    return {k: options[k] for k in _INFILL_FIELDS if k in options}, \
        {k: v for k, v in options.items() if k not in _INFILL_FIELDS}

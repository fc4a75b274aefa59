"""Fill in the middle: a code model's prompt for the text between a prefix and a suffix, made of
its fill-in-the-middle tokens (tokenizer.ggml.fim_pre/suf/mid_token_id; a code model's GGUF has
them, as Qwen3-Coder-30B-A3B's does).

- fim_prompt: [BOS] [FIM_PRE] prefix [FIM_SUF] suffix [FIM_MID], or suffix first (spm: llama.cpp's
  --spm-infill, llama-cpp-python's Llama(spm_infill=True), for models trained that way):
  [BOS] [FIM_SUF] suffix [FIM_PRE] prefix [FIM_MID]. What llama-cpp-python's
  create_completion(prompt, suffix=...) builds and OpenAI's /v1/completions `suffix` asks for.
- completion_prompt: fim_prompt of a completion's prompt and suffix.
- infill_tokens: llama-server's /infill prompt (its format_prompt_infill): the same, after the
  other files of the project, the prefix and suffix cut to fit a batch.

A model without the three tokens cannot fill in: asked to, it is an InvalidOptionError (the
server's 400), where llama-cpp-python 0.3 puts token 0 in their place.
"""
from __future__ import annotations

from pyedgemoe.errors import InvalidOptionError
from pyedgemoe.generation import as_token_ids

FIM_ROLES = ("pre", "suf", "mid")  # those every fill in the middle needs


def fim_roles(engine) -> dict[str, int | None]:
    """The model's fill-in-the-middle tokens by role (pre, suf, mid, rep, sep); InvalidOptionError
    where pre, suf or mid is missing."""
    fim = engine.fim_tokens()
    missing = [role for role in FIM_ROLES if fim[role] is None]
    if missing:
        raise InvalidOptionError(f"fill in the middle is not supported by this model: it has no fill-in-the-middle "
                                 f"{', '.join(missing)} token (a code model's GGUF has them)")
    return fim


def fim_prompt(engine, prefix: list[int], suffix: list[int], spm: bool = False) -> list[int]:
    """The tokens of a fill in the middle between prefix and suffix (token ids, without BOS)."""
    fim = fim_roles(engine)
    before, after = [fim["pre"], *prefix], [fim["suf"], *suffix]
    bos = [engine.token_bos()] if engine.add_bos and engine.token_bos() is not None else []
    return bos + (after + before if spm else before + after) + [fim["mid"]]


def completion_prompt(engine, prompt: str | list[int], suffix: str, spm: bool = False) -> list[int]:
    """fim_prompt of a completion's prompt (text, or token ids) and suffix: the texts tokenized
    without their special tokens' text parsed, as llama-cpp-python's create_completion does them."""
    if not isinstance(suffix, str):
        raise InvalidOptionError(f"suffix must be a string (or None), got {suffix!r}"[:200])
    prefix = engine.tokenize(prompt, add_bos=False) if isinstance(prompt, str) else as_token_ids(prompt, "prompt")
    return fim_prompt(engine, prefix, engine.tokenize(suffix, add_bos=False), spm)


def infill_tokens(engine, prefix: str, suffix: str, middle: str, extra_files: list[dict], n_batch: int,
                  spm: bool = False) -> list[int]:
    """llama-server's /infill prompt (its format_prompt_infill, the repository-level pattern of
    Qwen2.5-Coder): the other files (extra_files, {"text", "filename"}) as far as the context leaves
    room, then fim_prompt of the prefix with the gap's start (middle) after it and the suffix, the
    prefix's last 3/4 of a batch and the suffix's first 1/4 taken."""
    fim = fim_roles(engine)

    def text(t: str, special: bool = False) -> list[int]:
        return engine.tokenize(t, add_bos=False, special=special)

    extra = [fim["rep"], *text("myproject\n")] if fim["rep"] is not None else []
    for chunk in extra_files:
        if fim["sep"] is not None:
            extra += [fim["sep"], *text(chunk.get("filename", "tmp") + "\n")]
        else:
            extra += text("\n\n--- snippet ---\n\n")
        extra += text(chunk["text"])
    if fim["sep"] is not None:
        extra += [fim["sep"], *text("filename\n")]
    before, after, gap = text(prefix), text(suffix), text(middle, special=True)
    n_before = min(len(before), 3 * (n_batch // 4))
    n_after = min(len(after), max(0, n_batch // 4 - (2 + len(gap))))
    n_extra = min(max(0, engine.n_ctx - n_batch + 2), len(extra))  # llama-server's n_predict: -1
    return extra[len(extra) - n_extra:] + fim_prompt(engine, before[len(before) - n_before:] + gap, after[:n_after],
                                                     spm)

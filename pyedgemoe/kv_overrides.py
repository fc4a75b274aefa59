"""Model metadata replaced at load: llama.cpp's --override-kv KEY=TYPE:VALUE[,...] (TYPE int, float,
bool or str) and llama-cpp-python's Llama(kv_overrides={key: value}) (the type by the value's).

The MoE use: `--override-kv qwen3moe.expert_used_count=int:4` routes each token to 4 experts where
the model was trained with 8 (lossy; fewer experts to read and compute). llama.cpp applies an
override to the keys its loader reads; pyedgemoe's load plan reads the same metadata with the
overrides applied (the expert count per token sizes its buffers), so both agree.

Where llama.cpp logs and goes on, or stops the process, these are refused before the load: a
value of another type than the model's key holds (llama.cpp: a warning, the override dropped), a
key the model lacks that gguf-py does not know either (a misspelling: llama.cpp ignores it), an
expert count per token outside 1..expert_count (llama.cpp: GGML_ASSERT), a string over 127 bytes.
"""
from __future__ import annotations

import csv
import difflib
import io

import gguf

from pyedgemoe.errors import InvalidOptionError

TYPES = ("int", "float", "bool", "str")
MAX_STR_BYTES = 127  # llama_model_kv_override's val_str[128]


def canonical(value) -> str:
    """The option's value as llama.cpp's comma list of KEY=TYPE:VALUE, each value as llama.cpp reads
    it back (from that text, or from a dict of llama-cpp-python's kv_overrides); InvalidOptionError
    where an item is malformed."""
    if isinstance(value, dict):
        parsed = [(key, _kind(v), v) for key, v in value.items()]
        for key, kind, v in parsed:
            if not isinstance(key, str) or kind is None:
                raise InvalidOptionError(f"kv_overrides: {key!r} must map to a bool, int, float or str, got {v!r}")
    elif isinstance(value, str):
        parsed = [parse(text) for text in items(value)]
    else:
        raise InvalidOptionError(f"override_kv must be KEY=TYPE:VALUE[,...] or a dict of values, got {value!r}")
    texts = [f"{key}={kind}:{str(v).lower() if kind == 'bool' else v}" for key, kind, v in parsed]
    for text in texts:
        parse(text)  # a dict's values checked as the text's (a string's length)
    out = io.StringIO()
    csv.writer(out, lineterminator="").writerow(texts)
    return out.getvalue()


def items(value: str | None) -> list[str]:
    """A comma list's KEY=TYPE:VALUE items (none for None), as llama.cpp splits them."""
    if any(c in (value or "") for c in "\0\r\n"):
        raise InvalidOptionError("--override-kv: an item holds no NUL and no line break")
    return [text for row in csv.reader([value]) for text in row] if value else []


def as_dict(value: str | None) -> dict:
    """canonical()'s text as llama-cpp-python's kv_overrides (each value's type its own)."""
    return {key: v for key, _, v in map(parse, items(value))}


def parse(text: str) -> tuple[str, str, int | float | bool | str]:
    """An item's key, type and value; InvalidOptionError naming what is wrong with it."""
    key, sep, typed = text.partition("=")
    kind, colon, raw = typed.partition(":")
    if not sep or not key or not colon or kind not in TYPES:
        raise InvalidOptionError(f"--override-kv {text!r}: give KEY=TYPE:VALUE, TYPE one of {', '.join(TYPES)}")
    if len(key.encode()) > 127 or any(c in text for c in "\0\r\n"):
        raise InvalidOptionError(f"--override-kv {text[:60]!r}: a key is at most 127 bytes, and an item holds no NUL "
                                 "and no line break")
    try:
        value = {"int": int, "float": float, "str": str}[kind](raw) if kind != "bool" else \
            {"true": True, "false": False}[raw]
    except (ValueError, KeyError):
        raise InvalidOptionError(f"--override-kv {text!r}: {raw!r} is not a{'n' if kind == 'int' else ''} {kind}"
                                 + (" (true or false)" if kind == "bool" else "")) from None
    if kind == "int" and not -2**63 <= value < 2**63:
        raise InvalidOptionError(f"--override-kv {key}: {value} is beyond a 64-bit integer")
    if kind == "str" and len(raw.encode()) > MAX_STR_BYTES:
        raise InvalidOptionError(f"--override-kv {key}: a string value is at most {MAX_STR_BYTES} bytes")
    return key, kind, value


def applied(metadata: dict, value: str | None) -> dict:
    """metadata (a GGUF's key-values, typed) with the overrides of canonical() text `value` in
    place; InvalidOptionError for one that llama.cpp would drop or stop on (module doc)."""
    out = dict(metadata)
    arch = str(metadata.get("general.architecture", ""))
    for text in items(value):
        key, kind, new = parse(text)
        if key in metadata:
            held = _kind(metadata[key])
            if held != kind:
                raise InvalidOptionError(f"--override-kv {key}: the model holds {'an array' if held is None else held}"
                                         f" there, not {kind}")
        elif key not in _known_keys(arch):
            close = difflib.get_close_matches(key, list(metadata) + sorted(_known_keys(arch)), n=1)
            raise InvalidOptionError(f"--override-kv {key}: no such key in the model, nor among the keys GGUF defines"
                                     + (f"; did you mean {close[0]}?" if close else ""))
        out[key] = new
    used = f"{arch}.expert_used_count"
    n_expert = out.get(f"{arch}.expert_count", 0)
    if used in out and out[used] != metadata.get(used) and not 1 <= out[used] <= n_expert:
        raise InvalidOptionError(f"--override-kv {used}: {out[used]} is not within 1..{n_expert} (the model's experts)")
    return out


def _kind(value) -> str | None:
    """The override type of a value (bool before int: a bool is an int); None for another (a
    metadata array, which llama.cpp does not override)."""
    return next((name for name, t in (("bool", bool), ("int", int), ("float", float), ("str", str))
                 if isinstance(value, t)), None)


def _known_keys(arch: str) -> set[str]:
    """The metadata keys gguf-py names (its Keys tables), for the model's architecture."""
    keys = set()
    for table in (t for t in vars(gguf.Keys).values() if isinstance(t, type)):
        for name, key in vars(table).items():
            if isinstance(key, str) and not name.startswith("_"):
                keys.add(key.replace("{arch}", arch))  # those with other placeholders match nothing
    return keys

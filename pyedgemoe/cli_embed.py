"""`pyedgemoe embed`: llama.cpp's llama-embedding. The prompt is split into texts at a separator
(a line break by default), each text's embeddings computed (Engine.embed: a row per token, or one
pooled vector with --pooling mean, cls or last), every row normalized as --embd-normalize says
(pyedgemoe.embeddings.normalized) and printed as llama-embedding prints them: its default text
(the first and last values of each row; with pooling, the vectors and the texts' cosine
similarities), or --embd-output-format array, json (OpenAI's list), json+ (json and the
similarities) or raw (a row per line). What it prints is bytes, as llama-embedding's printf writes
them (a text's first bytes name it in the similarity matrix)."""
from __future__ import annotations

import numpy as np

from pyedgemoe.embeddings import normalized

FORMATS = ("", "array", "json", "json+", "raw")


def split_texts(prompt: str, separator: str) -> list[str]:
    """The texts of a prompt, as llama-embedding splits it (an empty part is a text too)."""
    return prompt.split(separator)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """llama.cpp's common_embd_similarity_cos: two zero vectors are alike (1), one zero vector is not (0)."""
    def dot(x, y) -> float:  # float products summed in double, as there
        return float(np.sum((x * y).astype(np.float64)))
    s1, s2 = dot(a, a), dot(b, b)
    if s1 == 0 or s2 == 0:
        return 1.0 if s1 == s2 == 0 else 0.0
    return float(np.float32(dot(a, b) / (np.sqrt(s1) * np.sqrt(s2))))


def _value(v: float, integral: bool, pad: bool) -> str:
    """One value as llama-embedding prints it: %9.6f (%6.0f with int16 normalization) in its table,
    %1.7f (%1.0f) in its lists."""
    return (f"{v:6.0f}" if integral else f"{v:9.6f}") if pad else (f"{v:.0f}" if integral else f"{v:.7f}")


def _text_form(rows: np.ndarray, texts: list[str], pooled: bool, integral: bool) -> bytes:
    out = ["\n"]
    if not pooled:
        for j, row in enumerate(rows):
            out.append(f"embedding {j}: " + "".join(_value(v, integral, True) + " " for v in row[:3]) + " ... " +
                       "".join(_value(v, integral, True) + " " for v in row[-3:]) + "\n")
        return "".join(out).encode()
    shown = min(16, rows.shape[1]) if len(texts) > 1 else rows.shape[1]
    for j, row in enumerate(rows):
        out.append(f"embedding {j}: " + "".join(_value(v, integral, True) + " " for v in row[:shown]) + "\n")
    data = "".join(out).encode()
    if len(texts) > 1:
        names = [t.encode() for t in texts]
        data += b"\ncosine similarity matrix:\n\n" + b"".join(n[:6].rjust(6) + b" " for n in names) + b"\n"
        for i, row in enumerate(rows):
            data += "".join(f"{cosine(row, other):6.2f} " for other in rows).encode() + names[i][:10].rjust(1) + b"\n"
    return data


def _list_form(rows: np.ndarray, texts: list[str], fmt: str, integral: bool) -> bytes:
    vectors = ["[" + ",".join(_value(v, integral, False) for v in row) + "]" for row in rows]
    if fmt == "array":
        return ("[" + ",".join(vectors) + "]\n").encode()
    if fmt == "raw":
        return "".join(" ".join(_value(v, integral, False) for v in row) + "\n" for row in rows).encode()
    out = '{\n  "object": "list",\n  "data": [\n' + ",\n".join(
        f'    {{\n      "object": "embedding",\n      "index": {j},\n      "embedding": {v}\n    }}'
        for j, v in enumerate(vectors)) + "\n  ]"
    if fmt == "json+" and len(texts) > 1:
        out += ',\n  "cosineSimilarity": [\n' + ",\n".join(
            "    [" + ", ".join(f"{cosine(a, b):6.2f}" for b in rows) + " ]" for a in rows) + "\n  ]"
    return (out + "\n}\n").encode()


def formatted(embeddings: list[np.ndarray], texts: list[str], pooled: bool, fmt: str, normalization: int) -> bytes:
    """What llama-embedding prints to stdout for the texts' embeddings (Engine.embed's, in order),
    normalized as `normalization` says, in format fmt."""
    rows = normalized(np.concatenate([np.atleast_2d(e) for e in embeddings]), normalization)
    integral = normalization == 0
    body = _text_form(rows, texts, pooled, integral) if fmt == "" else _list_form(rows, texts, fmt, integral)
    return body + b"\n"

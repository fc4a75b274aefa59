"""pyedgemoe serve's /completion, /infill, embeddings, /v1/messages and /v1/responses against stock
llama-server's, the same requests to both.

    python scripts/llama_server_parity.py --theirs http://127.0.0.1:8392 --ours http://127.0.0.1:8391

Both serve the same file with the same context and batch (`-c`, `-b`, `-ub`, one sequence) and,
for /infill, the same fill-in-the-middle tokens (docs/server.md, "Checked against llama-server");
with --code, a model trained on code; with --embeddings, the embedding endpoints (both started with
`--embeddings --pooling mean`); with --anthropic, Anthropic's Messages API, with --responses, OpenAI's
Responses API (both given the same chat template: `--chat-template chatml`).
Each request's answer is compared field by field (the text, the tokens, why it stopped, the counts,
the prompt as the model saw it, the probabilities), and each streamed one event by event; prints
what differs and exits 1 where anything does.
"""
from __future__ import annotations

import argparse
import base64
import functools
import http.client
import json
import sys
from urllib.parse import urlparse

import numpy as np

CASES = [
    ("/completion", {"prompt": "Building a website can be done in", "n_predict": 12, "temperature": 0}),
    ("/completion", {"prompt": ["one", 263, 272, " three"], "n_predict": 6, "temperature": 0, "return_tokens": True}),
    ("/completion", {"prompt": "x = ", "n_predict": 24, "temperature": 0, "stop": ["al"]}),
    ("/completion", {"prompt": "abc", "n_predict": 3, "temperature": 0, "n_probs": 2}),
    ("/completion", {"prompt": "x", "logit_bias": [["ab", False], [5, 2.5]], "n_predict": 3, "temperature": 0}),
    ("/completion", {"prompt": "hello", "n_predict": 5, "temperature": 0, "repeat_last_n": 32, "repeat_penalty": 1.3}),
    ("/completion", {"prompt": "a", "n_predict": 48, "seed": 3, "top_k": 3}),  # sampled, to the end of generation
    ("/completion", {"prompt": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "n_predict": 48, "seed": 0,
                     "top_k": 3, "n_probs": 2}),
    ("/completion", {"prompt": "x = ", "n_predict": 3, "temperature": 0, "stop": ["j ret", "rs"]}),
    ("/completion", {"prompt": "x = ", "n_predict": 32, "temperature": 0, "dry_multiplier": 0.8, "dry_base": 1.5,
                     "dry_allowed_length": 1, "dry_sequence_breakers": ["\n"]}),
    ("/completion", {"prompt": "abc", "n_predict": 32, "seed": 5, "xtc_probability": 0.5, "xtc_threshold": 0.05,
                     "top_n_sigma": 1.5, "dynatemp_range": 0.5, "dynatemp_exponent": 1.3, "dry_multiplier": 0.5,
                     "top_k": 0, "min_p": 0}),
    ("/infill", {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n    return c\n", "n_predict": 8,
                 "temperature": 0}),
    ("/infill", {"input_prefix": "x" * 400, "input_suffix": "y" * 400, "prompt": "z", "n_predict": 8,
                 "temperature": 0}),
    ("/infill", {"input_prefix": "a", "input_suffix": "b", "n_predict": 4, "temperature": 0,
                 "input_extra": [{"filename": "u.py", "text": "def h():\n  pass\n"}]}),
    ("/completion", {"prompt": "abc", "n_predict": 24, "seed": 11, "samplers": "kyt", "top_k": 5,
                     "repeat_penalty": 1.5}),  # in another order, without the penalties
    # as llama.vim asks (its samplers, indentation, time limit and fields)
    ("/infill", {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n", "prompt": "", "n_predict": 32,
                 "top_k": 40, "top_p": 0.9, "seed": 3, "samplers": ["top_k", "top_p", "infill"], "n_indent": 4,
                 "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 60000,
                 "response_fields": ["content", "timings/prompt_n", "timings/predicted_n", "truncated",
                                     "tokens_cached"]}),
]
# for a model trained on code (models/demo.gguf exported to one precision, `pyedgemoe export`), whose
# text has lines: llama.vim's indentation limit and fields, the infill sampler in an order of samplers
CODE_CASES = [
    ("/completion", {"prompt": "def add(a, b):\n    ", "n_predict": 96, "temperature": 0, "n_indent": 4}),
    ("/completion", {"prompt": "class Node(object):\n    def __init__(self):\n        ", "n_predict": 96,
                     "temperature": 0, "n_indent": 8}),
    ("/completion", {"prompt": "import os\n", "n_predict": 64, "seed": 5, "samplers": ["top_k", "top_p", "infill"],
                     "top_k": 40, "top_p": 0.9}),
    ("/completion", {"prompt": "def add(a, b):\n    ", "n_predict": 96, "temperature": 0, "n_indent": 4,
                     "response_fields": ["content", "stop_type", "timings/predicted_n"]}),
]
# with --embeddings (both servers started with `--embeddings --pooling mean`): the embedding endpoints
EMBEDDING_CASES = [
    ("/v1/embeddings", {"input": ["hello world", "x", "Building a website can be done in 10 simple steps"]}),
    ("/v1/embeddings", {"input": [[1, 2, 3], "x"], "encoding_format": "base64"}),
    ("/v1/embeddings", {"input": ["one", 263, 272, " three"]}),  # one input mixing text and token ids
    ("/embeddings", {"content": "hello world", "embd_normalize": -1}),
    ("/embedding", {"content": ["a", "b c"], "embd_normalize": 1}),
    ("/embeddings", {"input": "x", "embd_normalize": 0}),
    ("/v1/embeddings", {"content": "x"}),  # llama-server's own answer there
    ("/v1/embeddings", {"input": []}),
    ("/v1/embeddings", {}),
]
# with --anthropic (both servers given the same chat template): Anthropic's /v1/messages, whole and streamed
ANTHROPIC_CASES = [
    {"max_tokens": 32, "temperature": 0, "messages": [{"role": "user", "content": "def add(a, b):"}]},
    {"max_tokens": 32, "temperature": 0, "system": "You write Python.",
     "messages": [{"role": "user", "content": [{"type": "text", "text": "class Node"}]}]},
    {"max_tokens": 48, "temperature": 0, "system": [{"type": "text", "text": "Code only."}],
     "messages": [{"role": "user", "content": "import os"}, {"role": "assistant", "content": "import sys"},
                  {"role": "user", "content": "def main():"}]},
    {"max_tokens": 64, "temperature": 0, "stop_sequences": ["=?="],  # met: the model repeats "=?"
     "messages": [{"role": "user", "content": "def f(x):"}]},
    {"max_tokens": 24, "temperature": 0, "top_k": 1, "messages": [{"role": "user", "content": "for i in range(10):"}]},
]
# with --responses (both servers given the same chat template): OpenAI's /v1/responses, whole and streamed
RESPONSES_CASES = [
    {"input": "def add(a, b):", "max_output_tokens": 32, "temperature": 0},
    {"input": "class Node", "instructions": "You write Python.", "max_output_tokens": 32, "temperature": 0},
    {"input": [{"role": "developer", "content": "Code only."}, {"role": "user", "content": "import os"},
               {"type": "message", "role": "assistant",  # llama-server needs the type here; OpenAI does not
                "content": [{"type": "output_text", "text": "import sys"}]},
               {"role": "user", "content": [{"type": "input_text", "text": "def main():"}]}],
     "max_output_tokens": 48, "temperature": 0},
    {"input": "for i in range(10):", "max_output_tokens": 24, "temperature": 0, "top_p": 0.5},
]
FIELDS = ("content", "tokens", "stop", "stop_type", "stopping_word", "tokens_predicted", "tokens_evaluated", "prompt",
          "has_new_line", "truncated", "tokens_cached")


def post(base: str, path: str, body: dict) -> tuple[int, str]:
    u = urlparse(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    text = response.read().decode()
    conn.close()
    return response.status, text


def answers(base: str, path: str, body: dict) -> list[dict]:
    """The answer, or a streamed answer's events."""
    status, text = post(base, path, body)
    if status != 200:
        return [{"status": status}]
    if not body.get("stream"):
        return [json.loads(text)]
    return [json.loads(block.removeprefix("data: ")) for block in text.split("\n\n") if block.startswith("data: ")]


def differences(theirs: list[dict], ours: list[dict]) -> list[str]:
    if len(theirs) != len(ours):
        return [f"{len(theirs)} answers or events against {len(ours)}"]
    out = []
    for i, (a, b) in enumerate(zip(theirs, ours)):
        for field in FIELDS + ("status",):
            if a.get(field) != b.get(field):
                out.append(f"[{i}] {field}: {a.get(field)!r} against {b.get(field)!r}")
        for p, q in zip(a.get("completion_probabilities", []), b.get("completion_probabilities", [])):
            if [t["id"] for t in p["top_logprobs"]] != [t["id"] for t in q["top_logprobs"]] or \
                    abs(p["logprob"] - q["logprob"]) > 1e-4 or p["token"] != q["token"]:
                out.append(f"[{i}] probabilities: {p} against {q}")
    return out


def same_embeddings(a, b, where: str = "") -> list[str]:
    """Where two embedding answers differ: the same shape and fields, each number within 1e-6 (JSON
    may write a float's digits either way), base64 vectors decoded; the model's name aside."""
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where}: fields {sorted(a)} against {sorted(b)}"]
        return [d for k in a if k not in ("model", "error") for d in same_embeddings(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{where}: {len(a)} items against {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in same_embeddings(x, y, f"{where}[{i}]")]
    if where.endswith("/embedding") and isinstance(a, str) and isinstance(b, str):  # base64 float32
        x, y = np.frombuffer(base64.b64decode(a), "<f4"), np.frombuffer(base64.b64decode(b), "<f4")
        return [] if x.shape == y.shape and np.allclose(x, y, rtol=0, atol=1e-6) else [f"{where}: base64 vectors"]
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return [] if abs(a - b) <= 1e-6 else [f"{where}: {a} against {b}"]
    return [] if a == b else [f"{where}: {a!r} against {b!r}"]


def embedding_differences(theirs: str, ours: str, path: str, body: dict) -> list[str]:
    (status_a, a), (status_b, b) = post(theirs, path, body), post(ours, path, body)
    if status_a != status_b:
        return [f"status {status_a} against {status_b}"]
    return [] if status_a != 200 else same_embeddings(json.loads(a), json.loads(b))


def anthropic_answer(base: str, body: dict) -> dict:
    """A /v1/messages answer as the fields compared: the blocks, why it stopped, the token counts
    (the prompt's, cached or not), and streamed the events' types and their text joined."""
    status, text = post(base, "/v1/messages", body)
    if status != 200:
        return {"status": status}
    if not body.get("stream"):
        m = json.loads(text)
        return {"content": m["content"], "stop_reason": m["stop_reason"], "output_tokens": m["usage"]["output_tokens"],
                "input_tokens": m["usage"]["input_tokens"] + m["usage"]["cache_read_input_tokens"]}
    events = [json.loads(line.removeprefix("data: ")) for line in text.splitlines() if line.startswith("data: ")]
    start = events[0]["message"]["usage"]
    return {"events": [e["type"] for e in events if e["type"] != "content_block_delta"],
            "text": "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta"),
            "stop_reason": events[-2]["delta"]["stop_reason"], "output_tokens": events[-2]["usage"]["output_tokens"],
            "input_tokens": start["input_tokens"] + start["cache_read_input_tokens"]}


def field_differences(answer, theirs: str, ours: str, path: str, body: dict) -> list[str]:
    """The fields answer(base, body) gives that differ between the two servers."""
    a, b = answer(theirs, body), answer(ours, body)
    return [f"{k}: {a.get(k)!r} against {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def report(cases: list[tuple[str, dict]], differences_of) -> int:
    """Each (path, request) to both servers, differences_of(path, request) printed; 1 where any differ."""
    failed = 0
    for path, request in cases:
        found = differences_of(path, request)
        failed += bool(found)
        print(f"{path} {json.dumps(request)[:70]}: {'the same' if not found else ''}")
        for line in found[:8]:
            print(f"    {line}")
    print(f"{len(cases) - failed} of {len(cases)} the same")
    return 1 if failed else 0


def whole_and_streamed(cases: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    return [(path, {**body, "stream": streamed}) for path, body in cases for streamed in (False, True)]


def responses_answer(base: str, body: dict) -> dict:
    """A /v1/responses answer as the fields compared: the output's items and text, the token counts
    (the prompt's, cached or not); streamed, the text of the deltas and of the final response."""
    status, text = post(base, "/v1/responses", body)
    if status != 200:
        return {"status": status}
    if body.get("stream"):
        events = [json.loads(line.removeprefix("data: ")) for line in text.splitlines() if line.startswith("data: ")]
        deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        response = events[-1]["response"]
    else:
        response, deltas = json.loads(text), None
    usage = response["usage"]
    return {"items": [item["type"] for item in response["output"]], "deltas": deltas,
            "text": "".join(part["text"] for item in response["output"] if item["type"] == "message"
                            for part in item["content"]),
            "input_tokens": usage["input_tokens"], "output_tokens": usage["output_tokens"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--theirs", required=True, help="stock llama-server's URL")
    p.add_argument("--ours", required=True, help="pyedgemoe serve's URL")
    p.add_argument("--code", action="store_true", help="the cases for a model trained on code (CODE_CASES)")
    p.add_argument("--embeddings", action="store_true", help="the embedding endpoints (EMBEDDING_CASES)")
    p.add_argument("--anthropic", action="store_true", help="Anthropic's /v1/messages (ANTHROPIC_CASES)")
    p.add_argument("--responses", action="store_true", help="OpenAI's /v1/responses (RESPONSES_CASES)")
    args = p.parse_args(argv)
    theirs, ours = args.theirs, args.ours
    if args.embeddings:
        return report(EMBEDDING_CASES, functools.partial(embedding_differences, theirs, ours))
    if args.anthropic or args.responses:
        path, cases, answer = ("/v1/messages", ANTHROPIC_CASES, anthropic_answer) if args.anthropic else \
            ("/v1/responses", RESPONSES_CASES, responses_answer)
        return report(whole_and_streamed([(path, {"model": "m", **body}) for body in cases]),
                      lambda _, body: field_differences(answer, theirs, ours, path, body))
    return report(whole_and_streamed(CODE_CASES if args.code else CASES),
                  lambda path, body: differences(answers(theirs, path, body), answers(ours, path, body)))


if __name__ == "__main__":
    sys.exit(main())

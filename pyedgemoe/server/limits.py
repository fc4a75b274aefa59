"""What one client may ask of the server, so that no request can take it over (docs/server.md).

Limits: the ones a user sets (`serve --max-body`, `--timeout`, `--max-connections`).
The others are fixed bounds of a request's content, each checked before any work is done on it:
a body's JSON nesting, the stop strings, the number of most likely tokens asked for, and the
prompt's length in bytes (request_params.PromptBound), which is checked before the prompt is
tokenized. No import of the server's packages here: the CLI shows these defaults without them.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 8 * 2**20  # a request body; more is 413, refused before it is read
    # a request's head and its body must each arrive within this; a connection idle that long between
    # requests is closed too (slowloris: sockets held open by a trickle of bytes)
    timeout_seconds: float = 30.0
    max_connections: int = 64  # open at once; a request on one more is answered 503 (uvicorn's limit_concurrency)


MAX_HEAD_BYTES = 16 * 2**10  # a request's line and headers (h11's default); more is a 400 or 431
MAX_JSON_DEPTH = 64  # nesting of arrays and objects in a body (a JSON schema's included)
# a body's arrays and objects, and its values, counted before it is parsed: Python's parser makes a
# few hundred bytes of each object and tens of each value (a 7 MB body of 200,000 messages took
# 125 MiB), so these bound a parse to about 40 MiB, where --max-body alone does not
MAX_JSON_CONTAINERS = 2**15
MAX_JSON_VALUES = 2**19  # a prompt of token ids: a value each
# the token endpoints' answers are bounded as bodies are: at most MAX_JSON_VALUES tokens (with_pieces
# made an 8 MB text's 1.4 GiB), of a text of at most this many bytes (refused before it is tokenized)
MAX_TOKENIZED_BYTES = 4 * MAX_JSON_VALUES
MAX_STOP_STRINGS = 16  # llama-cpp-python's clients send a few; each is searched for after every token
MAX_STOP_CHARS = 512  # each
MAX_LOGIT_BIAS = 1024  # token ids a request's logit_bias biases (OpenAI's clients send a few)
MAX_EMBEDDING_INPUTS = 2048  # texts one embeddings request embeds (OpenAI's bound)
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs, also a completion's logprobs here
INT32_MAX = 2**31 - 1  # llama.cpp's integers (token ids, top_k): a larger one is out of range
UINT32_MAX = 2**32 - 1  # llama.cpp's seeds

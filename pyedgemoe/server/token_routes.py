"""The token endpoints: llama-server's /tokenize and /detokenize, as its clients call them (to count
a prompt's tokens, to read ids back):

    POST /tokenize   {"content": "...", "add_special": false, "parse_special": true, "with_pieces": false}
                  -> {"tokens": [ids]}, or with_pieces: {"tokens": [{"id": id, "piece": "text"}]} (a
                     piece that is not UTF-8 by itself: its bytes, as a list of numbers)
    POST /detokenize {"tokens": [ids]} -> {"content": "..."}

and llama-cpp-python's server's, as its clients call them:

    POST /extras/tokenize        {"input": "..."} -> {"tokens": [ids]} (BOS and special tokens, as there)
    POST /extras/tokenize/count  {"input": "..."} -> {"count": n}
    POST /extras/detokenize      {"tokens": [ids]} -> {"text": "..."} (bytes that are not UTF-8 dropped;
                                 llama-cpp-python's server fails on them)

A body is checked as the generation endpoints check theirs (unknown fields, wrong types and ids
outside the vocabulary are 400s naming the field); the tokenizer runs on a thread, the native side
without the GIL, so a large content does not hold the other requests. A text of more than
MAX_TOKENIZED_BYTES, or of more than MAX_JSON_VALUES tokens, is a 400 (limits.py).
"""
from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request

from pyedgemoe.server.limits import MAX_JSON_VALUES, MAX_TOKENIZED_BYTES
from pyedgemoe.server.openai_errors import APIError, from_engine_error
from pyedgemoe.server.request_params import (DETOKENIZE_PARAMETERS, EXTRAS_DETOKENIZE_PARAMETERS,
                                             EXTRAS_TOKENIZE_PARAMETERS, TOKENIZE_PARAMETERS, parse_fields)

def _piece(engine, token: int) -> str | list[int]:
    piece = engine.token_piece(token, special=True)
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return list(piece)


def _bounded_tokens(engine, text: str, field: str, add_bos: bool, special: bool) -> list[int]:
    """text's tokens, within the bounds of an answer (limits.py)."""
    if len(text.encode("utf-8")) > MAX_TOKENIZED_BYTES:
        raise APIError(400, f"'{field}' has more than {MAX_TOKENIZED_BYTES} bytes: tokenize it in parts",
                       "invalid_value", field)
    tokens = engine.tokenize(text, add_bos=add_bos, special=special)
    if len(tokens) > MAX_JSON_VALUES:
        raise APIError(400, f"'{field}' has more than {MAX_JSON_VALUES} tokens: tokenize it in parts",
                       "invalid_value", field)
    return tokens


def add_token_routes(app: FastAPI, engine, check_model) -> None:
    """The token endpoints of the server of engine; check_model: the app's check of a request's model name."""
    def extras_tokens(raw: bytes) -> list[int]:
        q = parse_fields(raw, EXTRAS_TOKENIZE_PARAMETERS)
        check_model(q["model"])
        return _bounded_tokens(engine, q["input"], "input", True, True)

    def extras_detokenize(raw: bytes) -> dict:
        q = parse_fields(raw, EXTRAS_DETOKENIZE_PARAMETERS)
        check_model(q["model"])
        return {"text": engine.detokenize(q["tokens"])}

    def tokenize(raw: bytes) -> dict:
        q = parse_fields(raw, TOKENIZE_PARAMETERS)
        tokens = _bounded_tokens(engine, q["content"], "content", q["add_special"], q["parse_special"])
        return {"tokens": [{"id": t, "piece": _piece(engine, t)} for t in tokens] if q["with_pieces"] else tokens}

    def detokenize(raw: bytes) -> dict:
        return {"content": engine.detokenize(parse_fields(raw, DETOKENIZE_PARAMETERS)["tokens"], special=True)}

    async def answer(request: Request, work) -> dict:
        raw = await request.body()
        try:
            return await asyncio.to_thread(work, raw)
        except Exception as e:  # noqa: BLE001 - shaped as OpenAI's error (a bug: a 500 without its text)
            raise from_engine_error(e) from None

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> dict:
        return await answer(request, tokenize)

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> dict:
        return await answer(request, detokenize)

    @app.post("/extras/tokenize")
    async def extras_tokenize_route(request: Request) -> dict:
        return {"tokens": await answer(request, extras_tokens)}

    @app.post("/extras/tokenize/count")
    async def extras_count_route(request: Request) -> dict:
        return {"count": len(await answer(request, extras_tokens))}

    @app.post("/extras/detokenize")
    async def extras_detokenize_route(request: Request) -> dict:
        return await answer(request, extras_detokenize)

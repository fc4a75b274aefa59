"""Embeddings over HTTP, as llama-server serves them when started with `--embeddings`:

    POST /v1/embeddings  {"input": "text" | [texts] | [token ids] | ..., "encoding_format": "float" | "base64"}
                      -> OpenAI's {"object": "list", "data": [{"object": "embedding", "embedding": [...],
                         "index": i}], "model": ..., "usage": {"prompt_tokens": n, "total_tokens": n}}
    POST /embeddings, /embedding  {"content": ... (or "input"), "embd_normalize": 2}
                      -> llama-server's own [{"index": i, "embedding": [[...], ...]}]: a row per token
                         where the model pools none, else one pooled row

Each input is tokenized as llama-server's prompts are (pyedgemoe.server.llama_server_api.prompt_tokens)
and embedded by Engine.embed in one pass: an input longer than that pass (n_ubatch where the
context pools, else n_batch) is refused, as llama-server refuses it. A pooled vector is normalized
as llama.cpp's embd_normalize says (2, euclidean, by default; pyedgemoe.embeddings.normalized). OpenAI's
endpoint needs a pooled vector per input: with the pooling none (a generative model's, unless
`--pooling` says otherwise) it is a 400, as there. The inputs hold one of the server's turns
while they are embedded, queued with the generations (engine_queue.py).
"""
from __future__ import annotations

import asyncio
import base64

import numpy as np
from fastapi import FastAPI, Request

from pyedgemoe import embeddings
from pyedgemoe.server.llama_server_api import prompt_tokens
from pyedgemoe.server.openai_errors import APIError, from_engine_error
from pyedgemoe.server.request_params import EMBEDDING_PARAMETERS, PromptBound, parse_fields

NOT_ENABLED = "This server does not support embeddings. Start it with `--embeddings`"
NOT_POOLED = ("Pooling type 'none' is not OAI compatible. Please use a different pooling type (serve --pooling mean, "
              "last or cls)")


def add_embedding_routes(app: FastAPI, engine, queue, prompt_bound: PromptBound, model_id: str, check_model,
                         enabled: bool) -> None:
    """The embedding endpoints of the server of engine (enabled: `serve --embeddings`, else each is a
    400 saying so); check_model: the app's check of a request's model name."""
    pooled = embeddings.pooling_type(engine) != embeddings.POOLING_NONE

    def inputs(raw: bytes) -> tuple[dict, list[list[int]]]:
        """The request's fields and its inputs' tokens, each checked to fit one pass."""
        q = parse_fields(raw, EMBEDDING_PARAMETERS)
        check_model(q["model"])
        given = q["input"] if q["input"] is not None else q["content"]
        if given is None:
            raise APIError(400, '"input" or "content" must be provided', "missing_required_parameter", "input")
        for p in given:
            prompt_bound.check_text(sum(len(part.encode()) for part in ([p] if isinstance(p, str) else p)
                                        if isinstance(part, str)))
            prompt_bound.check_tokens([part for part in p if isinstance(part, int)] if isinstance(p, list) else [],
                                      "input")
        tokens = [prompt_tokens(engine, p) for p in given]
        limit, what = embeddings.max_tokens(engine)
        for i, ids in enumerate(tokens):
            if not ids:
                raise APIError(400, f"input {i} has no tokens: input content cannot be empty", "invalid_value", "input")
            if len(ids) > limit:
                raise APIError(400, f"input {i} of {len(ids)} tokens is too large to embed: at most {what} {limit} "
                               f"(serve {embeddings.FLAGS[what]} raises it)", "context_length_exceeded", "input")
        return q, tokens

    async def answer(request: Request, openai: bool):
        if not enabled:
            raise APIError(400, NOT_ENABLED, "not_supported")
        if openai and not pooled:
            raise APIError(400, NOT_POOLED, "not_supported")
        try:
            q, tokens = await asyncio.to_thread(inputs, await request.body())
            openai = openai and q["input"] is not None  # llama-server's "content" is answered as its own
            vectors = []
            async with queue.turn(request.is_disconnected):
                for ids in tokens:
                    if await request.is_disconnected():  # the rest is for no one
                        raise APIError(499, "the client closed the request")
                    rows = np.atleast_2d(await queue.call(engine.embed, ids))
                    vectors.append(embeddings.normalized(rows, q["embd_normalize"]) if pooled else rows)
        except Exception as e:  # noqa: BLE001 - shaped as OpenAI's error (a bug: a 500 without its text)
            raise from_engine_error(e) from None
        if not openai:
            return [{"index": i, "embedding": rows.tolist()} for i, rows in enumerate(vectors)]
        n_tokens = sum(map(len, tokens))
        data = [{"embedding": base64.b64encode(rows[0].astype("<f4").tobytes()).decode(), "index": i,
                 "object": "embedding", "encoding_format": "base64"} if q["encoding_format"] == "base64" else
                {"embedding": rows[0].tolist(), "index": i, "object": "embedding"} for i, rows in enumerate(vectors)]
        return {"model": q["model"] or model_id, "object": "list", "usage": {"prompt_tokens": n_tokens,
                                                                              "total_tokens": n_tokens}, "data": data}

    @app.post("/v1/embeddings")
    async def openai_embeddings(request: Request):
        return await answer(request, openai=True)

    @app.post("/embeddings")
    @app.post("/embedding")
    async def native_embeddings(request: Request):
        return await answer(request, openai=False)

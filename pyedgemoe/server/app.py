"""The FastAPI application: OpenAI's /v1/models, /v1/completions and /v1/chat/completions over
one Engine, OpenAI's Responses API (responses_api.py) and Anthropic's Messages API
(anthropic_api.py) over the chat completions, llama-server's own /completion and /infill
(llama_server_api.py), the embeddings (embeddings_api.py), plus /health,
/metrics and /metrics/experts (the expert cache in JSON), and the web pages (web_ui.py)
(docs/server.md).

Generations are produced by the EngineQueue (engine_queue.py), one at a time; a streamed one is
sent as server-sent events (`data: {chunk}` ... `data: [DONE]`), a non-streamed one is the same
chunks joined, so both give the same text.
"""
from __future__ import annotations

import asyncio
import functools
import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from fastapi import FastAPI, Request
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse

from pyedgemoe.chat_formats import joined_message, wants_thinking_tags
from pyedgemoe.completions import chat_text, chat_text_tokens
from pyedgemoe.errors import RemoteDeviceError
from pyedgemoe.fill_in_middle import infill_tokens
from pyedgemoe.server import anthropic_api, llama_server_api, metrics, responses_api
from pyedgemoe.server.embeddings_api import add_embedding_routes
from pyedgemoe.server.engine_queue import EngineQueue, Generation
from pyedgemoe.server.expert_view import expert_view
from pyedgemoe.server.limits import MAX_HEAD_BYTES, Limits
from pyedgemoe.server.middleware import BearerAuth, RequestCounting
from pyedgemoe.server.openai_errors import INTERNAL_ERROR, APIError, from_engine_error
from pyedgemoe.server.request_guards import HeadChecks, JSONBody, SameSite
from pyedgemoe.server.request_params import (CHAT_PARAMETERS, COMPLETION_PARAMETERS, INFILL_PARAMETERS,
                                             NATIVE_COMPLETION_PARAMETERS, NATIVE_NEUTRAL, GenerationRequest,
                                             PromptBound, parse_body, parse_generation)
from pyedgemoe.server.reasoning_control import ReasoningControls
from pyedgemoe.server.slot_routes import add_slot_routes
from pyedgemoe.server.token_routes import add_token_routes
from pyedgemoe.server.web_ui import BUILT_UI, WebUI
from pyedgemoe.tool_calls import call_message

PATHS = {"/health", "/metrics", "/metrics/experts", "/v1/models", "/v1/models/{model}", "/v1/completions",
         "/v1/chat/completions", "/completion", "/completions", "/infill", "/tokenize", "/detokenize",
         "/apply-template", "/", "/experts", "/props", "/slots", "/v1/embeddings", "/embeddings", "/embedding",
         "/extras/tokenize", "/extras/tokenize/count", "/extras/detokenize", "/v1/health", "/models", "/v1/messages",
         "/v1/messages/count_tokens", "/v1/responses", "/responses", "/v1/responses/input_tokens",
         "/v1/chat/completions/input_tokens", "/chat/completions", "/chat/completions/input_tokens",
         "/responses/input_tokens", "/slots/{id_slot}", "/v1/chat/completions/control"}
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _event(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


@dataclass(frozen=True)
class EventFormat:
    """How a streamed answer's chunks are sent: each chunk's events, the end, an error's event."""
    chunk: Callable[[dict], str] = _event
    done: str = ""
    error: Callable[[dict], str] = _event


OPENAI_EVENTS = EventFormat(done="data: [DONE]\n\n")
NATIVE_EVENTS = EventFormat()  # llama-server's own: no [DONE]


def _has_output(chunk: dict, openai: bool) -> bool:
    """A chunk the Engine produced once the prompt's evaluation began: its progress, text, or the end
    (openai: in OpenAI's shape, else llama-server's)."""
    if "prompt_progress" in chunk:
        return True
    if not openai:
        return bool(chunk.get("content")) or chunk.get("stop") is not False
    choice = chunk["choices"][0]
    delta = choice.get("delta", {})
    return bool(choice.get("text") or delta.get("content") or delta.get("reasoning_content") or
                delta.get("tool_calls")) or \
        choice["finish_reason"] is not None


def _openai_end(chunk: dict, include_usage: bool) -> list[dict]:
    """The chunks OpenAI ends a stream with: the finish reason's without the usage, then, asked for
    (stream_options.include_usage), the usage's alone, with no choices; llama-server's timings on
    the last of them, as there. Other chunks go as they are."""
    if "usage" not in chunk:
        return [chunk]
    finish = {k: v for k, v in chunk.items() if k not in ("usage", "timings")}
    last = {**{k: chunk[k] for k in ("id", "object", "created", "model")}, "choices": [], "usage": chunk["usage"]}
    ends = [finish, last] if include_usage else [finish]
    if "timings" in chunk:
        ends[-1] = {**ends[-1], "timings": chunk["timings"]}
    return ends


def _joined_logprobs(chunks: list[dict], keys: tuple[str, ...], empty: dict) -> dict | None:
    """The chunks' logprobs as one: each key's lists joined (None when none carries any)."""
    parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"] is not None]
    if not parts:
        return None
    return {**empty, **{key: [item for part in parts for item in part[key]] for key in keys}}


def _joined_completion(chunks: list[dict]) -> dict:
    last = chunks[-1]
    logprobs = _joined_logprobs(chunks, ("tokens", "text_offset", "token_logprobs", "top_logprobs"), {})
    return {"id": last["id"], "object": "text_completion", "created": last["created"], "model": last["model"],
            "choices": [{"text": "".join(c["choices"][0]["text"] for c in chunks), "index": 0, "logprobs": logprobs,
                         "finish_reason": last["choices"][0]["finish_reason"]}],
            "usage": last.get("usage"), "timings": last.get("timings")}


def _joined_chat_completion(chunks: list[dict]) -> dict:
    last = chunks[-1]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    forced = [d["tool_calls"][0] for d in deltas if d.get("function_call")]  # a forced call's pieces
    message = call_message(forced[0]["function"]["name"], "".join(c["function"]["arguments"] for c in forced),
                           forced[0]["id"]) if forced else joined_message(deltas)
    logprobs = _joined_logprobs(chunks, ("content",), {"refusal": None})
    return {"id": last["id"], "object": "chat.completion", "created": last["created"], "model": last["model"],
            "choices": [{"index": 0, "message": message, "logprobs": logprobs,
                         "finish_reason": last["choices"][0]["finish_reason"]}],
            "usage": last.get("usage"), "timings": last.get("timings")}


def _chat_keywords(r: GenerationRequest, defaults: Mapping) -> dict:
    """A chat request's Engine keywords over the server's defaults; the template's variables merged
    by name, as llama-server merges its --chat-template-kwargs with a request's; with
    defaults["prefill_assistant"] (llama-server's default, `--no-prefill-assistant` not), a last
    message of the assistant's is continued where the request does not say (an assistant's prefill)."""
    given = r.engine_kwargs
    merged = {**defaults, **given}
    if defaults.get("chat_template_kwargs") and given.get("chat_template_kwargs"):
        merged["chat_template_kwargs"] = {**defaults["chat_template_kwargs"], **given["chat_template_kwargs"]}
    last = r.messages[-1] if r.messages else {}
    if merged.pop("prefill_assistant", False) and "continue_final_message" not in given and \
            given.get("add_generation_prompt") is not True and last.get("role") == "assistant" and \
            not last.get("tool_calls"):
        merged["continue_final_message"] = True
    return merged


def _with_request_defaults(given: dict, defaults: Mapping) -> dict:
    """A request's Engine keywords over the server's defaults; a default grammar or JSON schema only
    where the request constrains its answer in no way of its own (as llama-server, whose tools and
    response_format give a request its grammar)."""
    constrained = any(given.get(k) is not None for k in ("grammar", "json_schema", "response_format", "tools"))
    return {**{k: v for k, v in defaults.items() if not (constrained and k in ("grammar", "json_schema"))}, **given}


def create_app(engine, *, model_id: str, model_aliases: tuple[str, ...] = (), api_keys: tuple[str, ...] = (),
               limits: Limits = Limits(), allowed_hosts: tuple[str, ...] = ("*",),
               chat_defaults: Mapping = MappingProxyType({}), request_defaults: Mapping = MappingProxyType({}),
               ui_dir: Path | None = BUILT_UI, web_pages: bool = True, embeddings: bool = False,
               spm_infill: bool = False, slot_directory: str | None = None) -> FastAPI:
    """The server of engine, answering to model_id (and model_aliases, e.g. the path it was
    loaded from); with api_keys, every path but /health needs `Authorization: Bearer KEY`, one of them.
    limits bound what a request may ask (limits.py); allowed_hosts: the names, besides IP addresses
    and localhost, it may be reached by (request_guards.py); any by default, for a deployment under
    names of its own (`pyedgemoe serve` answers to none unless told); ui_dir: llama.cpp's built web
    UI, served at / when there (web_ui.py); web_pages: False serves no page (`serve --no-webui`);
    chat_defaults: a chat request's Engine keywords where it gives none (`serve --reasoning-format`,
    `--chat-template-kwargs`: those merged by name);
    request_defaults: every generation request's Engine keywords where it gives none (`serve --temp`,
    `-n`, ...: llama-server's defaults; _with_request_defaults);
    embeddings: the embedding endpoints answer (`serve --embeddings`; embeddings_api.py); spm_infill: fill
    in the middle with the suffix first (`serve --spm-infill`; fill_in_middle.py); slot_directory: where
    slot actions keep their files (`serve --slot-save-path`; slot_routes.py; None: no slot actions).
    app.state.engine_queue.close() after the server stopped waits for the Engine's thread."""
    queue = EngineQueue(engine)
    controls = ReasoningControls()
    prompt_bound = PromptBound(engine)
    web_ui = WebUI(ui_dir, web_pages)
    requests = metrics.RequestCounts(PATHS)
    names = {model_id, *model_aliases}
    created = int(os.path.getmtime(engine.model_path)) if os.path.exists(engine.model_path) else int(time.time())
    model_card = {"id": model_id, "object": "model", "created": created, "owned_by": "pyedgemoe"}

    app = FastAPI(title="pyedgemoe", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine_queue = queue

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> Response:
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> Response:
        message = {404: f"no such path: {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(e.status_code, str(e.detail))
        return APIError(e.status_code, message).response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> Response:
        return APIError(500, INTERNAL_ERROR).response()  # a bug: uvicorn logs its traceback

    def check_model(name: str | None) -> None:
        if name is not None and name not in names:
            raise APIError(404, f"the model {name!r} does not exist: this server serves {model_id!r}",
                           "model_not_found", "model")

    def named(chunk: dict) -> dict:
        return {**chunk, "model": model_id}

    async def generate(request: Request, start, stream: bool, join, openai: bool = True,
                       events: EventFormat = OPENAI_EVENTS, include_usage: bool | None = None) -> Response:
        """Queues start (an Engine call that streams chunks) and answers with its chunks: as events
        when streamed (in the events' format), else joined into one object. An error before the first
        token (the prompt does not fit, a bad option) is an error response; one while streaming is an
        error event. openai: OpenAI's chunks, each named by the model, the events ending in [DONE];
        else llama-server's, as they come (its last one named, without `stop: false`; response_fields
        may leave it only some fields) and the last one the end. include_usage (OpenAI's endpoints'):
        a stream's usage in a chunk of its own, or none (_openai_end)."""
        generation = queue.generate(start, request.is_disconnected)
        name = named if openai else lambda chunk: chunk
        chunks: list[dict] = []  # streamed: those up to the first text, sent once the prompt is known to fit
        try:
            while (chunk := await generation.next()) is not None:
                chunks.append(name(chunk))
                if stream and _has_output(chunk, openai):
                    break
        except Exception as e:  # noqa: BLE001 - shaped as OpenAI's error
            generation.abandon()
            raise from_engine_error(e) from None
        if stream:
            end = (lambda chunk: [chunk]) if include_usage is None else \
                functools.partial(_openai_end, include_usage=include_usage)
            return StreamingResponse(_events(generation, chunks, name, events if openai else NATIVE_EVENTS, end),
                                     media_type="text/event-stream", headers=_SSE_HEADERS)
        if not generation.finished:  # the client left before its turn or during the generation
            raise APIError(499, "the client closed the request")
        return JSONResponse(join(chunks))

    async def _events(generation: Generation, first: list[dict], name, events: EventFormat, end):
        try:
            for chunk in first:
                yield "".join(map(events.chunk, end(chunk)))
            while (chunk := await generation.next()) is not None:
                yield "".join(map(events.chunk, end(name(chunk))))
            if events.done:
                yield events.done
        except Exception as e:  # noqa: BLE001 - the stream has started: the error is an event
            yield events.error(from_engine_error(e).body())
        finally:
            generation.abandon()  # the client left (cancelled) or the stream ended: the engine moves on

    def checked(raw: bytes, parameters: dict, required: str, neutral: dict | None, convert) -> GenerationRequest:
        """The request checked, its prompt's size too: all before the Engine sees it (an /infill's
        text around the gap is cut to fit, as llama-server cuts it). convert: another API's body as
        the one parameters describe."""
        parsed = parse_generation(convert(parse_body(raw)), parameters, required, neutral)
        check_model(parsed.model)
        parsed.engine_kwargs = _with_request_defaults(parsed.engine_kwargs, request_defaults)
        if isinstance(parsed.prompt, list):  # token ids, or llama-server's text and token ids
            prompt_bound.check_tokens([p for p in parsed.prompt if isinstance(p, int)])
        prompt_bound.check_text(parsed.text_bytes())
        return parsed

    async def request_body(request: Request, parameters: dict, required: str, neutral: dict | None = None,
                           convert=lambda body: body) -> GenerationRequest:
        # on a thread of its own: the checks of a large body leave the event loop free for others
        return await asyncio.to_thread(checked, await request.body(), parameters, required, neutral, convert)

    def chat_rendering(r: GenerationRequest) -> tuple[str, object]:
        """The prompt text of a chat request (its messages, tools and template's variables), and its
        ChatTurn where the answer is parsed for calls or thoughts (completions.chat_text)."""
        given = _chat_keywords(r, chat_defaults)
        return chat_text(engine, r.messages, given.get("tools"), given.get("tool_choice"),
                         given.get("chat_template_kwargs"), given.get("parallel_tool_calls"),
                         reasoning_format=given.get("reasoning_format"), thinking_tags=wants_thinking_tags(given),
                         continue_final_message=given.get("continue_final_message"),
                         add_generation_prompt=given.get("add_generation_prompt"))

    def chat_prompt(r: GenerationRequest) -> str:
        return chat_rendering(r)[0]

    async def answer_is_parsed(r: GenerationRequest) -> bool:
        """Whether the chat's answer is parsed for calls or thoughts (the Engine's stream then gives no logprobs)."""
        try:
            return await asyncio.to_thread(lambda: chat_rendering(r)[1] is not None)
        except Exception as e:  # noqa: BLE001 - shaped as OpenAI's error
            raise from_engine_error(e) from None

    def chat_prompt_length(r: GenerationRequest) -> int:
        return len(chat_text_tokens(engine, chat_prompt(r)))

    @app.get("/health")
    @app.get("/v1/health")
    async def health() -> dict:
        try:
            engine.n_ctx  # raises once a remote device (RPC worker) is lost: then no request can be answered
        except RemoteDeviceError as e:
            raise from_engine_error(e) from None
        return {"status": "ok", "model": model_id, "queue_depth": queue.waiting}

    @app.get("/metrics")
    async def metrics_text() -> Response:
        stats = await queue.call(engine.stats)
        return Response(metrics.render(stats, requests, queue.waiting, queue.running), media_type=metrics.CONTENT_TYPE)

    @app.get("/metrics/experts")
    async def expert_cache() -> dict:
        return expert_view(await queue.call(engine.stats), model_id)

    @app.get("/v1/models")
    @app.get("/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str) -> dict:
        check_model(name)
        return model_card

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        r = await request_body(request, COMPLETION_PARAMETERS, "prompt")
        start = functools.partial(engine.create_completion, r.prompt, stream=True, spm_infill=spm_infill,
                                  **r.engine_kwargs)
        return await generate(request, start, r.stream, _joined_completion, include_usage=r.include_usage)

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        r = await request_body(request, CHAT_PARAMETERS, "messages")
        kwargs = _chat_keywords(r, chat_defaults)
        if not r.stream and kwargs.get("logprobs") and await answer_is_parsed(r):
            # the Engine's stream parsed for calls or thoughts has no logprobs (llama-server's rule,
            # for a stream): its whole answer, which its client's leaving does not cut short
            def whole():
                yield engine.create_chat_completion(r.messages, stream=False, **kwargs)
            return await generate(request, controls.arm(whole, kwargs), False, lambda chunks: chunks[-1])
        start = controls.arm(lambda: engine.create_chat_completion(r.messages, stream=True, **kwargs), kwargs)
        return await generate(request, start, r.stream, _joined_chat_completion, include_usage=r.include_usage)

    @app.post("/completion")
    @app.post("/completions")
    async def native_completion(request: Request) -> Response:
        """llama-server's own completion (llama_server_api.py)."""
        r = await request_body(request, NATIVE_COMPLETION_PARAMETERS, "prompt", NATIVE_NEUTRAL)

        def start():
            tokens = llama_server_api.prompt_tokens(engine, r.prompt)
            return llama_server_api.completion_chunks(engine, tokens, r.engine_kwargs, r.stream, model_id)
        return await generate(request, start, r.stream, lambda chunks: chunks[-1], openai=False)

    @app.post("/infill")
    async def infill(request: Request) -> Response:
        """llama-server's fill in the middle: the text between input_prefix and input_suffix."""
        r = await request_body(request, INFILL_PARAMETERS, "input_prefix", NATIVE_NEUTRAL)
        fields, options = llama_server_api.split_infill(r.engine_kwargs)
        if "input_suffix" not in fields:
            raise APIError(400, "'input_suffix' is required", "missing_required_parameter", "input_suffix")

        def start():
            tokens = infill_tokens(engine, fields["input_prefix"], fields["input_suffix"], r.prompt or "",
                                   fields.get("input_extra") or [], engine.plan.n_batch, spm_infill)
            return llama_server_api.completion_chunks(engine, tokens, options, r.stream, model_id)
        return await generate(request, start, r.stream, lambda chunks: chunks[-1], openai=False)

    @app.post("/apply-template")
    async def apply_template(request: Request) -> dict:
        """llama-server's: the prompt text a chat request makes (its messages, tools and template's variables)."""
        r = await request_body(request, CHAT_PARAMETERS, "messages")
        try:
            return {"prompt": await asyncio.to_thread(chat_prompt, r)}
        except Exception as e:  # noqa: BLE001 - shaped as OpenAI's error
            raise from_engine_error(e) from None

    @app.post("/v1/messages")
    async def anthropic_messages(request: Request) -> Response:
        """Anthropic's Messages API over the chat completions (anthropic_api.py)."""
        r = await request_body(request, CHAT_PARAMETERS, "messages", convert=anthropic_api.chat_request)
        start = functools.partial(engine.create_chat_completion, r.messages, stream=True, timings_per_token=True,
                                  **_chat_keywords(r, chat_defaults))
        stream = anthropic_api.EventStream()
        return await generate(request, start, r.stream, lambda chunks: anthropic_api.message(_joined_chat_completion(chunks)),
                              events=EventFormat(stream.events, "", stream.error))

    @app.post("/v1/responses")
    @app.post("/responses")
    async def responses(request: Request) -> Response:
        """OpenAI's Responses API over the chat completions (responses_api.py)."""
        body: dict = {}  # the request as sent: the response echoes some of it

        def convert(sent):
            body.update(sent)  # a JSON object (parse_body)
            return responses_api.chat_request(sent)
        r = await request_body(request, CHAT_PARAMETERS, "messages", convert=convert)
        start = functools.partial(engine.create_chat_completion, r.messages, stream=True,
                                  **_chat_keywords(r, chat_defaults))
        shape = responses_api.ResponseShape(body, model_id)
        return await generate(request, start, r.stream, lambda chunks: shape.response(_joined_chat_completion(chunks)),
                              events=EventFormat(shape.events, "", shape.error))

    async def input_tokens(request: Request, convert) -> int:
        """The tokens of the prompt of a chat request (in another API's shape: convert)."""
        r = await request_body(request, CHAT_PARAMETERS, "messages", convert=convert)
        try:
            return await asyncio.to_thread(chat_prompt_length, r)
        except Exception as e:  # noqa: BLE001 - shaped as OpenAI's error
            raise from_engine_error(e) from None

    @app.post("/v1/messages/count_tokens")
    async def anthropic_count_tokens(request: Request) -> dict:
        """Anthropic's: the tokens of a Messages request's prompt."""
        return {"input_tokens": await input_tokens(request, anthropic_api.chat_request)}

    @app.post("/v1/responses/input_tokens")
    @app.post("/responses/input_tokens")
    async def responses_input_tokens(request: Request) -> dict:
        """OpenAI's: the tokens of a Responses request's prompt."""
        return {"object": "response.input_tokens", "input_tokens": await input_tokens(request, responses_api.chat_request)}

    @app.post("/v1/chat/completions/input_tokens")
    @app.post("/chat/completions/input_tokens")
    async def chat_input_tokens(request: Request) -> dict:
        """llama-server's: the tokens of a chat completion request's prompt."""
        return {"object": "response.input_tokens", "input_tokens": await input_tokens(request, lambda body: body)}

    add_token_routes(app, engine, check_model)
    controls.add_routes(app, check_model)
    add_slot_routes(app, engine, queue, slot_directory)
    add_embedding_routes(app, engine, queue, prompt_bound, model_id, check_model, embeddings)
    web_ui.add_routes(app, engine, model_id, queue, request_defaults)  # last: llama.cpp's UI files under every other path
    for route in app.routes:  # HEAD (probes' `curl -I`) answered as GET without the body, as llama-server's cpp-httplib
        if isinstance(route, APIRoute) and "GET" in route.methods:
            route.methods.add("HEAD")
    # the last added is the outermost: counted, then the site checked, then the key, then the body read
    app.add_middleware(JSONBody, max_bytes=limits.max_body_bytes, timeout_seconds=limits.timeout_seconds,
                       stopping=lambda: queue.stopping)
    app.add_middleware(BearerAuth, api_keys=api_keys, is_open=web_ui.is_public)
    app.add_middleware(SameSite, allowed_hosts=allowed_hosts)
    app.add_middleware(HeadChecks, max_bytes=MAX_HEAD_BYTES)
    app.add_middleware(RequestCounting, counts=requests)  # outermost: refusals are counted too
    return app

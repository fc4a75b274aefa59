"""The Engine's generations as text, and as OpenAI's results in llama-cpp-python's shape.

- TextRun: one generation's text pieces as they become safe to show (a stop string held back
  until it cannot be one, and cut), the tokens they came from, the finish reason.
- create_completion / create_chat_completion: text completions and chat completions, whole or
  streamed as chunks, with each generated token's log-probability and the most likely
  alternatives when asked (logprobs; recorded by generation.Generation): a completion's as
  llama-cpp-python returns them (OpenAI's completions shape: tokens, text_offset, token_logprobs,
  top_logprobs), a chat completion's in OpenAI's chat shape (content: token, logprob, bytes,
  top_logprobs). A streamed chunk carries those of the tokens its text came from. A chat's tools
  go to the template; the calls (and thoughts) the model writes are parsed (pyedgemoe.chat_formats),
  or a forced tool call is the answer (pyedgemoe.tool_calls).
"""
from __future__ import annotations

import datetime
import time
import uuid
from contextlib import closing
from typing import Container, Iterator

from pyedgemoe.chat_template import ChatTemplateRefusal
from pyedgemoe.errors import InvalidOptionError
from pyedgemoe.fill_in_middle import completion_prompt
from pyedgemoe.generation import CHAT_TEMPERATURE, PromptProgress, SamplingParams, TokenLogprob
from pyedgemoe.text_stream import TextStream, utf8
from pyedgemoe.tool_calls import EMPTY_DELTA, call_delta, call_grammar, call_message, check_tool_choice, check_tools, \
    forced_tool
from pyedgemoe.chat_formats import ChatTurn, continuation, parses, wants_thinking_tags


CHARACTER_TAIL = 16  # tokens a cut character may take past max_tokens (a UTF-8 one has 4 bytes at most)


def stop_list(stop: str | list[str] | None) -> list[str]:
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
        raise InvalidOptionError(f"stop must be a string or a list of strings, got {stop!r}"[:200])
    try:
        for s in stops:  # text that can be UTF-8, as the generated text is
            utf8(s)
    except InvalidOptionError as e:
        raise InvalidOptionError(f"stop: {e}") from None
    return list(stops)


def usage(n_prompt: int, n_completion: int, n_cached: int) -> dict:
    """The OpenAI "usage" object; n_cached: the prompt's tokens the sequence held already, reused."""
    return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion,
            "prompt_tokens_details": {"cached_tokens": n_cached}}


def check_count(name: str, n: int | None) -> None:
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
        raise InvalidOptionError(f"{name} must be an integer >= 0, got {n!r}")


class TextRun:
    """One generation's text (Engine._generation; bad arguments raise here): pieces() yields it, a
    piece a token (TextStream's: "" for a token ending inside a character); n_tokens counts the
    tokens taken so far, n_shown those whose pieces were given, generation.logprobs their TokenLogprobs
    (n_probs). max_tokens is where a generation ends, as in llama.cpp's tools; finish_character: a
    character it cuts is finished first, as llama-cpp-python's completions do (their count of the
    bytes it lacks, _bytes_missing): at most CHARACTER_TAIL tokens more. timings_per_token:
    a streamed chunk carries the timings so far (chunk_timings). progress: pieces() yields a
    PromptProgress as the prompt's evaluation begins and after each llama_decode of it. end_shown:
    the text of the end-of-generation token that ended it too (llama-completion's with -sp)."""

    def __init__(self, engine, prompt_tokens: list[int], max_tokens: int | None, sampling: SamplingParams,
                 stop: list[str], ignore_eos: bool = False, n_probs: int | None = None,
                 special_tokens: Container[int] = frozenset(), timings_per_token: bool = False,
                 progress: bool = False, finish_character: bool = False, end_shown: bool = False):
        self._engine = engine
        self._end_shown = end_shown
        self._timings_per_token = timings_per_token
        self._special = special_tokens  # shown as their text (a tool-call format's tags)
        self.prompt_tokens = prompt_tokens
        check_count("max_tokens", max_tokens)  # before the tail is added: a negative one is refused as given
        self._max_tokens, self._bytes, self._missing = max_tokens, b"", 0
        self._finish_character = finish_character
        allowed = max_tokens + CHARACTER_TAIL if max_tokens and finish_character else max_tokens
        self.generation, self._tokens = engine._generation(prompt_tokens, allowed, sampling, ignore_eos, n_probs=n_probs,
                                                           progress=progress)
        self._text = TextStream(stop)
        self.n_tokens = 0
        self.n_shown = 0  # the tokens whose text pieces() gave (the others: held back, or a stop string's)
        self.finish_reason = "length"

    def close(self) -> None:
        """Ends the generation where it stands: its sequence is free for the next at once, also
        where an exception (Ctrl-C) left this run's generators suspended in a traceback."""
        self._tokens.close()

    def pieces(self) -> Iterator[str | PromptProgress]:
        try:
            yield from self._pieces()
        finally:
            self.close()

    def _pieces(self) -> Iterator[str | PromptProgress]:
        for token in self._tokens:
            if isinstance(token, PromptProgress):
                yield token
                continue
            self.n_tokens += 1
            raw = self._engine.token_piece(token, special=token in self._special)
            if self._finish_character:
                self._bytes = self._bytes[-3:] + raw  # the text's last bytes: what _bytes_missing reads
                self._missing = _bytes_missing(self._bytes, self._missing)
            yield from self._shown(self._text.push(raw))
            if self._text.stopped:
                self._tokens.close()
                self.finish_reason = self.generation.timings.finish_reason = "stop"  # the Engine's last_timings too
                return
            if self._missing > 0:
                self._missing -= 1
            elif self._max_tokens is not None and self.n_tokens >= self._max_tokens:
                self._tokens.close()
                break
        else:
            self.finish_reason = self.generation.timings.finish_reason
            if self._end_shown and self.generation.end is not None:
                yield from self._shown(self._text.push(self._engine.token_piece(self.generation.end[0], special=True)))
        yield from self._shown(self._text.flush())

    def _shown(self, pieces: list[str]) -> Iterator[str]:
        for piece in pieces:
            self.n_shown += 1
            yield piece

    def timings(self) -> dict:
        """llama-server's timings of the generation so far."""
        return {"timings": self.generation.timings.llama_server_timings(self.n_tokens)}

    def chunk_timings(self, progress: PromptProgress | None = None) -> dict:
        """What a streamed chunk carries (progress: a chunk of the prompt's progress): with
        timings_per_token, llama-server's timings so far (as llama-server's chunks do); else nothing."""
        if not self._timings_per_token:
            return {}
        return {"timings": progress.stats().llama_server_timings(0)} if progress else self.timings()

    def totals(self) -> dict:
        """What a result's end carries: OpenAI's usage, and llama-server's timings."""
        return {"usage": usage(len(self.prompt_tokens), self.n_tokens, self.generation.timings.n_cached_prompt_tokens),
                **self.timings()}


def _bytes_missing(text: bytes, missing: int) -> int:
    """llama-cpp-python's count of the bytes a character at the end of a completion's text still
    lacks, as its _create_completion checks it after each token (its last three bytes, read
    from the first; a completion of fewer bytes read as if they were the last three)."""
    for k, byte in enumerate(text[-3:]):
        for num, pattern in ((2, 192), (3, 224), (4, 240)):
            if num > 3 - k and pattern & byte == pattern:
                missing = num - (3 - k)
    return missing


def _text(piece: bytes) -> str:
    return piece.decode("utf-8", errors="ignore")


def completion_logprobs(engine, taken: list[TokenLogprob], start: int, end: int, prompt_length: int) -> dict:
    """llama-cpp-python's completion logprobs of taken[start:end]: each token's text, its offset in
    the text (prompt_length, llama-cpp-python's len(prompt), plus the text of the tokens before it),
    its log-probability and {text: log-probability} of the most likely and of itself."""
    out: dict = {"tokens": [], "text_offset": [], "token_logprobs": [], "top_logprobs": []}
    before = b"".join(engine.token_piece(t.token) for t in taken[:start])
    bos = engine.token_bos()
    for t in taken[start:end]:
        piece = engine.token_piece(t.token)
        if t.token != bos:
            out["tokens"].append(_text(piece))
            out["text_offset"].append(prompt_length + len(_text(before)))
            out["token_logprobs"].append(t.logprob)
            top = {_text(engine.token_piece(i)): lp for i, lp in t.top}
            out["top_logprobs"].append({**top, _text(piece): t.logprob})
        before += piece
    return out


def chat_logprobs(engine, taken: list[TokenLogprob]) -> dict:
    """OpenAI's chat logprobs of the tokens taken: each one's text, log-probability and UTF-8 bytes,
    and the most likely tokens' (top_logprobs)."""
    def entry(token: int, logprob: float) -> dict:
        piece = engine.token_piece(token)
        return {"token": _text(piece), "logprob": logprob, "bytes": list(piece)}
    return {"content": [{**entry(t.token, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top]}
                        for t in taken],
            "refusal": None}


def create_completion(engine, prompt: str | list[int], max_tokens: int | None, stop: str | list[str] | None,
                      stream: bool, logprobs: int | None, sampling: dict, prompt_length: int | None = None,
                      suffix: str | None = None, spm_infill: bool = False, timings_per_token: bool = False,
                      return_progress: bool = False, finish_character: bool = False):
    """Engine.create_completion's result (or chunks). prompt_length: the text offset of the first
    generated token (default llama-cpp-python's, len(prompt)). suffix: the text after the gap the
    completion fills, prompt the text (or tokens) before it (fill_in_middle.fim_prompt).
    finish_character: TextRun's."""
    check_count("logprobs", logprobs)
    tokens = engine.prompt_tokens(prompt) if suffix is None else completion_prompt(engine, prompt, suffix, spm_infill)
    run = TextRun(engine, tokens, max_tokens, SamplingParams.of(sampling), stop_list(stop), n_probs=logprobs,
                  timings_per_token=timings_per_token, progress=stream and return_progress,
                  finish_character=finish_character)
    head = {"id": f"cmpl-{uuid.uuid4()}", "object": "text_completion", "created": int(time.time()),
            "model": engine.model_path}

    def shaped(start: int, end: int) -> dict | None:
        """The logprobs of the tokens taken from start to end."""
        if logprobs is None or (stream and start == end):
            return None
        return completion_logprobs(engine, run.generation.logprobs, start, end,
                                   len(prompt) if prompt_length is None else prompt_length)

    def choice(text: str, start: int, end: int, finish_reason: str | None) -> dict:
        return {"text": text, "index": 0, "logprobs": shaped(start, end), "finish_reason": finish_reason}

    if not stream:
        text = "".join(run.pieces())
        return {**head, "choices": [choice(text, 0, run.n_tokens, run.finish_reason)], **run.totals()}

    def chunks():  # a chunk a token, as llama-cpp-python's; the last, the tokens of a stop string
        done = 0
        with closing(run):
            for piece in run.pieces():
                if isinstance(piece, PromptProgress):
                    yield {**head, "choices": [choice("", done, done, None)], "prompt_progress": piece.llama_server(),
                           **run.chunk_timings(piece)}
                    continue
                yield {**head, "choices": [choice(piece, done, run.n_shown, None)], **run.chunk_timings()}
                done = run.n_shown
        yield {**head, "choices": [choice("", done, run.n_tokens, run.finish_reason)], **run.totals()}
    return chunks()


def check_messages(messages: list[dict]) -> None:
    if not isinstance(messages, (list, tuple)):
        raise InvalidOptionError(f"messages must be a list of messages, got {messages!r}"[:200])
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or ("content" not in m and not m.get("tool_calls")):
            raise InvalidOptionError(f"each message needs 'role' and 'content' (or, the assistant's, 'tool_calls'), "
                                     f"got {m!r}")


def chat_text(engine, messages: list[dict], tools: list[dict] | None = None, tool_choice=None,
              template_kwargs: dict | None = None, parallel_tool_calls: bool | None = None,
              parse_tool_calls: bool = True, reasoning_format: str | None = None,
              thinking_tags: bool = False, continue_final_message=None,
              add_generation_prompt: bool | None = None, jinja2_formatter: bool = False) -> tuple[str, ChatTurn | None]:
    """A chat's prompt text, and where the answer is parsed in the model's format (tool calls,
    thoughts; thinking_tags: a reasoning budget's or control's; the last message continued, or no
    generation prompt: llama-server's continue_final_message, add_generation_prompt) the ChatTurn it
    is the text of (llama.cpp's rendering); else the model's template as Engine.format_chat renders it,
    given what llama.cpp's tools give a template (llama_cpp_variables) where template_kwargs do not say
    (what the template refuses, as llama.cpp renders it), or with jinja2_formatter, as llama-cpp-python's
    Jinja2ChatFormatter, nothing more."""
    check_messages(messages)
    tools = check_tools(tools)
    check_tool_choice(tool_choice)
    if template_kwargs is not None and not isinstance(template_kwargs, dict):
        raise InvalidOptionError(f"chat_template_kwargs must be a dict of the template's variables, got "
                                 f"{template_kwargs!r}"[:200])
    continued = continuation(messages, continue_final_message, add_generation_prompt)
    if parses(tools, tool_choice, parse_tool_calls, reasoning_format,
              thinking_tags or bool(continued) or add_generation_prompt is False):
        turn = ChatTurn(engine, messages, tools, tool_choice, parallel_tool_calls, template_kwargs, reasoning_format,
                        continued, add_generation_prompt is not False and not continued)
        return turn.prompt, turn
    if jinja2_formatter:
        return engine.format_chat(messages, tools, tool_choice, template_kwargs), None
    try:
        return engine.format_chat(messages, tools, tool_choice, {**llama_cpp_variables(), **(template_kwargs or {})}), None
    except ChatTemplateRefusal as refusal:
        # llama.cpp's rendering takes what a template refuses where it knows how (Gemma 2's system
        # message merged into the first user's): llama-server's prompt; else the template's words
        try:
            turn = ChatTurn(engine, messages, tools, tool_choice, parallel_tool_calls, template_kwargs, reasoning_format)
        except InvalidOptionError:
            raise refusal from None
        return turn.prompt, turn


def llama_cpp_variables() -> dict:
    """What llama.cpp's tools (llama-server, llama-cli) give a chat template besides the messages and
    tools: its thoughts open (common_chat_templates_inputs' default, where --reasoning is not off) and
    today's date, local time (common_chat_extra_context)."""
    now = datetime.datetime.now()
    return {"enable_thinking": True, "date_string": now.strftime("%d %b %Y"), "datetime": now.strftime("%b %d %Y")}


def chat_prompt_tokens(engine, messages: list[dict], tools: list[dict] | None = None, tool_choice=None) -> list[int]:
    """The tokens of messages (and the tools, for the template) formatted with the model's template,
    as llama-cpp-python does (its Jinja2ChatFormatter, no tool calls parsed)."""
    text = chat_text(engine, messages, tools, tool_choice, parse_tool_calls=False, jinja2_formatter=True)[0]
    return chat_text_tokens(engine, text, jinja2_formatter=True)


def chat_text_tokens(engine, text: str, jinja2_formatter: bool = False) -> list[int]:
    """The tokens of a chat's prompt text: special tokens as such, a BOS ahead unless it has one (with
    jinja2_formatter none but the text's, as llama-cpp-python tokenizes what its Jinja2ChatFormatter renders)."""
    bos_id = engine.token_bos()
    bos_text = engine.token_piece(bos_id, special=True).decode("utf-8", "replace") if bos_id is not None else None
    starts_with_bos = bos_text is not None and text.startswith(bos_text)
    return engine.tokenize(text, add_bos=not jinja2_formatter and not starts_with_bos, special=True)


def create_chat_completion(engine, messages: list[dict], max_tokens: int | None, stop: str | list[str] | None,
                           stream: bool, logprobs: bool | None, top_logprobs: int | None, sampling: dict,
                           tools: list[dict] | None = None, tool_choice=None, parallel_tool_calls: bool | None = None,
                           parse_tool_calls: bool = True, template_kwargs: dict | None = None,
                           reasoning_format: str | None = None, continue_final_message=None,
                           add_generation_prompt: bool | None = None, timings_per_token: bool = False,
                           return_progress: bool = False, jinja2_formatter: bool = False,
                           finish_character: bool = False):
    """Engine.create_chat_completion's result (or chunks): the tool calls (and thoughts) the model
    writes parsed (pyedgemoe.chat_formats), or a tool choice that forces a call answered with it
    (pyedgemoe.tool_calls). jinja2_formatter: chat_text's and chat_text_tokens's; finish_character: TextRun's."""
    check_count("top_logprobs", top_logprobs)
    if top_logprobs is not None and not logprobs:
        raise InvalidOptionError("top_logprobs needs logprobs=True")
    text, turn = chat_text(engine, messages, tools, tool_choice, template_kwargs, parallel_tool_calls, parse_tool_calls,
                           reasoning_format, wants_thinking_tags(sampling), continue_final_message, add_generation_prompt,
                           jinja2_formatter)
    function = forced_tool(tools, tool_choice) if turn is None else None
    # the grammar of a call (a forced one's arguments, a format's calls), which no other may join
    calls_grammar = {"grammar": call_grammar(tools, function)} if function is not None \
        else turn.sampling() if turn is not None else {}
    if calls_grammar and any(sampling.get(k) is not None for k in ("grammar", "json_schema", "response_format")):
        raise InvalidOptionError("tool calls have a grammar of their own: give no grammar, json_schema or "
                                 "response_format with tools")
    if turn is not None and stream and logprobs:
        raise InvalidOptionError("logprobs are not given in a stream parsed for tool calls or thoughts (tools, "
                                 "reasoning_format), as llama-server")
    thinking = turn.thinking() if turn is not None else {}
    if sampling.get("json_schema") in ({}, "{}"):  # any object, as llama-server's chat takes an empty schema
        sampling = {**sampling, "json_schema": {"type": "object"}}
    sampling = SamplingParams.of({**sampling, **calls_grammar, **thinking}, temperature=CHAT_TEMPERATURE)
    run = TextRun(engine, chat_text_tokens(engine, text, jinja2_formatter), max_tokens, sampling, stop_list(stop) + (turn.stops if turn else []),
                  n_probs=(top_logprobs or 0) if logprobs else None,
                  special_tokens=turn.special_tokens if turn else frozenset(), timings_per_token=timings_per_token,
                  progress=stream and return_progress, finish_character=finish_character)
    if turn is not None:
        return _parsed_chat(engine, run, turn, stream, logprobs)
    uid = uuid.uuid4()
    head = {"id": f"chatcmpl-{uid}", "created": int(time.time()), "model": engine.model_path}
    call_id = f"call__0_{function['name']}_cmpl-{uid}" if function is not None else None

    def finish_reason() -> str:
        return "tool_calls" if function is not None and run.finish_reason != "length" else run.finish_reason

    def shaped(start: int, end: int) -> dict | None:
        """The logprobs of the tokens taken from start to end."""
        if not logprobs or (stream and start == end):
            return None
        return chat_logprobs(engine, run.generation.logprobs[start:end])

    if not stream:
        text = "".join(run.pieces())
        message = call_message(function["name"], text, call_id) if function is not None \
            else {"role": "assistant", "content": text}
        return {**head, "object": "chat.completion",
                "choices": [{"index": 0, "message": message, "logprobs": shaped(0, run.n_tokens),
                             "finish_reason": finish_reason()}],
                **run.totals()}

    def chunks():
        chunk = {**head, "object": "chat.completion.chunk"}
        first = {"role": "assistant"} if function is None else {**EMPTY_DELTA, "role": "assistant"}
        yield {**chunk, "choices": [{"index": 0, "delta": first, "logprobs": None, "finish_reason": None}]}
        done, named = 0, True
        with closing(run):
            for piece in run.pieces():
                if isinstance(piece, PromptProgress):
                    yield _progress_chunk(chunk, piece, run)
                    continue
                delta = {"content": piece} if function is None else call_delta(function["name"], piece, call_id, named)
                named = not parse_tool_calls  # llama-cpp-python's stream names the call in every piece
                yield {**chunk, "choices": [{"index": 0, "delta": delta, "logprobs": shaped(done, run.n_shown),
                                             "finish_reason": None}], **run.chunk_timings()}
                done = run.n_shown
        last = {} if function is None else EMPTY_DELTA
        yield {**chunk, "choices": [{"index": 0, "delta": last, "logprobs": shaped(done, run.n_tokens),
                                     "finish_reason": finish_reason()}], **run.totals()}
    return chunks()


def _progress_chunk(chunk: dict, progress: PromptProgress, run: TextRun) -> dict:
    """A chat's chunk of how far its prompt's evaluation is (llama-server's return_progress), with
    the timings so far where every chunk has them."""
    return {**chunk, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": None}],
            "prompt_progress": progress.llama_server(), **run.chunk_timings(progress)}


def _parsed_chat(engine, run: TextRun, turn: ChatTurn, stream: bool, logprobs: bool | None):
    """A chat whose text is parsed for the model's tool calls: its message, or its chunks (a delta a
    chunk), as llama-server gives them."""
    head = {"id": f"chatcmpl-{uuid.uuid4()}", "created": int(time.time()), "model": engine.model_path}

    def finish_reason(calls: bool) -> str:
        return "tool_calls" if calls and run.finish_reason == "stop" else run.finish_reason

    if not stream:
        message = turn.message("".join(run.pieces()))
        return {**head, "object": "chat.completion",
                "choices": [{"index": 0, "message": message, "finish_reason": finish_reason("tool_calls" in message),
                             "logprobs": chat_logprobs(engine, run.generation.logprobs) if logprobs else None}],
                **run.totals()}

    def chunks():
        chunk = {**head, "object": "chat.completion.chunk"}

        def delta_chunk(delta: dict, finish: str | None = None) -> dict:
            return {**chunk, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        yield delta_chunk({"role": "assistant"})
        text, calls = "", False
        with closing(run):
            for piece in run.pieces():
                if isinstance(piece, PromptProgress):
                    yield _progress_chunk(chunk, piece, run)
                    continue
                text += piece
                for delta in turn.deltas(text, done=False):
                    calls = calls or "tool_calls" in delta
                    yield {**delta_chunk(delta), **run.chunk_timings()}
        for delta in turn.deltas(text, done=True):
            calls = calls or "tool_calls" in delta
            yield {**delta_chunk(delta), **run.chunk_timings()}
        yield {**delta_chunk({}, finish_reason(calls)), **run.totals()}
    return chunks()

"""The tool calls and thoughts a model writes in its own format, found as llama-server finds them
(llama.cpp's chat formats: the native ChatFormat, bindings/chat.cpp).

With tools and a tool choice of "auto" (or none) or "required", or a reasoning format asked for,
the Engine's chat renders the conversation with llama.cpp's template engine, which knows how each
model family writes a call (Qwen's and Hermes' <tool_call> tags, Llama 3.x's JSON, Mistral's
[TOOL_CALLS], GPT-OSS's channels, ...) and its thoughts (<think>...); a grammar keeps a call well
formed, from the moment the model starts one ("auto": llama.cpp's lazy grammar, from the format's
triggers) or from the first token ("required"). The text is then parsed into content, tool calls
(each with an id; finish reason "tool_calls") and, with reasoning_format "auto" or "deepseek", the
thoughts (reasoning_content); streamed as OpenAI's deltas: a call's id and name, then pieces of its
arguments.

llama-cpp-python's Llama answers "auto" with the model's text and forces "required" with one tool
in its own shape (pyedgemoe.tool_calls): the drop-in keeps that (parse_tool_calls=False).
"""
from __future__ import annotations

import json

from pyedgemoe.errors import InvalidOptionError

# llama-server's reasoning formats: "none" leaves the thoughts in the content; "auto" and "deepseek"
# give them as reasoning_content ("deepseek-legacy" too, streamed or not)
REASONING_FORMATS = ("none", "auto", "deepseek", "deepseek-legacy")


def parses(tools: list[dict] | None, tool_choice, parse_tool_calls: bool, reasoning_format: str | None,
           needs_format: bool = False) -> bool:
    """Whether a chat's answer is parsed in the model's format (else pyedgemoe.tool_calls' ways);
    needs_format: the chat needs the format besides (the sampling its thinking tags, wants_thinking_tags;
    its prompt llama.cpp's rendering: a message continued, no generation prompt)."""
    if not parse_tool_calls or isinstance(tool_choice, dict):  # a function named: tool_calls' forced call
        return False
    return (bool(tools) and tool_choice != "none") or reasoning_format not in (None, "none") or needs_format


def continuation(messages: list[dict], continue_final_message, add_generation_prompt: bool | None) -> str:
    """llama-server's continue_final_message as the native ChatFormat takes it ("": none; True:
    "auto", the last message's content, or its thoughts where it has only those; "content";
    "reasoning_content"), checked as llama-server checks it: the last message the assistant's, one
    without tool calls, after one that is not; add_generation_prompt not asked for beside it."""
    if continue_final_message is None or continue_final_message is False:
        return ""
    if continue_final_message is not True and continue_final_message not in ("content", "reasoning_content"):
        raise InvalidOptionError(f"continue_final_message must be true, \"content\" or \"reasoning_content\", got "
                                 f"{continue_final_message!r}"[:200])
    if add_generation_prompt:
        raise InvalidOptionError("give add_generation_prompt or continue_final_message, not both")
    last = messages[-1] if messages else {}
    if not isinstance(last, dict) or last.get("role") != "assistant":
        raise InvalidOptionError("continue_final_message continues the last message, which must be the assistant's")
    if last.get("tool_calls"):
        raise InvalidOptionError("continue_final_message cannot continue an assistant's message with tool calls")
    if len(messages) > 1 and isinstance(messages[-2], dict) and messages[-2].get("role") == "assistant":
        raise InvalidOptionError("continue_final_message: the conversation ends with two assistant's messages")
    return "auto" if continue_final_message is True else continue_final_message


def wants_thinking_tags(sampling: dict) -> bool:
    """Whether a chat's sampling settings need the template's thinking tags: a reasoning budget (>= 0;
    a wrong one SamplingParams refuses) or llama-server's reasoning control."""
    budget = sampling.get("reasoning_budget_tokens")
    return (isinstance(budget, int) and budget >= 0) or bool(sampling.get("reasoning_control"))


class ChatTurn:
    """One chat's prompt, constraints and parser in the model's format."""

    def __init__(self, engine, messages: list[dict], tools: list[dict] | None, tool_choice: str | None,
                 parallel_tool_calls: bool | None, template_kwargs: dict | None = None,
                 reasoning_format: str | None = None, continued: str = "", add_generation_prompt: bool = True):
        if reasoning_format not in (None, *REASONING_FORMATS):
            raise InvalidOptionError(f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}, got "
                                     f"{reasoning_format!r}"[:200])
        try:
            chat_format = engine.chat_format
            parallel = chat_format.supports_parallel_tool_calls if parallel_tool_calls is None else parallel_tool_calls
            self._turn = chat_format.apply(json.dumps(messages), json.dumps(tools or []), tool_choice or "auto",
                                           parallel, json.dumps(template_kwargs or {}), reasoning_format or "none",
                                           continued, add_generation_prompt)
        except ValueError as e:
            raise InvalidOptionError(f"llama.cpp's chat format of the template: {e}") from None
        if tools and tool_choice == "required" and not self._turn.grammar:  # else the answer would be free text
            raise InvalidOptionError('tool_choice "required": llama.cpp finds no format of tool calls in this model\'s '
                                     'chat template; name the function to call ({"type": "function", "function": '
                                     '{"name": ...}}), which is answered in JSON')
        self.prompt = self._turn.prompt
        self._continued = json.loads(self._turn.continued)  # a message continued: not the answer's
        self.stops = list(self._turn.additional_stops)
        # tokens shown as their text (a format's tags, which are often special tokens)
        ids = (engine.tokenize(text, add_bos=False, special=True) for text in self._turn.preserved_tokens)
        self.special_tokens = frozenset(one[0] for one in ids if len(one) == 1)

    def sampling(self) -> dict:
        """The SamplingParams keywords of the call's grammar (none where the format has none)."""
        if not self._turn.grammar:
            return {}
        t = self._turn
        return {"grammar": t.grammar, "grammar_triggers": (tuple(t.trigger_patterns), tuple(t.trigger_tokens))
                if t.grammar_lazy else None, "generation_prompt": t.generation_prompt}

    def thinking(self) -> dict:
        """The SamplingParams keywords of a reasoning budget: the template's thinking tags, as llama.cpp's
        analysis of it finds them (none: {}, and a budget does nothing, as in llama-server)."""
        t = self._turn
        if not t.thinking_start_tag or not t.thinking_end_tags:
            return {}
        return {"thinking_tags": (t.thinking_start_tag, tuple(t.thinking_end_tags)),
                "generation_prompt": t.generation_prompt}

    def message(self, text: str) -> dict:
        """The assistant's message the whole text parses to (a text the format does not take, as a
        call cut by max_tokens: what it parses to so far; where nothing does, the text as content)."""
        parsed = {"content": text, "reasoning_content": "", "tool_calls": []}
        for is_partial in (False, True):
            try:
                parsed = json.loads(self._turn.parse(text, is_partial))
                break
            except ValueError:
                continue
        calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                 for c in parsed["tool_calls"]]
        content, reasoning = (parsed[k].removeprefix(self._continued[k]) for k in ("content", "reasoning_content"))
        return assistant_message(content, reasoning, calls)

    def deltas(self, text: str, done: bool) -> list[dict]:
        """OpenAI's stream deltas of what text adds since the last call (done: the whole text)."""
        for is_partial in ((False, True) if done else (True,)):
            try:
                return json.loads(self._turn.deltas(text, is_partial))
            except ValueError:
                continue
        return []  # the text does not parse (yet): its deltas come with more of it


def has_thinking_tags(engine, template_kwargs: dict | None = None) -> bool:
    """Whether llama.cpp's analysis of the model's chat template finds the tags of a thought (which a
    reasoning budget needs)."""
    return bool(ChatTurn(engine, [{"role": "user", "content": "?"}], None, None, None, template_kwargs).thinking())


def assistant_message(content: str, reasoning_content: str, calls: list[dict]) -> dict:
    """The assistant's message: content (null when empty beside calls, as OpenAI's), the calls, and
    the model's reasoning where the format separates it."""
    message = {"role": "assistant", "content": content or (None if calls else "")}
    if reasoning_content:
        message["reasoning_content"] = reasoning_content
    return {**message, "tool_calls": calls} if calls else message


def joined_message(deltas: list[dict]) -> dict:
    """The message stream deltas make (a call's id and name come once, its arguments in pieces)."""
    calls: dict[int, dict] = {}
    for d in deltas:
        for call in d.get("tool_calls") or ():
            joined = calls.setdefault(call["index"], {"id": "", "type": "function",
                                                      "function": {"name": "", "arguments": ""}})
            joined["id"] = call.get("id") or joined["id"]
            function = call.get("function", {})
            joined["function"]["name"] = function.get("name") or joined["function"]["name"]
            joined["function"]["arguments"] += function.get("arguments", "")
    return assistant_message("".join(d.get("content") or "" for d in deltas),
                             "".join(d.get("reasoning_content") or "" for d in deltas),
                             [calls[i] for i in sorted(calls)])

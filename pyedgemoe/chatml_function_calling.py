"""llama-cpp-python's chat_format="chatml-function-calling": tool calls by any model, from ChatML
prompts that list the functions and grammars that keep the answer to them.

Its handler (llama_cpp.llama_chat_format.chatml_function_calling, MIT), on Llama.create_completion,
so that the same calls give the same answers as there:
- no tools, or tool_choice "none" (or none given): the chat as ChatML, answered as text;
- tool_choice naming a function: a call of it, its arguments held to the function's parameters
  (llama.cpp's JSON-schema converter; any JSON where it cannot convert them), streamed or whole;
- "auto": one greedy step picks "message:" or "functions.<name>:" (a grammar of those alone); a
  message is then generated after "message:", a call's arguments as above. Not streamed where it
  calls a function (refused there, as there).
Its quirks are kept, as code written for it expects them: legacy `functions` / `function_call` are
taken as tools; after "message:" its grammar allows only "<|im_end|>" or a function's name; the
"auto" steps generate until the context is full (max_tokens is not theirs) and ignore stream in the
first step. Unlike there, a seed given is the first step's (there: ignored) and logit_bias is taken.
"""
from __future__ import annotations

from typing import Iterator

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pyedgemoe.completion_chat import arguments_grammar, as_call, as_chat, response_grammar
from pyedgemoe.completions import stop_list
from pyedgemoe.errors import InvalidOptionError
from pyedgemoe.tool_calls import from_functions

NAME = "chatml-function-calling"
END = "<|im_end|>"

# llama-cpp-python's template, as it has it
TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message.role }}\n"
    "{% if message.role == 'system' %}"
    "{{ message.content }}"
    "{% if tool_calls %}"
    "\n\nYou have access to the following functions:\n"
    "{% for tool in tools %}"
    "\nfunctions.{{ tool.function.name }}:\n"
    "{{ tool.function.parameters | tojson }}"
    "\n{% endfor %}"
    "\n\nYou can respond to users messages with either a single message or one or more function calls."
    "\n\nTo respond with a message begin the message with 'message:', use the following format:"
    "\n\nmessage:"
    "\n<message>"
    "\n\nTo respond with one or more function calls begin the message with 'functions.<function_name>:', "
    "use the following format:"
    "\n\nfunctions.<function_name>:"
    '\n{ "arg1": "value1", "arg2": "value2" }'
    "\nfunctions.<function_name>:"
    '\n{ "arg1": "value1", "arg2": "value2" }'
    "{% endif %}"
    "<|im_end|>\n"
    "{% endif %}"
    "{% if message.role == 'user' %}"
    "{{ message.content }}"
    "<|im_end|>\n"
    "{% endif %}"
    "{% if message.role == 'assistant' %}"
    "{% if message.content and message.content | length > 0 %}"
    "{% if tool_calls %}"
    "message:\n"
    "{% endif %}"
    "{{ message.content }}"
    "<|im_end|>\n"
    "{% endif %}"
    "{% if 'tool_calls' in message %}"
    "{% for tool_call in message.tool_calls %}"
    "functions.{{ tool_call.function.name }}:\n"
    "{{ tool_call.function.arguments }}"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% endif %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# as there: escaped as HTML (a template from a string), every variable required
_TEMPLATE = ImmutableSandboxedEnvironment(autoescape=jinja2.select_autoescape(["html", "xml"]),
                                          undefined=jinja2.StrictUndefined).from_string(TEMPLATE)


def create_chat_completion(llama, messages: list[dict], *, functions, function_call, tools, tool_choice,
                           stream: bool, stop, response_format, max_tokens, logprobs, top_logprobs, grammar, seed,
                           **sampling) -> dict | Iterator[dict]:
    """The handler's answer; `sampling` goes to every create_completion (temperature, top_p, ...,
    model, logits_processor, logit_bias)."""
    tools, tool_choice = from_functions(functions, function_call, tools, tool_choice)
    if tool_choice == "required":
        raise InvalidOptionError(f'tool_choice "required": chat_format {NAME!r} takes "none", "auto" or a function '
                                 'named')
    stop = stop_list(stop) + [END]
    seeds = iter([seed])

    def complete(prompt: str, **overrides):
        return llama.create_completion(prompt=prompt, **{**sampling, "seed": next(seeds, None), **overrides})

    if tool_choice in (None, "none") or not tools:
        return as_chat(complete(_prompt(messages, []), stream=stream, stop=stop, max_tokens=max_tokens,
                                grammar=response_grammar(response_format, grammar),
                                logprobs=top_logprobs if logprobs else None), stream)

    prompt = _prompt(messages, tools)
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        tool = _tool(tools, name)
        if tool is None:
            raise InvalidOptionError(f"Tool with name '{name}' not found in tools")
        called = complete(prompt + f"functions.{name}:\n", stream=stream, stop=stop, max_tokens=max_tokens,
                          grammar=arguments_grammar(tool))
        return as_call(name, called, stream)

    names = " | ".join(f'"functions.{tool["function"]["name"]}:"' for tool in tools)
    follow_up = f'root   ::= functions | "{END}"\nfunctions ::= {names}\n'
    first = complete(prompt, temperature=0, stream=False, stop=[":"], max_tokens=None,
                     grammar=f'root   ::= functions | "message:"\nfunctions ::= {names}\n')
    text = first["choices"][0]["text"]
    if "message" in text:
        return as_chat(complete(prompt + "message:\n", stream=stream, stop=[END], max_tokens=None, grammar=follow_up,
                              logprobs=top_logprobs if logprobs else None), stream)
    if stream:
        raise InvalidOptionError(f"chat_format {NAME!r}: a call chosen by tool_choice \"auto\" is not streamed "
                                 "(as in llama-cpp-python): give stream=False or name the function")
    calls = []
    name = text[len("functions."):]
    tool = _tool(tools, name)
    while tool is not None:
        prompt += f"functions.{name}:\n"
        called = complete(prompt, stream=False, stop=stop, max_tokens=None, grammar=arguments_grammar(tool))
        calls.append((name, called))
        prompt += called["choices"][0]["text"] + "\n"
        # the next step's text ends in ":" (stop is not ":" there), which no tool's name does: one call
        name = complete(prompt, stream=False, stop=stop, max_tokens=None,
                        grammar=follow_up)["choices"][0]["text"][len("functions."):]
        tool = _tool(tools, name)
    message = {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call__{i}_{name}_{called['id']}", "type": "function",
         "function": {"name": name, "arguments": called["choices"][0]["text"]}}
        for i, (name, called) in enumerate(calls)]}
    if len(calls) == 1:
        message["function_call"] = message["tool_calls"][0]["function"]
    return {"id": "chat" + first["id"], "object": "chat.completion", "created": first["created"],
            "model": first["model"],
            "choices": [{"finish_reason": "tool_calls", "index": 0, "logprobs": None, "message": message}],
            "usage": {key: sum(called["usage"][key] for _, called in calls)
                      for key in ("completion_tokens", "prompt_tokens", "total_tokens")}}


def _prompt(messages: list[dict], tools: list[dict]) -> str:
    try:
        return _TEMPLATE.render(messages=messages, tools=tools, tool_calls=bool(tools) or None,
                                add_generation_prompt=True)
    except (jinja2.TemplateError, TypeError) as e:  # a message or tool without a field the template reads
        raise InvalidOptionError(f"chat_format {NAME!r} cannot render the messages and tools: {e}") from None


def _tool(tools: list[dict], name: str) -> dict | None:
    return next((tool for tool in tools if tool["function"]["name"] == name), None)

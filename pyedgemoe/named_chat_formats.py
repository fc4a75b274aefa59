"""llama-cpp-python's named chat formats, Llama(chat_format="llama-2" | "mistral-instruct" | ...):
prompts made by Python formatters instead of the model's template, for models whose GGUF has
none (its README's chat example; Mixtral GGUFs converted before templates were stored).

Its formatters (llama_cpp.llama_chat_format, MIT) as they write the prompts, their oddities too
(a test compares every one with theirs), and its handler for them on Llama.create_completion: the
prompt's tokens (BOS added, special tokens parsed), the format's stop beside the caller's,
response_format's JSON grammar, a tool_choice naming a function answered as its call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

from pyedgemoe.completion_chat import arguments_grammar, as_call, as_chat, response_grammar
from pyedgemoe.completions import check_messages
from pyedgemoe.errors import InvalidOptionError
from pyedgemoe.tool_calls import from_functions


@dataclass(frozen=True)
class Formatted:
    prompt: str
    stop: str | None = None

# llama-cpp-python's templates it answers with its formatter instead (guess_chat_format_from_gguf_metadata:
# a model's template that is exactly one of these), and the format of a model without a template
_KNOWN_TEMPLATES = {
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}": "chatml",
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token + ' ' }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}":
        "mistral-instruct",
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}":
        "mistral-instruct",
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}": "llama-3",
}
WITHOUT_TEMPLATE = "llama-2"


def default_format(template: str | None) -> str:
    """llama-cpp-python's chat format where none is given, for a model with this template (None:
    none): its formatter's name for a template it knows, else "chat_template.default"."""
    if template is None:
        return WITHOUT_TEMPLATE
    return _KNOWN_TEMPLATES.get(template, "chat_template.default")


def _system_message(messages: list[dict]) -> str:
    """The first system message's content."""
    return next((m["content"] or "" for m in messages if m["role"] == "system"), "")


def _roles(messages: list[dict], names: dict[str, str]) -> list[tuple[str, str | None]]:
    """The messages of the roles named, as (the format's name of the role, the text or None)."""
    return [(names[m["role"]], m["content"] if isinstance(m["content"], str) else None)
            for m in messages if m["role"] in names]


def _llama2(system: str, turns, sep: str, sep2: str) -> str:
    seps, out = [sep, sep2], system + sep
    for i, (role, text) in enumerate(turns):
        if system and i == 0:
            out += (text or "") + seps[i % 2]
        elif text:
            out += role + text + " " + seps[i % 2]
        else:
            out += role + " "
    return out


def _colon_single(system: str, turns, sep: str, space: str = "") -> str:
    out = system + sep
    for role, text in turns:
        out += role + ": " + text + sep if text else role + ":" + space
    return out


def _colon_two(system: str, turns, sep: str, sep2: str) -> str:
    seps, out = [sep, sep2], system + sep
    for i, (role, text) in enumerate(turns):
        out += role + ": " + text + seps[i % 2] if text else role + ":"
    return out


def _no_colon(system: str, turns, sep: str) -> str:
    out = system
    for role, text in turns:
        out += role + text + sep if text else role
    return out


def _chatml(system: str, turns, sep: str) -> str:
    out = "" if system == "" else system + sep + "\n"
    for role, text in turns:
        out += role + "\n" + text + sep + "\n" if text else role + "\n"
    return out


def _chatglm3(system: str, turns, sep: str) -> str:
    out = system
    for role, text in turns:
        out += role + "\n" + " " + text if text else role
    return out


def _answered(messages, names: dict[str, str]) -> list[tuple[str, str | None]]:
    """The turns, then the assistant's, to be written."""
    return _roles(messages, names) + [(names["assistant"], None)]


def _llama_2(messages) -> Formatted:
    system = _system_message(messages)
    system = f"[INST] <<SYS>>\n{system}\n<</SYS>>" if system else system
    return Formatted(_llama2(system, _roles(messages, dict(user="<s>[INST]", assistant="[/INST]")), " ", "</s>")
                     + "[/INST]")


def _llama_3(messages) -> Formatted:
    names = {r: f"<|start_header_id|>{r}<|end_header_id|>\n\n" for r in ("system", "user", "assistant")}
    return Formatted(_no_colon("", _answered(messages, names), "<|eot_id|>"), "<|eot_id|>")


def _alpaca(messages) -> Formatted:
    turns = _roles(messages, dict(user="### Instruction", assistant="### Response"))
    return Formatted(_colon_two(_system_message(messages), turns, "\n\n", "</s>"))


def _qwen(messages) -> Formatted:
    system = "<|im_start|>system\n" + (_system_message(messages) or "You are a helpful assistant.")
    turns = _answered(messages, dict(user="<|im_start|>user", assistant="<|im_start|>assistant"))
    return Formatted(_chatml(system, turns, "<|im_end|>"), "<|endoftext|>")


_VICUNA_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. The assistant gives "
                  "helpful, detailed, and polite answers to the user's questions.")


def _vicuna(messages) -> Formatted:
    return Formatted(_colon_two(_VICUNA_SYSTEM, _answered(messages, dict(user="USER", assistant="ASSISTANT")),
                                " ", "</s>"))


def _oasst_llama(messages) -> Formatted:
    system = f"[INST] <<SYS>>\n{_system_message(messages)}\n<</SYS>>\n\n"
    return Formatted(_no_colon(system, _answered(messages, dict(user="<|prompter|>", assistant="<|assistant|>")),
                               "</s>"))


def _baichuan(user: str, assistant: str):
    def formatter(messages) -> Formatted:
        return Formatted(_no_colon(_system_message(messages), _answered(messages, dict(user=user, assistant=assistant)),
                                   ""))
    return formatter


_OPENBUDDY_SYSTEM = """You are a helpful, respectful and honest INTP-T AI Assistant named Buddy. You are talking to a human User.
Always answer as helpfully and logically as possible, while being safe. Your answers should not include any harmful, political, religious, unethical, racist, sexist, toxic, dangerous, or illegal content. Please ensure that your responses are socially unbiased and positive in nature.
If a question does not make any sense, or is not factually coherent, explain why instead of answering something not correct. If you don't know the answer to a question, please don't share false information.
You can speak fluently in many languages, for example: English, Chinese.
You cannot access the internet, but you have vast knowledge, cutoff: 2021-09.
You are trained by OpenBuddy team, (https://openbuddy.ai, https://github.com/OpenBuddy/OpenBuddy), you are based on LLaMA and Falcon transformers model, not related to GPT or OpenAI.

"""  # noqa: E501 - its text, as it is


def _openbuddy(messages) -> Formatted:
    return Formatted(_colon_single(_OPENBUDDY_SYSTEM, _answered(messages, dict(user="User", assistant="Assistant")),
                                   "\n"))


def _redpajama_incite(messages) -> Formatted:
    turns = _answered(messages, dict(user="<human>", assistant="<bot>"))
    return Formatted(_colon_single(_system_message(messages), turns, "\n"), "<human>")


_SNOOZY_SYSTEM = ("The prompt below is a question to answer, a task to complete, or a conversation to respond to; "
                  "decide which and write an appropriate response.")


def _snoozy(messages) -> Formatted:
    # there, the "### Instruction:" template is made and then dropped: the system text alone
    turns = _answered(messages, dict(user="### Prompt", assistant="### Response"))
    return Formatted(_colon_single(_system_message(messages) or _SNOOZY_SYSTEM, turns, "\n"), "###")


def _phind(messages) -> Formatted:
    turns = _answered(messages, dict(user="### User Message", assistant="### Assistant"))
    return Formatted(_colon_single("### System Prompt\nYou are an intelligent programming assistant.", turns, "\n\n"))


def _intel(messages) -> Formatted:
    # there, the system text is the template itself, never filled in
    turns = _answered(messages, dict(user="### User:", assistant="### Assistant:"))
    return Formatted(_colon_single("### System:\n{system_message}", turns, "\n"))


_OPEN_ORCA_SYSTEM = (
    "You are a helpful assistant. Please answer truthfully and write out your thinking step by step to be sure you "
    "get the right answer. If you make a mistake or encounter an error in your thinking, say so out loud and attempt "
    "to correct it. If you don't know or aren't sure about something, say so clearly. You will act as a professional "
    "logician, mathematician, and physicist. You will also act as the most appropriate type of expert to answer any "
    "particular question or solve the relevant problem; state which expert type your are, if so. Also think of any "
    "particular named expert that would be ideal to answer the relevant question or solve the relevant problem; name "
    "and act as them, if appropriate.")


def _open_orca(messages) -> Formatted:
    # there, the roles kept are "User" and "Assistant" as written: OpenAI's lower-case ones are dropped
    turns = _roles(messages, {"User": "User", "Assistant": "Assistant"}) + [("Assistant", None)]
    return Formatted(_colon_single(_OPEN_ORCA_SYSTEM, turns, "<|end_of_turn|>\n", space=" "), "User")


def _mistrallite(messages) -> Formatted:
    system = f"<|system|>{_system_message(messages)}</s>"
    return Formatted(_no_colon(system, _answered(messages, dict(user="<|prompter|>", assistant="</s>\n<|assistant|>")),
                               " "))


def _chatml_like(system_template: str, user: str, assistant: str, sep: str, write=_chatml):
    def formatter(messages) -> Formatted:
        turns = _answered(messages, dict(user=user, assistant=assistant))
        return Formatted(write(system_template.format(_system_message(messages)), turns, sep), sep)
    return formatter


def _mistral_instruct(messages) -> Formatted:
    prompt = ""
    for m in messages:
        if m["role"] == "user" and isinstance(m["content"], str):
            prompt += "[INST] " + m["content"]
        elif m["role"] == "assistant" and m["content"] is not None:
            prompt += " [/INST]" + m["content"] + "</s>"
    return Formatted(prompt + " [/INST]", "</s>")


def _saiga(messages) -> Formatted:
    prompt = ""
    for role, text in _roles(messages, dict(user="user", bot="bot", system="system")):
        prompt += f"<s>{role}\n{text}</s>" if text else f"<s>{role}\n"
    return Formatted((prompt + "<s>bot").strip())


def _gemma(messages) -> Formatted:  # a system message is left out
    turns = _answered(messages, dict(user="<start_of_turn>user\n", assistant="<start_of_turn>model\n"))
    return Formatted(_no_colon("", turns, "<end_of_turn>\n"), "<end_of_turn>\n")


FORMATTERS: dict[str, Callable[[list[dict]], Formatted]] = {
    "llama-2": _llama_2, "llama-3": _llama_3, "alpaca": _alpaca, "qwen": _qwen, "vicuna": _vicuna,
    "oasst_llama": _oasst_llama, "baichuan-2": _baichuan("<reserved_106>", "<reserved_107>"),
    "baichuan": _baichuan("<reserved_102>", "<reserved_103>"), "openbuddy": _openbuddy,
    "redpajama-incite": _redpajama_incite, "snoozy": _snoozy, "phind": _phind, "intel": _intel,
    "open-orca": _open_orca, "mistrallite": _mistrallite,
    "zephyr": _chatml_like("<|system|>\n{}", "<|user|>\n", "<|assistant|>\n", "</s>"),
    "pygmalion": _chatml_like("<|system|>{}", "<|user|>", "<|model|>", "\n"),
    "chatml": _chatml_like("<|im_start|>system\n{}", "<|im_start|>user", "<|im_start|>assistant", "<|im_end|>"),
    "mistral-instruct": _mistral_instruct,
    "chatglm3": _chatml_like("<|system|>\n{}", "<|user|>", "<|assistant|>", "</s>", write=_chatglm3),
    "openchat": _chatml_like("{}<|end_of_turn|>", "GPT4 Correct User: ", "<|end_of_turn|>GPT4 Correct Assistant: ",
                             "<|end_of_turn|>"),
    "saiga": _saiga, "gemma": _gemma,
}


def formatted(name: str, messages: list[dict]) -> Formatted:
    """The prompt (and stop) of format name; InvalidOptionError for messages it cannot read."""
    try:
        check_messages(messages)
        return FORMATTERS[name](messages)
    except InvalidOptionError as e:
        raise InvalidOptionError(f"chat_format {name!r}: {e}") from None
    except (KeyError, TypeError, AttributeError) as e:
        raise InvalidOptionError(f"chat_format {name!r}: each message needs a 'role' and a 'content' ({e!r})") \
            from None


def create_chat_completion(llama, messages: list[dict], *, chat_format: str, functions, function_call, tools,
                           tool_choice, stop, response_format, grammar, logprobs, top_logprobs, stream: bool,
                           **completion) -> dict | Iterator[dict]:
    """llama-cpp-python's handler of a named format: `completion` goes to create_completion as it is
    (temperature, ..., seed, max_tokens, model, logits_processor, logit_bias)."""
    result = formatted(chat_format, messages)
    tokens = llama.tokenize(result.prompt.encode("utf-8"), add_bos=True, special=True)
    if result.stop is not None:
        stop = ([] if stop is None else [stop] if isinstance(stop, str) else stop) + [result.stop]
    grammar = response_grammar(response_format, grammar)
    tools, tool_choice = from_functions(functions, function_call, tools, tool_choice)
    tool = None
    if isinstance(tool_choice, dict) and tools is not None:
        name = tool_choice["function"]["name"]
        tool = next((t for t in tools if t["function"]["name"] == name), None)
        if tool is None:
            raise InvalidOptionError(f"Tool choice '{name}' not found in tools.")
        grammar = arguments_grammar(tool)
    out = llama.create_completion(prompt=tokens, stream=stream, stop=stop, grammar=grammar,
                                  logprobs=top_logprobs if logprobs else None, **completion)
    return as_call(tool["function"]["name"], out, stream) if tool is not None else as_chat(out, stream)

"""Formatting chat messages with the model's template, the way llama-cpp-python does:
the GGUF's Jinja template (tokenizer.chat_template) rendered in a sandbox with what Transformers
gives templates, falling back to llama.cpp's built-in template matcher, then to ChatML when the
model has no template."""
from __future__ import annotations

import json
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pyedgemoe.errors import InvalidOptionError

TEMPLATE_KEY = "tokenizer.chat_template"  # the GGUF key of a model's Jinja template
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def template_source(value: str) -> str:
    """A chat template given in place of the model's (llama.cpp's --chat-template): Jinja, or
    "chatml" for ChatML; InvalidOptionError where Jinja cannot parse it."""
    if not isinstance(value, str) or not value.strip():
        raise InvalidOptionError(f"chat_template must be a Jinja template (or chatml), got {value!r}"[:200])
    source = CHATML if value == "chatml" else value
    try:
        parsed = _environment().parse(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise InvalidOptionError(f"the chat template does not parse: {e.message} (line {e.lineno})") from None
    # a name of llama.cpp's built-in templates (llama3, gemma, ...) is Jinja text that reads no message:
    # every chat became the name itself
    if "messages" not in jinja2.meta.find_undeclared_variables(parsed):
        raise InvalidOptionError(f"the chat template {value[:40]!r} never reads the messages: give a Jinja chat "
                                 "template (or chatml); llama.cpp's other built-in names are not taken")
    return source


class _Refusal(jinja2.exceptions.TemplateError):
    """A template's own raise_exception(...): it refuses the messages (Gemma 2 a system message)."""


class ChatTemplateRefusal(InvalidOptionError):
    """render_chat's error where the template's own raise_exception refused the messages."""


def _raise(message: str):
    raise _Refusal(message)


class _GenerationTags(jinja2.ext.Extension):
    """Transformers' {% generation %} ... {% endgeneration %} (marks the assistant's text for
    training): its body, as if the tags were not there."""
    tags = {"generation"}

    def parse(self, parser):
        parser.stream.skip(1)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _tojson(x, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    """Transformers' tojson: plain JSON, not Jinja's HTML-safe one (a tool's "<" stays "<")."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    """The sandbox a model's template renders in, with what Transformers (and llama-cpp-python) give
    templates: loop controls, the generation tags, their tojson and strftime_now."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTags, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda f: datetime.now().strftime(f)
    return env


def render_chat(template: str | None, messages: list[dict], *, bos_token: str, eos_token: str,
                native_fallback=None, tools: list[dict] | None = None, tool_choice=None,
                template_kwargs: dict | None = None) -> str:
    """messages: [{"role": ..., "content": ...}]; returns the prompt text up to the assistant's turn.
    tools and tool_choice (OpenAI's) go to the template, as llama-cpp-python hands them (ChatML and
    llama.cpp's built-in templates show no tools); template_kwargs are more of its variables
    (llama-server's chat_template_kwargs: {"enable_thinking": false}), over those. A template that
    refuses the messages (its raise_exception, as Gemma 2's of a system message: stock llama-cpp-python
    and Transformers raise it) is ChatTemplateRefusal in its words; one whose code fails on them
    (ZeroDivisionError, the sandbox's OverflowError), InvalidOptionError naming the error, where no
    fallback takes them."""
    if template:
        try:
            return _environment().from_string(template).render({
                "messages": messages, "add_generation_prompt": True, "bos_token": bos_token, "eos_token": eos_token,
                "tools": tools, "tool_choice": tool_choice, **(template_kwargs or {})})
        except _Refusal as e:
            raise ChatTemplateRefusal(f"the chat template refuses these messages: {e}") from None
        except Exception as e:
            # a template's own code fails on messages it does not expect (Qwen3's tests `in` on a
            # content that is null: TypeError)
            pairs = [(m["role"], m.get("content") or "") for m in messages]
            # llama.cpp's templates take text alone (not OpenAI's content parts)
            if native_fallback is not None and all(isinstance(r, str) and isinstance(c, str) for r, c in pairs):
                text = native_fallback(pairs)
                if text is not None:
                    return text
            raise InvalidOptionError(f"the chat template fails on these messages: {type(e).__name__}: {e}") from None
    env = ImmutableSandboxedEnvironment()
    return env.from_string(CHATML).render(messages=messages, add_generation_prompt=True)

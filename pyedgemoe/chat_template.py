"""Formatting chat messages with the model's template, the way llama-cpp-python does:
the GGUF's Jinja template (tokenizer.chat_template) rendered in a sandbox, falling back to
llama.cpp's built-in template matcher, then to ChatML when the model has no template."""
from __future__ import annotations

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pyedgemoe.errors import InvalidOptionError

TEMPLATE_KEY = "tokenizer.chat_template"  # the GGUF key of a model's Jinja template
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


def render_chat(template: str | None, messages: list[dict], *, bos_token: str, eos_token: str,
                native_fallback=None) -> str:
    """messages: [{"role": ..., "content": ...}]; returns the prompt text up to the assistant's turn.
    A template that refuses the messages (and no fallback that takes them) is InvalidOptionError."""
    if template:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        try:
            return env.from_string(template).render(
                messages=messages, add_generation_prompt=True,
                bos_token=bos_token, eos_token=eos_token,
            )
        except jinja2.exceptions.TemplateError as e:
            if native_fallback is not None:
                text = native_fallback([(m["role"], m["content"]) for m in messages])
                if text is not None:
                    return text
            raise InvalidOptionError(f"the model's chat template refuses these messages: {e}") from None
    env = ImmutableSandboxedEnvironment()
    return env.from_string(CHATML).render(messages=messages, add_generation_prompt=True)

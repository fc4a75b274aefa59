"""`pyedgemoe run --chat`: a conversation as llama.cpp's llama-cli holds one (tools/cli in the
vendored llama.cpp). -sys/--system-prompt is the system message; -p (or -f) the first user
message, echoed as if typed; each line read is the next. The whole history goes through the chat
template each turn, and the engine reuses the KV cache of the common prefix. Ctrl-C during a reply
stops the reply (what came so far stays in the history); Ctrl-C at the prompt, EOF or /exit end
the session."""
from __future__ import annotations

import dataclasses
import sys

import typer

from pyedgemoe.chat_formats import has_thinking_tags
from pyedgemoe.chat_template import TEMPLATE_KEY
from pyedgemoe.generation import SamplingParams

EXIT_COMMANDS = ("/exit", "/quit")
NO_THINKING_TAGS = "the chat template has no thinking tags llama.cpp knows: --reasoning-budget changes nothing"


def run_chat(eng, first_message: str | None, system_prompt: str | None, max_tokens: int | None,
             sampling: SamplingParams, stop: list[str] = (), single_turn: bool = False,
             template_kwargs: dict | None = None) -> bool:
    """The session; False when Ctrl-C at the prompt ended it, True on EOF or /exit, or after the
    first reply with single_turn (llama-cli's -st). stop: strings that end a reply (-r);
    template_kwargs: more of the chat template's variables (--chat-template-kwargs, -rea)."""
    if TEMPLATE_KEY not in eng.metadata:
        typer.echo(f"note: the model has no chat template ({TEMPLATE_KEY}): ChatML is used", err=True)
    if sampling.reasoning_budget_tokens >= 0 and not has_thinking_tags(eng, template_kwargs):
        typer.echo(f"note: {NO_THINKING_TAGS}", err=True)
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    while True:
        if first_message is not None:
            line, first_message = first_message, None
            sys.stdout.write(f"> {line}\n")
        else:
            try:
                line = input("> ")
            except EOFError:
                typer.echo("")
                return True
            except KeyboardInterrupt:
                typer.echo("")
                return False
        if line.strip() in EXIT_COMMANDS:
            return True
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        messages.append({"role": "assistant", "content": _reply(eng, messages, max_tokens, sampling, stop,
                                                                template_kwargs)})
        if single_turn:
            return True


def _reply(eng, messages: list[dict], max_tokens: int | None, sampling: SamplingParams, stop: list[str],
           template_kwargs: dict | None) -> str:
    """The assistant's reply to messages, streamed to stdout; Ctrl-C stops it where it is."""
    reply, interrupted = [], False
    chunks = eng.create_chat_completion(messages, max_tokens=max_tokens, stop=list(stop), stream=True,
                                        chat_template_kwargs=template_kwargs or None, **dataclasses.asdict(sampling))
    try:
        for chunk in chunks:
            piece = chunk["choices"][0]["delta"].get("content", "")
            reply.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
    except KeyboardInterrupt:
        chunks.close()
        interrupted = True
    sys.stdout.write("\n")
    sys.stdout.flush()
    if interrupted:
        typer.echo("note: reply interrupted (Ctrl-C at the prompt ends the session)", err=True)
    return "".join(reply)

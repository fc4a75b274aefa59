"""`pyedgemoe run --chat`: a conversation as llama.cpp's llama-cli holds one (tools/cli in the
vendored llama.cpp). -sys/--system-prompt is the system message; -p (or -f) the first user
message, echoed as if typed; each line read is the next (a line ending in '\\' goes on to the next one,
as llama-cli reads them: cli_input). The whole history goes through the chat
template each turn, and the engine reuses the KV cache of the common prefix. Ctrl-C during a reply
stops the reply (what came so far stays in the history); Ctrl-C at the prompt, EOF or /exit end
the session. llama-cli's commands (COMMANDS): /regen answers the last message again, /clear
empties the history (the system message stays), /read FILE and /glob PATTERN put text files
("--- File: NAME ---" before each) ahead of the next message."""
from __future__ import annotations

import dataclasses
import glob
import os
import sys
from pathlib import Path

import typer

from pyedgemoe.chat_formats import has_thinking_tags
from pyedgemoe.chat_template import TEMPLATE_KEY
from pyedgemoe.cli_input import read_input
from pyedgemoe.cli_report import print_context_full
from pyedgemoe.errors import ContextOverflowError, InvalidOptionError
from pyedgemoe.generation import SamplingParams

EXIT_COMMANDS = ("/exit", "/quit")
MAX_GLOBBED = 100  # llama-cli's FILE_GLOB_MAX_RESULTS
COMMANDS = ("commands: /exit (or Ctrl-C, EOF) ends the session, /regen answers the last message again, /clear "
            "empties the history, /read FILE adds a text file to the next message, /glob PATTERN the text files it "
            f"matches (at most {MAX_GLOBBED})")
NO_THINKING_TAGS = "the chat template has no thinking tags llama.cpp knows: --reasoning-budget changes nothing"
THINKING = ("[Start thinking]\n\n", "\n[End thinking]\n\n")  # llama-cli's marks around a reply's thoughts


def run_chat(eng, first_message: str | None, system_prompt: str | None, max_tokens: int | None,
             sampling: SamplingParams, stop: list[str] = (), single_turn: bool = False,
             template_kwargs: dict | None = None, reasoning_format: str | None = None, multiline: bool = False) -> int:
    """The session, ended by EOF or /exit, or after the first reply with single_turn (llama-cli's -st);
    its exit status: 130 where Ctrl-C at the prompt ended it, else 1 where a message got an error
    instead of a reply (said, and the session went on: a script piping messages learns of it), 0.
    stop: strings that end a reply (-r); template_kwargs: more of the chat template's variables
    (--chat-template-kwargs, -rea); reasoning_format (--reasoning-format auto, deepseek): a reply's
    thoughts apart, shown between THINKING's marks as llama-cli shows them and kept as the message's
    reasoning_content; multiline: llama-cli's -mli (cli_input)."""
    if TEMPLATE_KEY not in eng.metadata:
        typer.echo(f"note: the model has no chat template ({TEMPLATE_KEY}): ChatML is used", err=True)
    if sampling.reasoning_budget_tokens >= 0 and not has_thinking_tags(eng, template_kwargs):
        typer.echo(f"note: {NO_THINKING_TAGS}", err=True)
    if sys.stdin.isatty():
        typer.echo(COMMANDS, err=True)
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages, files = list(system), ""  # files: the text files read for the next message
    failed = 0  # the status where the session ends: 1 once a message failed
    while True:
        if first_message is not None:
            line, first_message = first_message, None
            sys.stdout.write(f"> {line}\n")
        else:
            sys.stdout.write("> ")
            sys.stdout.flush()
            try:
                line = read_input(multiline)
            except KeyboardInterrupt:
                typer.echo("")
                return 130
            if line is None:  # EOF
                typer.echo("")
                return failed
        command, _, argument = line.strip().partition(" ")
        if command in EXIT_COMMANDS:
            return failed
        if command == "/clear":
            messages, files = list(system), ""
            typer.echo("note: chat history cleared", err=True)
            continue
        if command in ("/read", "/glob") and argument.strip():
            files += _read(argument.strip()) if command == "/read" else _globbed(argument.strip())
            continue
        if command == "/regen":
            if not messages or messages[-1]["role"] != "assistant":
                typer.echo("note: no reply to regenerate", err=True)
                continue
            messages.pop()
        elif not line.strip():
            continue
        else:
            messages.append({"role": "user", "content": files + line})
            files = ""
        try:
            messages.append(_reply(eng, messages, max_tokens, sampling, stop, template_kwargs, reasoning_format))
        except (ContextOverflowError, InvalidOptionError) as e:  # this message's: said, and the session goes on
            if single_turn:
                raise
            typer.echo(f"error: {e}", err=True)
            failed = 1
            if messages[-1]["role"] == "user":
                messages.pop()
            continue
        if single_turn:
            return 0


def _read(path: str) -> str:
    """A text file as llama-cli puts it in a message ("" where it cannot be read, with a note)."""
    try:
        text = Path(path).read_bytes().decode("utf-8", "replace")
    except OSError:
        typer.echo(f"note: file does not exist or cannot be opened: '{path}'", err=True)
        return ""
    typer.echo(f"note: loaded text from '{path}'", err=True)
    return f"--- File: {path} ---\n{text}"


def _globbed(pattern: str) -> str:
    """The text files pattern matches (** any folders), at most MAX_GLOBBED, as _read puts them."""
    paths = [p for p in sorted(glob.glob(os.path.expanduser(pattern), recursive=True)) if os.path.isfile(p)]
    if len(paths) > MAX_GLOBBED:
        typer.echo(f"note: {len(paths)} files match: the first {MAX_GLOBBED} are read", err=True)
    if not paths:
        typer.echo(f"note: no file matches '{pattern}'", err=True)
    return "".join(_read(p) for p in paths[:MAX_GLOBBED])


def _reply(eng, messages: list[dict], max_tokens: int | None, sampling: SamplingParams, stop: list[str],
           template_kwargs: dict | None, reasoning_format: str | None) -> dict:
    """The assistant's message replying to messages, streamed to stdout (its thoughts, where parsed
    apart, between THINKING's marks), with a note where the context filled up before it ended; Ctrl-C
    stops it where it is."""
    reply, thoughts, interrupted, chunks = [], [], False, None
    try:  # Ctrl-C while the chat is rendered and tokenized too (it ended the session)
        chunks = eng.create_chat_completion(messages, max_tokens=max_tokens, stop=list(stop), stream=True,
                                            chat_template_kwargs=template_kwargs or None,
                                            reasoning_format=reasoning_format, **dataclasses.asdict(sampling))
        for chunk in chunks:
            delta = chunk["choices"][0]["delta"]
            thought, piece = delta.get("reasoning_content") or "", delta.get("content") or ""
            if thought:
                sys.stdout.write(("" if thoughts else THINKING[0]) + thought)
                thoughts.append(thought)
            if piece:
                sys.stdout.write(THINKING[1] if thoughts and not reply else "")
                sys.stdout.write(piece)
                reply.append(piece)
            sys.stdout.flush()
    except KeyboardInterrupt:
        if chunks is not None:
            chunks.close()
        interrupted = True
    sys.stdout.write("\n")
    sys.stdout.flush()
    if interrupted:
        typer.echo("note: reply interrupted (Ctrl-C at the prompt ends the session)", err=True)
    else:
        print_context_full(eng.last_timings, eng.n_ctx, max_tokens)
    message = {"role": "assistant", "content": "".join(reply)}
    return {**message, "reasoning_content": "".join(thoughts)} if thoughts else message

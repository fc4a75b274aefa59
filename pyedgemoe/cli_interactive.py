"""`pyedgemoe run -i`: llama.cpp's llama-completion in interactive mode (tools/completion in the
vendored llama.cpp), a text continued by turns with no chat template. The prompt is completed
until a reverse prompt (-r) ends the text, an end-of-generation token comes (the first reverse
prompt is then put in the text), -n tokens are spent, or Ctrl-C; then a line read from stdin goes
into the text (--in-prefix before it, --in-suffix after it) and the completion goes on. A line
ending in '\\' goes on to the next line (-mli: the other way round), one ending in '/' gives the
text back to the model without a newline (cli_input), an empty one gives it back as it is. EOF ends the session,
Ctrl-C while reading ends it with status 130. The whole text stays in the context: each turn
reuses the KV cache of what came before."""
from __future__ import annotations

import sys
from dataclasses import dataclass

import typer

from pyedgemoe.cli_escapes import process_escapes
from pyedgemoe.cli_input import read_input
from pyedgemoe.cli_report import print_timings
from pyedgemoe.generation import SamplingParams
from pyedgemoe.text_stream import TextStream


@dataclass(frozen=True)
class Interaction:
    """-i's settings: the reverse prompts, the text around each input, the input's reading."""
    reverse_prompts: tuple[str, ...] = ()
    in_prefix: str = ""
    in_suffix: str = ""
    in_prefix_bos: bool = False  # the model's BOS before each input (and its prefix)
    multiline: bool = False  # -mli (cli_input)
    escape: bool = True  # the input's escapes (\n, \t, ...) processed, as -e does
    read_first: bool = False  # -if: a line read before the first completion


def run_interactive(eng, prompt: str, max_tokens: int | None, sampling: SamplingParams, ignore_eos: bool,
                    interaction: Interaction, display_prompt: bool, special: bool) -> bool:
    """The session (an empty prompt: the reader's turn first); False when Ctrl-C while reading ended
    it, True on EOF or a full context."""
    tokens = eng.prompt_tokens(prompt)
    eng._check_fits(len(tokens), 1)  # a prompt the context cannot hold: plain completion's error (not a note, status 0)
    shown = prompt  # the text so far, where the reverse prompts are looked for
    if display_prompt:
        sys.stdout.write(prompt)
    interacting = interaction.read_first or not prompt or _ends_in_reverse_prompt(shown, interaction)
    remaining = max_tokens  # llama-completion's n_remain: what is left of -n until the reader's turn
    while True:
        if interacting:
            typer.echo(interaction.in_prefix, nl=False)
            try:
                text = read_input(interaction.multiline)
            except KeyboardInterrupt:
                typer.echo("")
                return False
            if text is None:
                typer.echo("")
                typer.echo("note: EOF by user", err=True)
                return True
            if text:  # an empty line gives the text back to the model as it is
                typer.echo(interaction.in_suffix, nl=False)
                line = eng.tokenize(process_escapes(text) if interaction.escape else text, add_bos=False)
                bos = [eng.token_bos()] if interaction.in_prefix_bos and eng.token_bos() is not None else []
                tokens += bos + eng.tokenize(interaction.in_prefix, add_bos=False, special=True) + line \
                    + eng.tokenize(interaction.in_suffix, add_bos=False, special=True)
                shown += interaction.in_prefix + text + interaction.in_suffix
                remaining = None if remaining is None else remaining - len(line)
            if remaining is not None and remaining <= 0:  # the input spent what was left: the reader's turn again
                remaining = max_tokens
                continue
        if len(tokens) >= eng.n_ctx:
            return _context_full(eng)
        generated, end, text = _complete(eng, tokens, remaining, sampling, ignore_eos, special, shown, interaction)
        tokens, shown, interacting = tokens + generated, shown + text, True
        if end == "eog" and interaction.reverse_prompts:  # as llama-completion: the first one goes into the text
            first = interaction.reverse_prompts[0]
            tokens += eng.tokenize(first, add_bos=False, special=True)
            shown += first
            sys.stdout.write(first)
        elif end == "eog":
            sys.stdout.write("\n")
        sys.stdout.flush()
        if end == "full":
            print_timings(eng.last_timings.to_dict())
            return _context_full(eng)
        if remaining is not None:
            remaining -= len(generated)
            remaining = max_tokens if remaining <= 0 else remaining


def _complete(eng, tokens: list[int], budget: int | None, sampling: SamplingParams, ignore_eos: bool, special: bool,
              shown: str, interaction: Interaction) -> tuple[list[int], str, str]:
    """One turn of the model, streamed to stdout: its tokens (an end-of-generation token among them,
    as llama-completion keeps it in the context), why it ended ("reverse", "eog", "length", "full" or
    "interrupted") and its text."""
    generation, picks = eng._generation(tokens, budget, sampling, ignore_eos)
    stream, generated, text, end = TextStream([]), [], "", None
    try:
        for token in picks:
            generated.append(token)
            text += _show("".join(stream.push(eng.token_piece(token, special))))
            if _ends_in_reverse_prompt(shown + text, interaction):
                end = "reverse"
                break
    except KeyboardInterrupt:
        end = "interrupted"
    finally:
        picks.close()
    if end is None and generation.end is not None:  # an end-of-generation token
        end = "eog"
        generated.append(generation.end[0])
        text += _show("".join(stream.push(eng.token_piece(generation.end[0], special))))
    elif end is None:
        end = "length" if budget is not None and len(generated) >= budget else "full"
    return generated, end, text + _show("".join(stream.flush()))


def _context_full(eng) -> bool:
    """The session's end where the context is full, said (True: not Ctrl-C's)."""
    typer.echo(f"note: the context of {eng.n_ctx} positions is full", err=True)
    return True


def _show(piece: str) -> str:
    sys.stdout.write(piece)
    sys.stdout.flush()
    return piece


def _ends_in_reverse_prompt(text: str, interaction: Interaction) -> bool:
    return any(r and text.endswith(r) for r in interaction.reverse_prompts)

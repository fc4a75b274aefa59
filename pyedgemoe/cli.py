"""The `pyedgemoe` command: run, perplexity, calibrate, inspect, convert, export, bench.

Errors a user can cause print one line (`error: ...`) on stderr and exit with status 1;
usage errors (unknown flags, values of the wrong type) exit with status 2.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer
# typer 0.29 vendors click; its usage-error types are only reachable here (typer is pinned).
from typer._click.exceptions import NoArgsIsHelpError, UsageError

from pyedgemoe.chat_formats import REASONING_FORMATS, has_thinking_tags
from pyedgemoe.cli_chat import NO_THINKING_TAGS, run_chat
from pyedgemoe.cli_escapes import escape_option, process_escapes, read_text_file, text_of
from pyedgemoe.cli_interactive import Interaction, run_interactive
from pyedgemoe.llama_env import read_llama_cpp_variables
from pyedgemoe.llama_flags import screened
from pyedgemoe.cli_options import (chat_template_options, log_options, model_name, model_options, model_source,
                                   sampling_options, speculative_options)
from pyedgemoe.cli_report import context_full, print_context_full, print_stats, print_timings
from pyedgemoe.convert.plan import DEFAULT_HIGH, DEFAULT_LOW
from pyedgemoe.errors import PyEdgeMoEError
from pyedgemoe.generation import SamplingParams
from pyedgemoe.memory_budget import KV_CELL_MULTIPLE, training_context
from pyedgemoe.prompt_cache import PromptCache
from pyedgemoe.server.limits import Limits
from pyedgemoe.sysmem import format_bytes, parse_size
from pyedgemoe.text_stream import utf8

DEFAULT_CTX = 4096  # run's and serve's --ctx left unset: at most this much of the model's training context
CTX_HELP = (f"context size in tokens, rounded up to a multiple of {KV_CELL_MULTIPLE} as llama.cpp allocates it "
            f"(default: the model's training context, at most {DEFAULT_CTX}; 0 = the model's)")
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None, help="Run Mixture-of-Experts GGUF models with a bounded expert memory.",
                  context_settings={"help_option_names": ["-h", "--help"]})


def print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        from pyedgemoe import _native

        typer.echo(f"pyedgemoe {version('pyedgemoe')}\n"
                   f"llama.cpp {_native.llama_version()} (from llama-cpp-python's sdist, with pyedgemoe's patches)")
        raise typer.Exit()


@app.callback()
def options(version: bool = typer.Option(False, "--version", is_eager=True, callback=print_version,
                                         help="print the version of pyedgemoe and of its llama.cpp, and exit")) -> None:
    """The command's own options (each subcommand has its own: pyedgemoe COMMAND -h)."""


def fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)


@contextmanager
def command_errors():
    """A command's work: an error the user can cause is one error line, Ctrl-C exit status 130."""
    try:
        yield
    except PyEdgeMoEError as e:
        fail(str(e))
    except KeyboardInterrupt:
        raise typer.Exit(130)


def parse_share(value: str, flag: str) -> float:
    """'1%' or '0.01' as 0.01; a bad value fails with one error line."""
    text = value.strip()
    try:
        share = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        fail(f"{flag} must be a share like 1% or 0.01, got {value!r}")
    if not (math.isfinite(share) and share >= 0):
        fail(f"{flag} must be a finite share >= 0, got {value!r}")
    return share


def print_model_note(eng, model: Path) -> None:
    """On stderr: a dense model has nothing to offload, else what the expert cache is; then the
    load plan's other notes (the context's size, options left unused)."""
    if not eng.info.is_moe:
        typer.echo(f"note: {model} has no experts ({eng.info.architecture} is dense): "
                   "it runs as plain llama.cpp, nothing to offload", err=True)
    else:
        typer.echo(f"note: {eng.expert_cache_note}", err=True)
    for note in eng.plan.notes:
        typer.echo(f"note: {note}", err=True)


@app.command()
@model_source()
@model_options
@sampling_options
@chat_template_options
@speculative_options
def run(
    model: Path,
    prompt: Optional[str] = typer.Option(None, "-p", "--prompt", help="prompt text; with --chat, the first user "
                                         "message (as llama.cpp's llama-cli)"),
    file: Optional[Path] = typer.Option(None, "-f", "--file", help="read the prompt from a file"),
    system_prompt: Optional[str] = typer.Option(None, "-sys", "--system-prompt",
                                                help="with --chat: the system message (as llama.cpp's -sys)"),
    system_prompt_file: Optional[Path] = typer.Option(None, "-sysf", "--system-prompt-file",
                                                      help="read --system-prompt from a file (as llama.cpp's -sysf)"),
    n_predict: int = typer.Option(128, "-n", "--predict", "--n-predict",
                                  help="tokens to generate (-1, or -2 as in llama.cpp: until the context is "
                                       "full)"),
    ctx: Optional[int] = typer.Option(None, "-c", "--ctx", "--ctx-size", help=CTX_HELP),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="go on past end-of-generation tokens (to -n)"),
    display_prompt: bool = typer.Option(True, "--display-prompt/--no-display-prompt",
                                        help="print the prompt before the generated text, as llama.cpp does"),
    color: Optional[bool] = typer.Option(None, "--color/--no-color", "-co", help="the prompt in color (ANSI yellow), "
                                         "the generated text plain; as llama.cpp's -co, also on, off or auto "
                                         "(default: auto, on a terminal)"),
    special: bool = typer.Option(False, "-sp", "--special", help="special tokens' text in the output (<|im_end|>, "
                                 "...), as llama.cpp's -sp"),
    verbose_prompt: bool = typer.Option(False, "--verbose-prompt", help="print the prompt's tokens (on stderr) "
                                        "before generating, as llama.cpp's"),
    chat: Optional[bool] = typer.Option(None, "--chat/--no-chat", "-cnv/-no-cnv", "--conversation/--no-conversation",
                                        help="interactive chat with the model's template (ChatML if it has none), as "
                                        "llama-cli's -cnv; Ctrl-C stops a reply, Ctrl-C at the prompt, EOF or /exit "
                                        "end the session; a message that fails (e.g. too long for the context) is an "
                                        "error line, the session goes on, and its exit status is then 1 (default: a "
                                        "chat where no -p, -f or --json is given, or where a chat's flag is: -sys, "
                                        "-sysf, -st, --reasoning-*, --chat-template-kwargs; as llama-cli)"),
    reasoning_format: str = typer.Option("none", "--reasoning-format", help=f"with --chat: a reply's thoughts, "
                                         f"{', '.join(REASONING_FORMATS)} (none: in the reply as written; auto, "
                                         "deepseek: apart, between [Start thinking] and [End thinking], as llama-cli)"),
    single_turn: bool = typer.Option(False, "-st", "--single-turn", help="with --chat: one reply (to -p, else to "
                                     "the line read), then exit, as llama-cli's -st"),
    reverse_prompt: Optional[list[str]] = typer.Option(None, "-r", "--reverse-prompt",
                                                       help="stop generating where this text comes (the output ends "
                                                            "before it; with --chat, the reply; with -i, the turn, "
                                                            "after it); as llama.cpp's -r, can be given several times"),
    interactive: bool = typer.Option(False, "-i", "--interactive", help="llama-completion's interactive mode: the "
                                     "text is completed until a reverse prompt (-r), an end-of-generation token or -n "
                                     "tokens, then a line read goes into it and the completion goes on (no chat "
                                     "template; Ctrl-C gives the turn back, Ctrl-C while reading or EOF ends it)"),
    interactive_first: bool = typer.Option(False, "-if", "--interactive-first", help="-i, reading a line first"),
    in_prefix: str = typer.Option("", "--in-prefix", help="with -i: text put before each line read"),
    in_suffix: str = typer.Option("", "--in-suffix", help="with -i: text put after each line read"),
    in_prefix_bos: bool = typer.Option(False, "--in-prefix-bos", help="with -i: the model's BOS before each line "
                                       "read (and --in-prefix)"),
    multiline: bool = typer.Option(False, "-mli", "--multiline-input", help="with -i or --chat: read lines until "
                                   "one ends in '\\' (without it, a line ending in '\\' goes on to the next one; "
                                   "one ending in '/' ends the input without its newline), as llama.cpp's -mli"),
    escape: bool = escape_option("-p, -f, -r, --in-prefix and --in-suffix"),
    prompt_cache: Optional[Path] = typer.Option(None, "--prompt-cache", help="a file of the prompt's evaluated state "
                                                "(its KV cache): read where it exists, so that a prompt beginning "
                                                "with its tokens skips them, and written after the run, as "
                                                "llama.cpp's llama-completion (its session files)"),
    prompt_cache_all: bool = typer.Option(False, "--prompt-cache-all", help="with --prompt-cache: the generated "
                                          "text's state too"),
    prompt_cache_ro: bool = typer.Option(False, "--prompt-cache-ro", help="with --prompt-cache: read it, never "
                                         "write it"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of streaming (not with --chat)"),
    stats: bool = typer.Option(False, "--stats", help="print the engine's statistics at the end (of the session, "
                               "with --chat)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the load plan (each decision and why) and exit "
                                 "without loading the model"),
    engine_options: dict = None,
    sampling: SamplingParams = None,
    template_kwargs: dict = None,
    draft_model=None,
) -> None:
    """Generate text from a prompt (or chat) with a GGUF model."""
    from pyedgemoe.engine import Engine

    if prompt is not None and file is not None:
        fail("give the prompt with -p or -f, not both")
    interactive = interactive or interactive_first
    if chat is None and interactive:  # as llama-completion with -no-cnv
        chat = False
    if chat is None:  # as llama-cli: a conversation unless there is a text to complete; a chat's own flag makes one
        chat = system_prompt is not None or system_prompt_file is not None or single_turn or bool(template_kwargs) \
            or sampling.reasoning_budget_tokens >= 0 or reasoning_format != "none" \
            or (prompt is None and file is None and not as_json and prompt_cache is None)
    if chat and as_json:
        fail("--json prints one object for one prompt; --chat is a conversation: give one of them")
    if interactive and (chat or as_json or prompt_cache is not None):
        fail("-i completes a text by turns; --chat (a conversation), --json and --prompt-cache (one prompt's) are "
             "not that: give one of them")
    if (in_prefix or in_suffix or in_prefix_bos) and not interactive:
        fail("--in-prefix, --in-suffix and --in-prefix-bos are -i's: give -i too")
    if system_prompt_file is not None:
        if system_prompt is not None:
            fail("give the system message with -sys or -sysf, not both")
        try:
            system_prompt = read_text_file(system_prompt_file, escape=False)
        except OSError as e:
            fail(f"cannot read the system prompt's file: {e}")
    if system_prompt is not None and not chat:
        fail("--system-prompt is the system message of a chat session, which --no-chat leaves out: put it in the prompt")
    if single_turn and not chat:
        fail("--single-turn is one turn of a chat session, which --no-chat leaves out")
    if template_kwargs and not chat:
        fail("--chat-template-kwargs, --reasoning and --reasoning-effort are the chat template's, which --no-chat leaves "
             "out")
    if sampling.reasoning_budget_tokens >= 0 and not chat:
        fail("--reasoning-budget is a chat's (its template's thinking tags), which --no-chat leaves out")
    check_reasoning_format(reasoning_format)
    if reasoning_format != "none" and not chat:
        fail("--reasoning-format parses a chat's replies, which --no-chat leaves out")
    if reverse_prompt and as_json:
        fail("--reverse-prompt ends streamed text; --json gives the tokens: give one of them")
    if (prompt_cache_all or prompt_cache_ro) and prompt_cache is None:
        fail("--prompt-cache-all and --prompt-cache-ro are settings of --prompt-cache FNAME: give it too")
    if prompt_cache is not None and chat:
        fail("--prompt-cache keeps one prompt's state (as llama-completion's); a --chat session is not one: give "
             "one of them")
    if prompt_cache is not None and not prompt_cache.parent.is_dir():  # before the run, not after it
        fail(f"--prompt-cache {prompt_cache}: no directory {prompt_cache.parent}")
    if n_predict < -2:
        fail(f"--n-predict must be >= -2 (-1, -2: until the context is full), got {n_predict}")
    ctx = context_size(model, ctx)
    if dry_run:
        print_plan(model, ctx, sampling.seed, engine_options, draft_model)
        return
    if file is not None:
        try:
            prompt = read_text_file(file, escape)
        except OSError as e:
            fail(f"cannot read prompt file: {e}")
    elif prompt is not None and escape:  # as llama.cpp reads them (its -e, on by default)
        prompt = process_escapes(prompt)
    if prompt is None and not chat and not interactive:
        fail("no prompt: give -p TEXT, -f FILE, --chat or -i")
    if (special or verbose_prompt) and chat:
        fail("--special and --verbose-prompt are a completion's (-p, -f): a --chat session has neither")
    stop = [process_escapes(s) if escape else s for s in reverse_prompt or []]
    in_prefix, in_suffix = (process_escapes(s) if escape else s for s in (in_prefix, in_suffix))
    max_tokens = None if n_predict < 0 else n_predict  # to a full context (llama.cpp's -1 would shift it, not here)
    # the seed is the Engine's: a call's own seed would evaluate each chat turn afresh (Engine._generation)
    seed, sampling = sampling.seed, dataclasses.replace(sampling, seed=None)
    with command_errors():
        with Engine(model, n_ctx=ctx, seed=seed, draft_model=draft_model, **engine_options) as eng:
            print_model_note(eng, model)  # stderr: --json's stdout stays one object
            cache = PromptCache(eng, prompt_cache, prompt_cache_all, prompt_cache_ro) if prompt_cache else None
            if chat:
                status = run_chat(eng, prompt, system_prompt, max_tokens, sampling, stop, single_turn, template_kwargs,
                                  reasoning_format, multiline)
            elif interactive:
                status = 0 if run_interactive(eng, prompt or "", max_tokens, sampling, ignore_eos, Interaction(
                    tuple(stop), in_prefix, in_suffix, in_prefix_bos, multiline, escape, interactive_first),
                    display_prompt, special) else 130
            elif as_json:
                tokens = eng.prompt_tokens(prompt)
                print_prompt_tokens(eng, prompt, tokens) if verbose_prompt else None
                ids = list(eng.generate_tokens(tokens, max_tokens, sampling, ignore_eos=ignore_eos))
                t = eng.last_timings
                typer.echo(json.dumps({
                    "text": eng.detokenize(ids, special=special), "tokens": ids, "n_prompt_tokens": t.n_prompt_tokens,
                    "prefill_seconds": t.prefill_seconds,
                    "decode_tokens_per_second": t.decode_tokens_per_second,
                    "finish_reason": t.finish_reason,
                    "context_full": context_full(t.finish_reason, t.n_decoded, max_tokens), "stats": eng.stats(),
                }))
                status = 0
            else:
                print_prompt_tokens(eng, prompt, eng.prompt_tokens(prompt)) if verbose_prompt else None
                color = sys.stdout.isatty() if color is None else color  # llama.cpp's auto
                status = 0 if stream_text(eng, prompt, max_tokens, sampling, ignore_eos, display_prompt, color, stop,
                                          special) else 130
            if cache is not None:
                save_prompt_cache(cache, eng.last_timings)
            if as_json:
                return
            if stats:
                print_stats(eng.stats())
            if status:
                raise typer.Exit(status)


PROMPT_COLOR, RESET_COLOR = "\033[33m", "\033[0m"  # run --color: llama.cpp's prompt color


def check_reasoning_format(value: str) -> None:
    """--reasoning-format's value (run's and serve's), one of llama-server's."""
    if value not in REASONING_FORMATS:
        fail(f"--reasoning-format takes {', '.join(REASONING_FORMATS)}, got {value!r}")


def context_size(model: Path, ctx: int | None) -> int:
    """--ctx, or the model's training context, at most DEFAULT_CTX (llama.cpp's default is the whole
    of it, which can be a KV cache of many GiB)."""
    if ctx is not None:
        return ctx
    trained = trained_context(model)
    return min(trained, DEFAULT_CTX) if trained else DEFAULT_CTX


def trained_context(model: Path) -> int:
    """The model's training context (0: its file does not say)."""
    from pyedgemoe.model_info import read_model_info

    try:
        return training_context(read_model_info(model).metadata)
    except PyEdgeMoEError as e:
        fail(str(e))


def stream_text(eng, prompt: str, max_tokens: Optional[int], sampling: SamplingParams, ignore_eos: bool,
                display_prompt: bool, color: bool, stop: list[str], special: bool = False) -> bool:
    """The prompt and its continuation (up to a stop string; special: special tokens' text too) on
    stdout as they come, then the timings (and why it stopped, when the context ran out) on stderr;
    False when Ctrl-C stopped it."""
    pieces = eng.generate(prompt, max_tokens, stop=stop, stream=True, ignore_eos=ignore_eos, special=special,
                          **dataclasses.asdict(sampling))
    if display_prompt:  # shown before its evaluation, as llama.cpp does
        sys.stdout.write(f"{PROMPT_COLOR}{prompt}{RESET_COLOR}" if color else prompt)
        sys.stdout.flush()
    interrupted = False
    try:
        for piece in pieces:
            sys.stdout.write(piece)
            sys.stdout.flush()
    except KeyboardInterrupt:  # as llama.cpp: the timings of what was generated, then exit status 130
        pieces.close()
        interrupted = True
    finally:  # the text's line ends, before an error's line too (a terminal shows both streams)
        sys.stdout.write("\n")
        sys.stdout.flush()
    t = eng.last_timings
    evaluated = t.prefill_seconds > 0  # else Ctrl-C came while the prompt was evaluated: no timings yet
    if evaluated:
        print_timings(t.to_dict())
    if interrupted:
        typer.echo(f"note: interrupted (Ctrl-C){'' if evaluated else ' while the prompt was evaluated'}", err=True)
    else:
        print_context_full(t, eng.n_ctx, max_tokens)
    return not interrupted


def print_prompt_tokens(eng, prompt: str, tokens: list[int]) -> None:
    """run --verbose-prompt: the prompt and its tokens on stderr, as llama.cpp's llama-completion shows them."""
    typer.echo(f"prompt: '{prompt}'\nnumber of tokens in prompt = {len(tokens)}", err=True)
    for token in tokens:
        piece = eng.token_piece(token, special=True).decode("utf-8", "replace")
        typer.echo(f"{token:6d} -> '{piece}'", err=True)
    typer.echo("", err=True)


def save_prompt_cache(cache, timings) -> None:
    """run --prompt-cache: the cache written after the run, and what it saved on stderr."""
    saved = cache.save(timings.n_prompt_tokens)
    typer.echo(f"note: prompt cache {cache.path}: {timings.n_cached_prompt_tokens} of the prompt's "
               f"{timings.n_prompt_tokens} tokens reused" + (f", {saved} tokens saved" if saved else ""), err=True)


def print_plan(model: Path, ctx: int, seed: Optional[int], engine_options: dict, draft_model=None) -> None:
    """run --dry-run: the plan Engine(model, ...) would execute, without loading the model."""
    from pyedgemoe.load_plan import LoadOptions, check_drafts, plan_for

    try:
        _, plan = plan_for(model, LoadOptions(n_ctx=ctx, seed=seed, **{k: v for k, v in engine_options.items()
                                                                       if k != "verbose"}))
        check_drafts(plan, draft_model)
    except PyEdgeMoEError as e:
        fail(str(e))
    typer.echo(f"plan for {model}:")
    typer.echo("\n".join(f"  {line}" for line in plan.describe()))


@app.command()
@model_source()
@model_options
@sampling_options(request_defaults=True)
@chat_template_options(request_defaults=True)
@speculative_options
def serve(
    command: typer.Context,
    model: Path,
    host: str = typer.Option("127.0.0.1", "--host", help="address to listen on (0.0.0.0: every interface)"),
    port: int = typer.Option(8080, "--port", help="TCP port (0: any free one)"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="PYEDGEMOE_API_KEY",
                                          help="require 'Authorization: Bearer KEY' on every path but /health; "
                                          "several keys comma-separated, as llama-server's"),
    api_key_file: Optional[Path] = typer.Option(None, "--api-key-file", help="API keys from a file, one a line "
                                                "(# starts a comment), as llama-server's"),
    parallel: int = typer.Option(1, "-np", "--parallel", help="requests decoded together, in one batch per step "
                                 "(the others queue); the context is shared: -c / N positions each (docs/server.md)"),
    ctx: Optional[int] = typer.Option(None, "-c", "--ctx", "--ctx-size", help=CTX_HELP),
    max_body: str = typer.Option(format_bytes(Limits.max_body_bytes, 0), "--max-body",
                                 help="largest request body (e.g. 8MiB); a larger one is refused (413) unread"),
    timeout: float = typer.Option(Limits.timeout_seconds, "--timeout",
                                  help="seconds a request's head, and then its body, may take to arrive, and an "
                                  "answer may wait for the client to read any of it (else the connection is closed)"),
    max_connections: int = typer.Option(Limits.max_connections, "--max-connections",
                                        help="connections served at once; a request on one more is answered 503, "
                                        "and such a connection is closed 2 s after its last answer"),
    allowed_hosts: str = typer.Option("", "--allowed-hosts",
                                      help="comma-separated names the server may be reached by besides IP "
                                      "addresses and localhost (e.g. behind a proxy; * for any): web pages of "
                                      "other sites cannot reach it by another name (docs/server.md)"),
    alias: Optional[str] = typer.Option(None, "-a", "--alias", help="the model's name in the API (/v1/models, "
                                        "requests' model; default: -hf's USER/MODEL[:QUANT], else the file's name), as llama-server's"),
    reasoning_format: str = typer.Option("none", "--reasoning-format",
                                         help=f"a chat's thoughts where a request gives no reasoning_format: "
                                         f"{', '.join(REASONING_FORMATS)} (none: in the content, as "
                                         "llama-cpp-python; auto: apart, in reasoning_content, as llama-server)"),
    embeddings: bool = typer.Option(False, "--embeddings", "--embedding",
                                    help="serve embeddings: /v1/embeddings (a vector per input: give --pooling "
                                    "mean, last or cls), /embeddings (a row per token without), as llama-server's"),
    n_predict: Optional[int] = typer.Option(None, "-n", "--predict", "--n-predict",
                                            help="tokens a request generates where it gives no max_tokens or "
                                            "n_predict (-1: to the end of the text or the context), as "
                                            "llama-server's (default: OpenAI's, 16 for a completion, the turn's "
                                            "end for a chat)"),
    cont_batching: bool = typer.Option(False, "-cb", "--cont-batching", help="llama-server's: requests join the "
                                       "running batch as they come (-np N), as they always do here"),
    metrics: bool = typer.Option(False, "--metrics", help="llama-server's: /metrics, which is always served here"),
    cache_reuse: Optional[int] = typer.Option(None, "--cache-reuse", help="llama-server's reuse of cached chunks by "
                                              "shifting the KV cache: not done here (a request reuses the longest "
                                              "start it shares with what a sequence holds); noted, not used"),
    webui: bool = typer.Option(True, "--webui/--no-webui", "--ui/--no-ui", help="the web pages at / (the chat UI "
                               "when built, the expert cache at /experts), as llama-server's; off: the API alone"),
    spm_infill: bool = typer.Option(False, "--spm-infill",
                                    help="fill in the middle (/infill, /v1/completions' suffix) with the suffix "
                                    "before the prefix, as some models were trained (llama-server's)"),
    prefill_assistant: bool = typer.Option(True, "--prefill-assistant/--no-prefill-assistant", help="a chat whose "
                                           "last message is the assistant's continues it (an assistant's prefill), "
                                           "as llama-server's; off: a new message follows it"),
    slot_save_path: Optional[Path] = typer.Option(None, "--slot-save-path", help="a directory for slot files: POST "
                                                  "/slots/N?action=save|restore|erase keeps a sequence's KV cache "
                                                  "there and reads it back, as llama-server's (made where missing)"),
    engine_options: dict = None,
    sampling: dict = None,
    template_kwargs: dict = None,
    draft_model=None,
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API: /v1/models, /v1/completions,
    /v1/chat/completions, /health, /metrics; llama-server's /completion and /infill; with --embeddings,
    /v1/embeddings and /embeddings (docs/server.md)."""
    if not 0 <= port <= 65535:
        fail(f"--port must be in 0..65535, got {port}")
    if parallel < 1:
        fail(f"--parallel must be >= 1, got {parallel}")
    try:
        limits = Limits(max_body_bytes=parse_size(max_body), timeout_seconds=timeout, max_connections=max_connections)
    except ValueError as e:
        fail(f"--max-body: {e}")
    if not (math.isfinite(timeout) and timeout > 0):
        fail(f"--timeout must be a positive number of seconds, got {timeout}")
    if max_connections < 1:
        fail(f"--max-connections must be >= 1, got {max_connections}")
    check_reasoning_format(reasoning_format)
    if slot_save_path is not None:
        try:
            slot_save_path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            fail(f"--slot-save-path: cannot make the directory {slot_save_path}: {e.strerror or e}")
    if cache_reuse:
        typer.echo(f"note: --cache-reuse {cache_reuse}: not used (no chunk is reused by shifting the KV cache; a "
                   "request reuses the longest start it shares with what its sequence holds)", err=True)
    if n_predict is not None:
        if n_predict < -1:
            fail(f"--n-predict must be >= -1 (-1: to the end), got {n_predict}")
        sampling["max_tokens"] = None if n_predict == -1 else n_predict
    chat_defaults = {"reasoning_format": reasoning_format, "prefill_assistant": prefill_assistant}
    if template_kwargs:
        chat_defaults["chat_template_kwargs"] = template_kwargs
    try:
        from pyedgemoe.server.middleware import api_keys
        from pyedgemoe.server.serve import serve as serve_engine
    except ImportError as e:
        fail(f"the server needs its extra ({e.name} is missing): pip install 'pyedgemoe[server]'")
    try:
        keys = api_keys(api_key, api_key_file)
    except (OSError, UnicodeDecodeError) as e:
        fail(f"cannot read --api-key-file: {getattr(e, 'strerror', None) or e}")
    if (api_key is not None or api_key_file is not None) and not keys:
        fail("--api-key / --api-key-file give no key")
    from pyedgemoe.engine import Engine
    from pyedgemoe.listen import bind_socket

    try:
        sock = bind_socket(host, port)
    except OSError as e:
        fail(f"cannot listen on {host}:{port}: {e.strerror or e}")
    with command_errors():
        # -s is the Engine's seed, as run's: a request's own seed evaluates its prompt afresh (Engine._generation)
        seed = sampling.pop("seed", None)
        with sock, Engine(model, n_ctx=context_size(model, ctx), n_parallel=parallel, draft_model=draft_model, seed=seed,
                          **engine_options) as eng:
            print_model_note(eng, model)
            # the defaults' grammar or schema, checked as run checks its own (not refused with every request)
            defaults = SamplingParams.of({k: v for k, v in sampling.items() if k != "max_tokens"})
            eng.generate_tokens([0], 0, defaults).close()
            if sampling.get("reasoning_budget_tokens", -1) >= 0 and not has_thinking_tags(eng):
                typer.echo(f"note: {NO_THINKING_TAGS}", err=True)
            serve_engine(eng, sock, model_id=alias or model_name(command, model), model_aliases=(model.name, str(model)),
                         api_keys=keys, limits=limits, chat_defaults=chat_defaults, embeddings=embeddings,
                         spm_infill=spm_infill, request_defaults=sampling, web_pages=webui,
                         slot_directory=None if slot_save_path is None else str(slot_save_path),
                         allowed_hosts=tuple(h for h in allowed_hosts.split(",") if h.strip()))


@app.command("perplexity")
@model_source()
@model_options
def perplexity_command(
    model: Path,
    file: Optional[Path] = typer.Option(None, "-f", "--file", help="the text to score (e.g. wikitext-2's "
                                        "wiki.test.raw); with --kl-divergence, the base's tokens instead"),
    ctx: Optional[int] = typer.Option(None, "-c", "--ctx", "--ctx-size", show_default=False,
                                      help="tokens per chunk, llama-perplexity's --ctx-size (default 512; 0: the "
                                      "model's training context; with --kl-divergence, the base's)"),
    chunks: Optional[int] = typer.Option(None, "--chunks", help="score at most this many chunks (default, or -1 as "
                                         "in llama.cpp: all)"),
    decode_mode: bool = typer.Option(False, "--decode-mode", help="one token per llama_decode, routed (and with "
                                     "an expert cache, loaded) as generation does"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    escape: bool = escape_option("the text", default=False),
    kl_base: Optional[Path] = typer.Option(None, "--kl-divergence-base", help="write the run's token "
                                           "probabilities to this file (llama-perplexity's; with --kl-divergence: "
                                           "read them from it)"),
    kl_divergence: bool = typer.Option(False, "--kl-divergence", help="the KL divergence of this run's token "
                                       "probabilities from the base's, as llama-perplexity's (docs/perplexity.md)"),
    engine_options: dict = None,
) -> None:
    """Perplexity of a text file as llama.cpp's llama-perplexity computes it (docs/perplexity.md)."""
    from pyedgemoe.engine import Engine
    from pyedgemoe.kl_divergence import BaseWriter
    from pyedgemoe.model_source import shard_names
    from pyedgemoe.output_files import check_output, whole_file
    from pyedgemoe.perplexity import DEFAULT_N_CTX, MIN_N_CTX, perplexity, text_tokens

    if chunks == -1:
        chunks = None
    if chunks is not None and chunks <= 0:
        fail(f"--chunks must be a positive number of chunks (or -1: all), got {chunks}")
    if kl_divergence:
        if kl_base is None:
            fail("--kl-divergence compares with a base: give --kl-divergence-base FNAME (written by a run with -f)")
        if as_json:
            fail("--kl-divergence prints llama-perplexity's statistics; --json is perplexity's: give one of them")
        for given, flag in ((file, "-f"), (ctx, "-c")):
            if given is not None:
                typer.echo(f"note: {flag} is unused: --kl-divergence evaluates the base's tokens in its chunks",
                           err=True)
        return kl_divergence_run(model, kl_base, chunks, decode_mode, engine_options)
    if ctx is None:
        ctx = DEFAULT_N_CTX
    if ctx == 0:  # llama.cpp's: the model's
        ctx = trained_context(model)
    if ctx < MIN_N_CTX:
        fail(f"--ctx must be at least {MIN_N_CTX} tokens for perplexity, got {ctx}")
    if file is None:
        fail("no text: give -f FILE (or --kl-divergence with --kl-divergence-base)")
    try:
        text = read_text_file(file, escape)
    except OSError as e:
        fail(f"cannot read text file: {e}")

    def print_running(i: int, ppl: float) -> None:
        sys.stdout.write(f"[{i + 1}]{ppl:.4f},")
        sys.stdout.flush()

    with command_errors():
        if kl_base is not None:  # a typo must not overwrite the model or the text (it did)
            check_output(kl_base, "KL-divergence base", [file, *(model.parent / n for n in shard_names(model.name))])
        with Engine(model, n_ctx=ctx, n_logits=ctx, **engine_options) as eng, \
                whole_file(kl_base) if kl_base is not None else contextlib.nullcontext() as base_file:
            print_model_note(eng, model)  # stderr: --json's stdout stays one object
            tokens = text_tokens(eng, text, ctx, chunks)
            n_chunks = min(chunks or len(tokens), len(tokens) // ctx)
            base = BaseWriter(base_file, kl_base, tokens, ctx, n_chunks) if base_file is not None else None
            result = perplexity(eng, tokens, n_ctx=ctx, n_chunks=chunks, on_chunk=None if as_json else print_running,
                                on_logits=base, one_token_per_step=decode_mode)
            if as_json:
                typer.echo(json.dumps({**result.to_dict(), "stats": eng.stats()}))
                return
            sys.stdout.write("\n")
            typer.echo(f"ppl = {result.ppl:.4f} +/- {result.stderr:.5f}")
            typer.echo(f"{result.n_chunks} chunks of {result.n_ctx} tokens, {result.n_tokens_scored} tokens scored "
                       f"in {result.seconds:.2f} s", err=True)


def kl_divergence_run(model: Path, base_path: Path, chunks: Optional[int], decode_mode: bool,
                      engine_options: dict) -> None:
    """perplexity --kl-divergence: the base's tokens evaluated, each chunk's line and the statistics
    at the end as llama-perplexity prints them."""
    from pyedgemoe.engine import Engine
    from pyedgemoe.kl_divergence import HEADER, Base, chunk_line, compare, summary

    with command_errors():
        base = Base.read(base_path)
        with Engine(model, n_ctx=base.n_ctx, n_logits=base.n_ctx, **engine_options) as eng:
            print_model_note(eng, model)
            # the header with the first chunk's line: after compare's checks of the base against the model
            divergence = compare(eng, base, chunks, decode_mode,
                                 on_chunk=lambda i, d: typer.echo((HEADER + "\n" if i == 0 else "") + chunk_line(i, d)))
        typer.echo("")
        for line in summary(divergence):  # none for fewer than 100 positions, as llama-perplexity
            typer.echo(line)


@app.command("embed")
@model_source()
@model_options
def embed_command(
    model: Path,
    prompt: Optional[str] = typer.Option(None, "-p", "--prompt", help="the texts, split at --embd-separator"),
    file: Optional[Path] = typer.Option(None, "-f", "--file", help="read the texts from a file"),
    separator: str = typer.Option("\n", "--embd-separator", help="what separates the texts (default: a line break)"),
    normalization: int = typer.Option(2, "--embd-normalize", help="each vector divided by: -1 nothing, 0 its largest "
                                      "magnitude / 32760 (int16's range), 1 its taxicab norm, 2 its euclidean norm, "
                                      "p > 2 its p-norm"),
    output_format: str = typer.Option("", "--embd-output-format", help="how to print them: '' (a table), array, json "
                                      "(OpenAI's list), json+ (json and the cosine similarities) or raw (a line each)"),
    ctx: int = typer.Option(512, "-c", "--ctx", "--ctx-size", help="context size in tokens (0 = the model's); "
                            "-b is raised to it"),
    escape: bool = escape_option("-p and -f"),
    engine_options: dict = None,
) -> None:
    """The texts' embeddings, as llama.cpp's llama-embedding prints them: a row per token, or a
    vector per text with --pooling mean, cls or last."""
    import numpy as np

    from pyedgemoe.cli_embed import FORMATS, formatted, split_texts
    from pyedgemoe.embeddings import FLAGS, POOLING_NONE, check_one_pass, pooling_type
    from pyedgemoe.engine import Engine

    if (prompt is None) == (file is None):
        fail("give the texts with -p or -f (one of them)")
    if output_format not in FORMATS:
        fail(f"--embd-output-format takes '', {', '.join(FORMATS[1:])}, got {output_format!r}")
    if normalization < -1:
        fail(f"--embd-normalize must be -1 or more, got {normalization}")
    if not separator:
        fail("--embd-separator is empty")
    try:
        text = read_text_file(file, escape) if file is not None else process_escapes(prompt) if escape else prompt
    except OSError as e:
        fail(f"cannot read the texts: {e.strerror or e}{f': {file}' if file is not None else ''}")
    texts = split_texts(text, separator)
    engine_options["n_batch"] = max(engine_options["n_batch"], ctx)  # a text may fill the context, as there
    with command_errors():
        with Engine(model, n_ctx=ctx, **engine_options) as eng:
            print_model_note(eng, model)
            rows = []
            pooled = pooling_type(eng) != POOLING_NONE
            for t in texts:
                ids = eng.tokenize(t, add_bos=True, special=True)
                check_one_pass(eng, len(ids), FLAGS)  # in the CLI's words
                # a text of no tokens (a blank line): a vector of zeros, or no rows, as llama-embedding gives
                rows.append(eng.embed(ids, truncate=False) if ids else np.zeros((eng.n_embd,) if pooled else
                                                                                (0, eng.n_embd), np.float32))
    sys.stdout.buffer.write(formatted(rows, texts, pooled, output_format, normalization))
    sys.stdout.flush()


@app.command("tokenize")
@model_source()
@log_options
def tokenize_command(
    model: Path,
    prompt: Optional[str] = typer.Option(None, "-p", "--prompt", help="the text"),
    file: Optional[Path] = typer.Option(None, "-f", "--file", help="read the text from a file (all of it)"),
    stdin: bool = typer.Option(False, "--stdin", help="read the text from stdin (over -f and -p)"),
    ids: bool = typer.Option(False, "--ids", help="only the token ids, as a list: [1, 2, 3]"),
    no_bos: bool = typer.Option(False, "--no-bos", help="no BOS, even where the model puts one first"),
    no_parse_special: bool = typer.Option(False, "--no-parse-special", help="special-token text (<|im_start|>) as "
                                          "plain text"),
    show_count: bool = typer.Option(False, "--show-count", help="then the number of tokens"),
    escape: bool = escape_option("-p, -f and --stdin"),
    override_kv: Optional[str] = typer.Option(None, "--override-kv", help="the model's metadata replaced, "
                                              "KEY=TYPE:VALUE[,...] as llama.cpp's"),
    verbose: bool = None,
) -> None:
    """The tokens of a text, as llama.cpp's llama-tokenize prints them (the vocabulary alone is
    loaded): each id and its text, or with --ids the list of ids."""
    from pyedgemoe import _native
    from pyedgemoe.vocabulary import VocabularyFile

    _native.set_verbose(verbose)

    if not (stdin or file is not None or prompt is not None):
        fail("give the text with -p TEXT, -f FILE or --stdin")
    try:
        raw = sys.stdin.buffer.read() if stdin else file.read_bytes() if file is not None else utf8(prompt)
    except OSError as e:
        fail(f"cannot read {'stdin' if stdin else file if file is not None else 'the text'}: {e.strerror or e}")
    text = text_of(raw, escape)
    with command_errors():
        vocab = VocabularyFile(model, override_kv)
        tokens = vocab.tokenize(text, add_bos=not no_bos, special=not no_parse_special)
        out = sys.stdout.buffer
        if ids:
            out.write(f"[{', '.join(map(str, tokens))}]\n".encode())
        for token in [] if ids else tokens:  # llama-tokenize's lines: the piece's bytes as they are
            out.write(f"{token:6d} -> '".encode() + vocab.token_piece(token, special=True) + b"'\n")
        if show_count:
            out.write(f"Total number of tokens: {len(tokens)}\n".encode())
        out.flush()


@app.command("calibrate")
@model_source("GGUF model file (multi-precision, or standard with --low-from)")
@model_options(without=("expert_cache", "batch_size", "ubatch_size"))
def calibrate_command(
    model: Path,
    file: Path = typer.Option(..., "-f", "--file", help="the text to run (representative of the workload)"),
    budget: str = typer.Option("25%", "--budget", help="the expert cache to calibrate for: 300MiB, 4GiB, 25%"),
    target_split: Optional[str] = typer.Option(
        None, "--target-split", help="shares of selections high,low,skip the thresholds aim at (default: "
        "HOBBIT's 0.67,0.30,0.03 at top-2; at top-k the top-1 plus 34/60/6% of the others)"),
    trace: Optional[Path] = typer.Option(None, "--trace", help="where the routing trace goes "
                                         "(default: MODEL.routing-trace.npz)"),
    ctx: int = typer.Option(512, "-c", "--ctx", "--ctx-size", help="tokens per sequence"),
    max_tokens: int = typer.Option(2048, "--max-tokens", help="use at most this many tokens of the text"),
    grid_step: float = typer.Option(0.1, "--grid-step", help="step of the policy-weight grid over the simplex"),
    loss_budget: str = typer.Option("1%", "--loss-budget", help="--system edgemoe and mobile: the perplexity "
                                    "increase over the whole model that the static precision map (edgemoe) or "
                                    "gamma (mobile) may cost"),
    min_agreement: str = typer.Option("97%", "--min-agreement", help="--system edgemoe and mobile: the share of "
                                      "the calibration tokens whose top-1 the map (edgemoe, besides the loss "
                                      "budget) or gamma (mobile) must leave as the whole model's"),
    size_budget: Optional[str] = typer.Option(None, "--size-budget", help="--system edgemoe: instead, the share of "
                                              "the all-HIGH expert bytes the map brings the experts to (e.g. 70%)"),
    stand_ins: bool = typer.Option(False, "--stand-ins", help="also the stand-ins that run's --stand-in routes by: "
                                   "each expert's output against every other's and none on the text's layer inputs"),
    as_json: bool = typer.Option(False, "--json", help="print the calibration as one JSON object"),
    force: bool = typer.Option(False, "--force", help="replace the model's sidecar if it exists (EdgeMoE's precision "
                               "map, MoBiLE's gamma and the stand-ins in it are kept unless --system edgemoe, --system "
                               "mobile or --stand-ins compute them again)"),
    engine_options: dict = None,
) -> None:
    """Choose T1/T2 and the cache policy's weights for a budget from the routing of a text, into a
    sidecar next to the model that `run` picks up (docs/mixed-precision.md); EdgeMoE's path
    statistics too, with --system edgemoe its static precision map and with --system mobile MoBiLE's gamma
    (docs/systems.md)."""
    from pyedgemoe.calibration.run import calibrate

    try:
        text = read_text_file(file, escape=False)
    except OSError as e:
        fail(f"cannot read text file: {e}")
    with command_errors():
        system = engine_options.pop("system")
        result = calibrate(model, text, budget=budget, split=target_split, n_ctx=ctx, max_tokens=max_tokens,
                           trace=trace, grid_step=grid_step, text_name=str(file), system=system,
                           loss_budget=parse_share(loss_budget, "--loss-budget"),
                           min_agreement=parse_share(min_agreement, "--min-agreement"),
                           size_budget=None if size_budget is None else parse_share(size_budget, "--size-budget"),
                           force=force, stand_ins=stand_ins, **engine_options)
    for note in result.notes:
        typer.echo(f"note: {note}", err=True)
    if as_json:
        typer.echo(json.dumps(result.to_dict()))
        return
    d = result.data
    target, achieved = d["target_split"], d["achieved_split"]
    share = lambda s: "/".join(f"{s[p]:.1%}" for p in ("high", "low", "skip"))  # noqa: E731
    typer.echo(f"calibrated on {file.name}: {d['n_tokens']} tokens in {d['n_sequences']} sequences of up to "
               f"{d['n_ctx']}, top-{d['n_experts_used']} routing")
    typer.echo(f"thresholds: t1 {d['t1']:.4f}, t2 {d['t2']:.4f}: selections {share(achieved)} HIGH/LOW/SKIP "
               f"(target {share(target)})")
    typer.echo(f"replay at {d['budget']} ({d['high_slots']} HIGH + {d['low_slots']} LOW slots; a LOW load costs "
               f"{d['low_cost']:.3f} of a HIGH one), miss penalty per policy:")
    for name, r in d["penalties"].items():
        label = name + (" " + ",".join(f"{w:g}" for w in r["weights"]) if r["weights"] else "")
        failures = f", {r['failures']} failures" if r["failures"] else ""
        typer.echo(f"  {label:<24} {r['penalty']:10.1f}  ({r['loads_high']} HIGH + {r['loads_low']} LOW loads, "
                   f"hit rate {r['hit_rate']:.1%}{failures})")
    against = d["lossless_against_min"]
    typer.echo(f"lossless ({against['slots']} HIGH slots), loads against Belady's MIN, the offline optimum "
               f"({against['min']['loads']} of {against['min']['requests']}): "
               + ", ".join(f"{p} {r['x_min']:.2f}x" for p, r in sorted(against["policies"].items(),
                                                                   key=lambda pr: pr[1]["x_min"]))
               + f"; lossless runs use {d['best_lossless_policy']}, runs with LOW copies {d['best_policy']}")
    chosen = d["best_lossless_policy"]
    typer.echo("  loads per MoE layer: MIN " + " ".join(map(str, against["min"]["loads_per_layer"].values()))
               + f"; {chosen} " + " ".join(map(str, against["policies"][chosen]["loads_per_layer"].values())))
    if "prediction" in d and d["prediction"]["top1_accuracy"] is not None:
        typer.echo(f"next-layer prediction: top-1 right {d['prediction']['top1_accuracy']:.1%}, "
                   f"{d['prediction']['recall']:.1%} of selections predicted")
    typer.echo(f"EdgeMoE path statistics: top-{d['n_experts_used']} of the next layer predicted "
               f"{d['path_accuracy']:.1%} right on this text")
    if system == "edgemoe":  # computed here (a map kept from the sidecar replaced has its note)
        m = d["precision_map"]
        budget_text = (f"loss budget +{m['loss_budget']:.1%}, top-1 agreement {m['min_agreement']:.0%} at least"
                       if m["size_budget"] is None else f"size budget {m['size_budget']:.0%}")
        typer.echo(f"EdgeMoE precision map ({budget_text}): {m['n_low']} of {m['n_experts']} experts LOW, "
                   f"decode-mode perplexity {m['ppl']:.4f} vs {m['baseline_ppl']:.4f} all HIGH, "
                   f"top-1 agreement {m['agreement']:.1%}")
    if system == "mobile":
        g = d["big_little"]
        typer.echo(f"MoBiLE gamma {g['gamma']:.4g} (loss budget +{g['loss_budget']:.1%}, top-1 agreement "
                   f"{g['min_agreement']:.0%} at least): "
                   f"{g['fallback_rate']:.1%} of tokens redone big, top-1 agreement {g['agreement']:.1%} "
                   f"({g['little_agreement']:.1%} with the little pass alone)")
    if stand_ins:
        typer.echo(f"stand-ins: each expert's output against every other's on {d['stand_ins']['records']} layer "
                   "inputs; run --stand-in q swaps (or drops) within each layer's q-quantile of this text's swap costs")
    typer.echo(f"wrote {result.sidecar} (run picks it up) and the trace {result.trace}")


@app.command("rpc-server")
def rpc_server(
    host: str = typer.Option("127.0.0.1", "-H", "--host", help="address to listen on (0.0.0.0: every interface; the "
                             "protocol has no authentication: only on a network you trust)"),
    port: int = typer.Option(50052, "-p", "--port", help="TCP port"),
    threads: Optional[int] = typer.Option(None, "-t", "--threads", help="threads of the CPU backend it serves "
                                          "(default: the physical cores this process may use)"),
    cache: Optional[Path] = typer.Option(None, "--cache", help="a folder where it keeps the tensors clients send, "
                                         "so a second load sends only their hashes"),
    default_cache: bool = typer.Option(False, "-c", help="--cache in llama.cpp's folder for it, $LLAMA_CACHE/rpc "
                                       "(else ~/.cache/llama.cpp/rpc): llama.cpp's rpc-server -c"),
) -> None:
    """Serve this machine's CPU to other machines' pyedgemoe or llama.cpp (`--rpc HOST:PORT`): llama.cpp's
    rpc-server (docs/distributed.md). Runs until stopped (Ctrl-C)."""
    from pyedgemoe import _native, rpc
    from pyedgemoe.threads import default_threads

    if not 0 < port < 65536:
        fail(f"--port must be in 1..65535, got {port}")
    if threads is not None and threads < 1:
        fail(f"--threads must be >= 1, got {threads}")
    if default_cache and cache is None:
        from pyedgemoe.url_model import cache_directory
        cache = cache_directory() / "rpc"
    if cache is not None:
        cache.mkdir(parents=True, exist_ok=True)
    try:
        address = rpc.ipv4_address(host)
        if not address.startswith("127."):
            typer.echo(f"warning: the RPC protocol has no authentication: anyone who reaches {host}:{port} can use "
                       "this machine's memory and CPU, and end the worker with a malformed request", err=True)
        # ggml's log, as stock rpc-server prints it: why a client was dropped (its protocol version, ...)
        _native.set_verbose(True)
        rpc.serve(address, port, threads or default_threads().n, str(cache or ""))
    except (PyEdgeMoEError, RuntimeError) as e:
        fail(str(e))


@app.command()
@model_source()
def inspect(
    model: Path,
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """Architecture, experts, bytes of expert and non-expert tensors, tensor types."""
    from pyedgemoe.model_info import read_model_info

    try:
        info = read_model_info(model)
    except PyEdgeMoEError as e:
        fail(str(e))
    if as_json:
        typer.echo(json.dumps(info.to_dict(), indent=2))
        return
    lines = [
        f"file            {info.path} ({format_bytes(info.file_bytes)}"
        + (f" in {len(info.files)} shards)" if len(info.files) > 1 else ")"),
        # the file's strings, quoted where a control character would break the layout or the terminal
        f"architecture    {_printable(info.architecture)}" + (f" ({_printable(info.name)})" if info.name else ""),
        f"layers          {info.n_layers}",
    ]
    two_copies = info.multi_precision and info.is_moe
    if info.is_moe:
        lines += [
            f"experts         {info.n_experts} per layer, {info.n_experts_used} used per token, "
            f"{info.n_experts_shared} shared",
            f"expert bytes    {format_bytes(info.expert_bytes)} in {len(info.expert_bytes_per_layer)} layers"
            + (" (HIGH + LOW copies)" if two_copies else ""),
        ]
        if two_copies:
            lines += [
                f"  HIGH {info.high_type or '?':<6}   {format_bytes(info.high_expert_bytes)}",
                f"  LOW  {info.low_type or '?':<6}   {format_bytes(info.low_expert_bytes)}",
            ]
        for layer, n in sorted(info.expert_bytes_per_layer.items()):
            if two_copies:
                lines.append(f"  layer {layer:3d}     {format_bytes(n)}  = HIGH "
                             f"{format_bytes(info.high_expert_bytes_per_layer.get(layer, 0))} + LOW "
                             f"{format_bytes(info.low_expert_bytes_per_layer.get(layer, 0))}")
            else:
                lines.append(f"  layer {layer:3d}     {format_bytes(n)}")
    else:
        lines.append("experts         none (dense model)")
    lines.append(f"non-expert      {format_bytes(info.non_expert_bytes)}")
    lines.append("tensor types    " + ", ".join(
        f"{t} {format_bytes(n)}" for t, n in sorted(info.tensor_types.items(), key=lambda kv: -kv[1])))
    if info.multi_precision:
        lines.append(f"multi-precision yes (format {info.format_version}): HIGH {info.high_type}, "
                     f"LOW {info.low_type}")
        if info.is_moe:
            lines.append(f"  as HIGH only  {format_bytes(info.non_expert_bytes + info.high_expert_bytes)}, "
                         f"as LOW only {format_bytes(info.non_expert_bytes + info.low_expert_bytes)} "
                         f"(tensor bytes of `pyedgemoe export --precision high|low`)")
    else:
        lines.append("multi-precision no")
    typer.echo("\n".join(lines))


def _printable(text: str) -> str:
    return text if text.isprintable() else ascii(text)


@app.command("convert")
def convert_command(
    src: str = typer.Argument(..., metavar="SRC", help="HF model directory, HF repo id, or a standard llama.cpp GGUF"),
    out: str = typer.Option(..., "-o", "--out", help="the multi-precision GGUF to write"),
    high: str = typer.Option(DEFAULT_HIGH, "--high",
                             help="type of the HIGH expert copies (f32 f16 bf16 q8_0 q6_K q5_K q4_K)"),
    low: Optional[str] = typer.Option(None, "--low", show_default=False,
                                      help=f"type of the LOW expert copies (q4_0 q4_K q3_K q2_K ...; default "
                                      f"{DEFAULT_LOW}, or --low-from's)"),
    base: Optional[str] = typer.Option(None, "--base",
                                       help="type of non-expert matrices (default: as llama.cpp's --outtype auto, "
                                       "bf16 for a BF16 checkpoint, else f16; a GGUF's own)"),
    low_from: Optional[Path] = typer.Option(None, "--low-from", help="take LOW experts from this lower quant GGUF"),
    force: bool = typer.Option(False, "--force", help="overwrite OUT if it exists"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the plan, write nothing"),
    threads: Optional[int] = typer.Option(None, "-t", "--threads", help="quantization threads"),
    calibration: Optional[Path] = typer.Option(None, "--calibration",
                                               help="embed this sidecar of `pyedgemoe calibrate`"),
    name: Optional[str] = typer.Option(None, "--name", help="the model's name (general.name; default: the "
                                       "checkpoint's model card or config, else OUT's file name)"),
) -> None:
    """Convert a checkpoint or GGUF into a multi-precision GGUF (every expert in HIGH and LOW)."""
    from pyedgemoe.convert import convert

    with command_errors():
        result = convert(src, out, high=high, low=low, base=base, low_from=low_from, force=force,
                         dry_run=dry_run, progress=True, n_threads=threads, calibration=calibration, name=name)
    typer.echo(str(result) if dry_run else f"wrote {result}")


@app.command("export")
@model_source("multi-precision (or standard) GGUF")
def export_command(
    model: Path,
    out: str = typer.Option(..., "-o", "--out", help="the standard llama.cpp GGUF to write"),
    precision: str = typer.Option("high", "--precision", help="high or low: which expert copies to keep"),
    force: bool = typer.Option(False, "--force", help="overwrite OUT if it exists"),
) -> None:
    """Write a standard llama.cpp GGUF of one precision (loads in stock llama.cpp)."""
    from pyedgemoe.convert.export import PRECISIONS, export

    if precision not in PRECISIONS:
        fail(f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    with command_errors():
        result = export(model, out, precision=precision, force=force, progress=True)
    typer.echo(f"wrote {result}")


@app.command()
@model_source()
@model_options(without=("flash_attn", "batch_size", "ubatch_size", "cache_type_k", "cache_type_v", "no_warmup"))
def bench(
    model: Path,
    prompt_tokens: list[str] = typer.Option(["16"], "--prompt-tokens", "-p", "--n-prompt",
                                            help="repeatable or comma-separated: 16,128 is HOBBIT's grid (llama-bench's -p)"),
    output_tokens: list[str] = typer.Option(["32"], "--output-tokens", "-n", "--n-gen",
                                            help="repeatable or comma-separated: 32,128 is HOBBIT's grid (llama-bench's -n)"),
    repeats: int = typer.Option(3, "--repeats", "-r", "--repetitions",
                                help="runs per engine and cell; medians are reported"),
    warmup: int = typer.Option(1, "--warmup", help="runs of the first engine before each cell's, not kept"),
    no_warmup: bool = typer.Option(False, "--no-warmup", help="no warm-up runs (--warmup 0), as llama-bench's"),
    load: int = typer.Option(0, "--load", min=0, help="CPU-bound processes running beside every measurement "
                                                      "(a busy machine: one per core)"),
    vs_llama_cpp: bool = typer.Option(True, "--vs-llama-cpp/--ours-only",
                                      help="also run stock llama.cpp (llama-cpp-python) on the same file"),
    engines: Optional[list[str]] = typer.Option(None, "--engines",
                                                help="repeatable: pyedgemoe, llama_cpp (overrides --ours-only)"),
    mem_cap: Optional[str] = typer.Option(None, "--mem-cap",
                                          help="cgroup memory cap for each run: 4GiB, or 25% of the file"),
    flash_attn: bool = typer.Option(False, "--flash-attn", help="flash attention on in both engines (default off)"),
    ours_option: list[str] = typer.Option([], "--ours-option", metavar="KEY=VALUE",
                                          help="repeatable: another keyword argument for pyedgemoe.Engine, "
                                               "e.g. n_batch=256 (the expert options have flags of their own)"),
    decode_input: str = typer.Option("greedy", "--decode-input",
                                     help="greedy, or fixed: a non-repeating token sequence (realistic routing "
                                          "on random-weight models)"),
    stock_no_repack: bool = typer.Option(False, "--stock-no-repack",
                                         help="stock llama.cpp as with --no-repack (no repacked copy of "
                                              "Q4_K/Q4_0 weights in anonymous memory)"),
    json_path: Optional[Path] = typer.Option(None, "--json", help="also write every measurement here"),
    against_min: bool = typer.Option(False, "--against-min", help="one more run of ours per cell, not timed (no "
                                     "fill at load, lossless whatever the options: every expert in HIGH, the "
                                     "router's own choice): its expert loads beside Belady's MIN on the "
                                     "routing it recorded"),
    engine_options: dict = None,
) -> None:
    """Prefill and decode speed of pyedgemoe vs stock llama.cpp, each run in its own process
    (--threads for both; --threads-batch, --expert-cache and the expert options for pyedgemoe).
    A run that fails is a row of the report, and the exit status is then 1."""
    from pyedgemoe.bench.runner import cli_main
    from pyedgemoe.bench.worker import parse_option

    try:
        ours_options = dict(parse_option(o) for o in ours_option)
    except ValueError as e:
        fail(str(e))
    # the flags go on top of --ours-option, as the worker's KEY=VALUE text
    expert_options = engine_options["expert_options"]
    for name in expert_options.given:
        value = expert_options[name]
        ours_options[name] = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else value
    if engine_options["expert_cache"] != "auto":
        ours_options["expert_cache"] = engine_options["expert_cache"]
    if engine_options["system"] is not None:
        ours_options["system"] = engine_options["system"]
    for name in ("verbose", "n_threads_batch"):
        if engine_options[name]:
            ours_options[name] = engine_options[name]
    threads = engine_options["n_threads"]
    try:
        cli_main(model, prompt_tokens=_int_list(prompt_tokens, "--prompt-tokens"),
                 output_tokens=_int_list(output_tokens, "--output-tokens"), repeats=repeats,
                 threads=threads, vs_llama_cpp=vs_llama_cpp, engines=engines, mem_cap=mem_cap,
                 flash_attn=flash_attn, ours_options=ours_options, json_path=json_path,
                 decode_input=decode_input, stock_repack=not stock_no_repack, warmup=0 if no_warmup else warmup,
                 load=load, against_min=against_min)
    except PyEdgeMoEError as e:
        fail(str(e))


def _int_list(values: list[str], flag: str) -> list[int]:
    """llama-bench's lists: a flag given several times, or values comma-separated (-p 16,128); a value
    given twice is one cell (its runs are the cell's repeats)."""
    try:
        return list(dict.fromkeys(int(v) for value in values for v in value.split(",")))
    except ValueError:
        fail(f"{flag} takes integers, several comma-separated or the flag repeated, got {' '.join(values)!r}")


def main() -> None:
    """Entry point: like app(), but a usage error (unknown flag, a value of the wrong type)
    is also one `error: ...` line (exit status 2) instead of click's usage block; llama.cpp's
    environment variables are read (pyedgemoe.llama_env), its flags a command does not take said as
    such (pyedgemoe.llama_flags)."""
    command = typer.main.get_command(app)
    read_llama_cpp_variables(command)
    if sys.stdin is None:  # closed (<&-): read as empty, as llama.cpp's tools read it
        sys.stdin = open(os.devnull)
    if sys.stdout is None:  # closed (>&-): what a command writes cannot go anywhere
        typer.echo("error: the standard output is closed", err=True)
        sys.exit(1)
    try:
        # Without standalone mode, click returns typer.Exit's code instead of exiting.
        status = command.main(screened(command, sys.argv[1:]), standalone_mode=False,
                              prog_name="pyedgemoe")  # also as python -m pyedgemoe
        sys.exit(status if isinstance(status, int) else 0)
    except NoArgsIsHelpError as e:
        typer.echo(e.format_message())
        sys.exit(2)
    except UsageError as e:
        typer.echo(f"error: {e.format_message()}", err=True)
        sys.exit(2)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        sys.exit(130)
    except PyEdgeMoEError as e:  # a command that did not catch its own: still one line
        typer.echo(f"error: {e}", err=True)
        sys.exit(1)
    except OSError as e:  # the output could not be written (a full disk: > /dev/full), ...
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # what it holds goes nowhere at exit
        typer.echo(f"error: {e.strerror or e}{f': {e.filename}' if e.filename else ''}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()

"""llama.cpp's flags that a pyedgemoe command does not take, said as what they are.

A command line copied from llama.cpp's guides may carry flags of llama.cpp's tools that a command
here has no counterpart for; click would misread some (`-sm none` as `-s m`, `-nkvo` as `-n kvo`) or
say only "No such option". Every flag of llama.cpp's tools is in llama_cpp_flags.json (its names and
whether it takes a value, from the vendored common/arg.cpp: scripts/llama_cpp_flags.py), so each such
flag is one line: NOTED ones, whose work pyedgemoe does its own way or which change nothing here, are
taken with a note (their value too); any other is refused by name. Another of llama.cpp's names of a
flag the command has (`--temperature` for `--temp`) is that flag."""
from __future__ import annotations

import json
from importlib import resources

import typer
from typer._click.exceptions import UsageError  # typer's own click, whose errors the CLI's main() catches

_THREADS = "threads follow the cores the machine leaves free (-t, the thread governor)"
_FIT = "the load plan fits the model to the memory there is (run --dry-run shows it)"
# a flag of llama.cpp's tools -> the note it is taken with (its other names: llama_cpp_flags.json)
NOTED = {
    "--numa": _THREADS, "--poll": _THREADS, "--cpu-mask": _THREADS, "--cpu-range": _THREADS,
    "--cpu-strict": _THREADS, "--cpu-mask-batch": _THREADS, "--cpu-range-batch": _THREADS,
    "--cpu-strict-batch": _THREADS, "--poll-batch": _THREADS, "--prio-batch": _THREADS,
    "--fit": _FIT, "--fit-target": _FIT, "--fit-ctx": _FIT, "--fit-print": _FIT,
    "--no-kv-offload": "the KV cache is where the load plan puts it (--mode)",
    "--kv-offload": "the KV cache is where the load plan puts it (--mode)",
    "--no-op-offload": "no op is offloaded to a GPU beside an expert cache",
    "--cache-ram": "a prompt's state stays in its sequence's KV cache; no other copy is kept",
    "--no-perf": "the timings are pyedgemoe's own",
}


# llama.cpp's flags of a value on|off|auto (is_truthy, is_falsey, is_autoy) where the command's own is
# a switch (-> its negative): the value folded into it (auto: the switch's default, left out)
SWITCHES = {"-co": "--no-color", "--color": "--no-color"}
_VALUES = {**dict.fromkeys(("on", "enabled", "true", "1"), True),
           **dict.fromkeys(("off", "disabled", "false", "0"), False), **dict.fromkeys(("auto", "-1"), None)}


# llama-bench's flags (tools/llama-bench, a parser of its own: `pyedgemoe bench`'s), each a value (a
# list, comma-separated) but BENCH_BARE's; BENCH_SWITCHES: those of 0/1 (on|off|auto) whose counterpart
# here is a switch, its flags for on and off
BENCH_FLAGS = (
    ("-h", "--help"), ("--version",), ("-m", "--model"), ("-hf", "-hfr", "--hf-repo"), ("-hff", "--hf-file"),
    ("-hft", "--hf-token"), ("--offline",), ("-p", "--n-prompt"), ("-n", "--n-gen"), ("-pg",), ("-d", "--n-depth"),
    ("-b", "--batch-size"), ("-ub", "--ubatch-size"), ("-ctk", "--cache-type-k"), ("-ctv", "--cache-type-v"),
    ("-dev", "--device"), ("--list-devices",), ("-t", "--threads"), ("-C", "--cpu-mask"), ("--cpu-strict",),
    ("--poll",), ("-ngl", "--n-gpu-layers"), ("-ncmoe", "--n-cpu-moe"), ("-rpc", "--rpc"), ("-sm", "--split-mode"),
    ("-lm", "--load-mode"), ("-lzm", "--lazy-mode"), ("-mg", "--main-gpu"), ("-nkvo", "--no-kv-offload"), ("--numa",),
    ("-fa", "--flash-attn"), ("-embd", "--embeddings"), ("-nopo", "--no-op-offload"), ("--no-host",), ("--repack",),
    ("-ts", "--tensor-split"), ("-ot", "--override-tensor"), ("-r", "--repetitions"), ("--prio",), ("--delay",),
    ("-o", "--output"), ("-oe", "--output-err"), ("-v", "--verbose"), ("--progress",), ("--no-warmup",),
    ("-fitt", "--fit-target"), ("-fitc", "--fit-ctx"),
)
BENCH_BARE = ("--help", "--version", "--offline", "--list-devices", "--verbose", "--progress", "--no-warmup")
BENCH_SWITCHES = {"--flash-attn": ("--flash-attn", None), "--repack": ("--repack", "--no-repack")}


def _load() -> dict[str, dict]:
    with resources.files("pyedgemoe").joinpath("llama_cpp_flags.json").open() as f:
        flags = json.load(f)
    # a flag's names: those of its sense (a negatable one's two senses apart)
    return {name: {"names": names, "value": flag["value"]}
            for flag in flags for names in (flag["names"], flag["negated"]) for name in names}


FLAGS = _load()


def screened(command, args: list[str]) -> list[str]:
    """args of the CLI's typer group without the NOTED llama.cpp flags (and their values) the
    subcommand does not take, each said in a note on stderr; UsageError naming any other llama.cpp
    flag it does not take."""
    name = next((a for a in args if not a.startswith("-")), None)
    sub = command.commands.get(name) if name else None
    if sub is None:
        return args
    # the command's options (an argument's name is no flag) and its help -> whether each takes a value
    ours = {opt: not (p.is_flag or p.count) for p in sub.params
            for opt in (*getattr(p, "opts", ()), *getattr(p, "secondary_opts", ())) if opt.startswith("-")}
    ours.update(dict.fromkeys((command.context_settings or {}).get("help_option_names", ("--help",)), False))
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        flag = arg.split("=", 1)[0]
        if arg == "--":
            return out + args[i:]
        value = arg.split("=", 1)[1] if "=" in arg else args[i + 1] if i + 1 < len(args) else None
        bench_names = next((names for names in BENCH_FLAGS if flag in names), None) if name == "bench" else None
        if bench_names is not None:
            taken, used = _bench_flag(flag, arg, value, bench_names, ours)
            out += taken
            i += used
            continue
        if flag in SWITCHES and flag in ours and value is not None and value.lower() in _VALUES:
            on = _VALUES[value.lower()]
            out += [] if on is None else [flag if on else SWITCHES[flag]]
            i += 1 if "=" in arg else 2
            continue
        if flag in ours:  # one of the command's own: its value goes with it
            takes = ours[flag] and "=" not in arg
            out += args[i:i + 1 + takes]
            i += 1 + takes
            continue
        known = FLAGS.get(flag)
        if known is None or not arg.startswith("-"):
            out.append(arg)
            i += 1
            continue
        long = max(known["names"], key=len)
        spelled = next((n for n in known["names"] if n in ours), None)  # the command's own name of it
        note = next((NOTED[n] for n in known["names"] if n in NOTED), None)
        if spelled is not None:  # another of llama.cpp's names of a flag the command has
            args = [*args[:i], spelled + arg[len(flag):], *args[i + 1:]]
            continue
        if note is None:
            raise UsageError(f"{flag} is llama.cpp's{f' {long}' if long != flag else ''}, which `pyedgemoe {name}` "
                             f"does not take (`pyedgemoe {name} --help` lists its flags)")
        value = f" {args[i + 1]}" if known["value"] and "=" not in arg and i + 1 < len(args) else ""
        typer.echo(f"note: {arg}{value}: llama.cpp's; {note}: not used", err=True)
        i += 1 + (known["value"] and "=" not in arg)
    return out


def _bench_flag(flag: str, arg: str, value: str | None, names: tuple[str, ...], ours: dict) -> tuple[list[str], int]:
    """A llama-bench flag (arg, then value, the next argument) as `bench` takes it: its own flag, a
    0/1 folded into a switch, a NOTED one said in a note; (the arguments, how many were read)."""
    long = names[-1]
    valued = long not in BENCH_BARE and "=" not in arg
    used = 1 + (valued and value is not None)
    value = arg.split("=", 1)[1] if "=" in arg else value if valued else None
    if long in BENCH_SWITCHES:
        if value is None or value.lower() not in _VALUES:
            raise UsageError(f"{flag} takes one of on, off, auto (1, 0): `pyedgemoe bench` measures one setting of "
                             f"it, got {value!r}")
        on = _VALUES[value.lower()]
        switch = BENCH_SWITCHES[long][0 if on else 1] if on is not None else None
        return [switch] if switch else [], used
    spelled = next((n for n in names if n in ours), None)  # the command's own name of it
    if spelled is not None:
        return [spelled, *([value] if ours[spelled] and value is not None else [])], used
    note = next((NOTED[n] for n in names if n in NOTED), None)
    if note is None:
        raise UsageError(f"{flag} is llama-bench's{f' {long}' if long != flag else ''}, which `pyedgemoe bench` does "
                         "not take (`pyedgemoe bench --help` lists its flags)")
    typer.echo(f"note: {arg}{f' {value}' if valued and value is not None else ''}: llama-bench's; {note}: not used",
               err=True)
    return [], used


"""The options of every CLI command that loads a model, declared once: `-t/--threads`,
`-tb/--threads-batch`, `-ngl`,
`--expert-cache`, `--device`, `--host-cache`, `--system`, `--repack/--no-repack`, one flag per
expert option (`--io-threads`, `--prefetch`, ...: the names of pyedgemoe.expert_options.OPTION_NAMES
with dashes, their help and defaults from the native schema) and `--verbose`. A command decorated with @model_options receives them as `engine_options`, a dict
of Engine keyword arguments; a bad value is one `error:` line."""
from __future__ import annotations

import functools
import inspect
from typing import Optional, get_type_hints

import typer

from pyedgemoe.errors import PyEdgeMoEError
from pyedgemoe.expert_options import AUTOMATIC, OPTION_NAMES, ExpertOptions, choices, default, help_text

# (parameter, annotation, typer option, Engine keyword) of the options besides the expert ones
_ENGINE_OPTIONS = (
    ("threads", Optional[int], typer.Option(None, "-t", "--threads",
                                            help="threads of the decode (default: the physical cores this process "
                                                 "may use, within its cgroup's CPU quota; the decode leaves one to "
                                                 "the expert reads when prefetch is chosen automatically)"), "n_threads"),
    ("threads_batch", Optional[int], typer.Option(None, "-tb", "--threads-batch",
                                                  help="threads of the prompt's batches (default: --threads, or its "
                                                       "default)"), "n_threads_batch"),
    ("gpu_layers", Optional[int], typer.Option(None, "-ngl", "--n-gpu-layers",
                                               help="llama.cpp's habit: 0 is --mode cpu, any other count --mode gpu "
                                                    "(every layer goes to the GPU)"), None),
    ("expert_cache", str, typer.Option("auto", "--expert-cache",
                                       help="memory for experts: 300MiB, 4GiB, 50% (of expert bytes), auto, "
                                            "or mmap (no cache: the page cache holds the mapped experts, as in "
                                            "llama.cpp --no-repack); a size that does not fit is refused, a "
                                            "trailing ~ (60%~, 4GiB~) takes what fits if less"),
     "expert_cache"),
    ("device", Optional[str], typer.Option(None, "--device",
                                           help="the GPU by ggml's name, e.g. Vulkan0, CUDA0 (default: the first)"),
     "device"),
    ("host_cache", str, typer.Option("auto", "--host-cache",
                                     help="with a GPU: pinned RAM for experts between the file and the GPU: "
                                          "8GiB, 50% (of expert bytes), 0 or auto"),
     "host_cache"),
    ("system", Optional[str], typer.Option(None, "--system",
                                           help="a seed system's preset of the expert options: lossless, hobbit, "
                                                "edgemoe, fate or mobile (docs/systems.md); options given win"),
     "system"),
    ("repack", Optional[bool], typer.Option(None, "--repack/--no-repack",
                                            help="repacked copies of the weights, as llama.cpp makes them (default: "
                                                 "off where experts stream through an expert cache or stay mapped, "
                                                 "or where the copies would not fit beside the mapped experts)"),
     "repack"),
    ("verbose", bool, typer.Option(False, "--verbose", help="show llama.cpp's log, and the thread counts and why"),
     "verbose"),
)


def _expert_option(name: str) -> tuple[object, object]:
    """(annotation, typer option) of one expert option: unset (None) unless given."""
    value = default(name)
    shown = AUTOMATIC.get(name) or (",".join(f"{w:g}" for w in value) if name == "policy_weights" else value)
    help = f"{help_text(name)} (default: {shown})"
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return Optional[bool], typer.Option(None, f"{flag}/--no-{flag[2:]}", help=help)
    kind = str if choices(name) or isinstance(value, (str, list, tuple)) else type(value)
    return Optional[kind], typer.Option(None, flag, help=help)


def model_options(command=None, *, expert_cache: bool = True):
    """Adds the model-loading options to a typer command, which gets them as `engine_options`
    (expert_cache=False: a command that sizes the cache itself has no --expert-cache)."""
    if command is None:
        return functools.partial(model_options, expert_cache=expert_cache)
    engine = [o for o in _ENGINE_OPTIONS if expert_cache or o[0] != "expert_cache"]
    signature = inspect.signature(command)
    added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation)
             for name, annotation, option, _ in engine]
    added += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation)
              for name, (annotation, option) in ((n, _expert_option(n)) for n in OPTION_NAMES)]

    @functools.wraps(command)
    def with_options(**params):
        engine_options = {keyword: params.pop(name) for name, _, _, keyword in engine if keyword}
        given = {name: params.pop(name) for name in OPTION_NAMES}
        gpu_layers = params.pop("gpu_layers", None)
        if gpu_layers is not None:
            mode = "cpu" if gpu_layers == 0 else "gpu"
            if given["mode"] not in (None, mode):
                typer.echo(f"error: -ngl {gpu_layers} means --mode {mode}, not --mode {given['mode']}", err=True)
                raise typer.Exit(1)
            given["mode"] = mode
        try:
            engine_options["expert_options"] = ExpertOptions(**given)
        except PyEdgeMoEError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(1)
        return command(**params, engine_options=engine_options)

    hints = get_type_hints(command)  # the command's own annotations, resolved where it was written
    kept = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in signature.parameters.values()
            if p.name != "engine_options"]
    with_options.__signature__ = signature.replace(parameters=kept + added)
    with_options.__annotations__ = {p.name: p.annotation for p in kept + added}
    return with_options

"""llama.cpp's environment variables for the flags of its tools that pyedgemoe's commands have
(`LLAMA_ARG_MODEL=model.gguf LLAMA_ARG_CTX_SIZE=8192 pyedgemoe serve`, as a llama-server container
is configured): a flag on the command line wins over its variable, as in llama.cpp. A
boolean one takes llama.cpp's positive sense (LLAMA_ARG_REPACK=0 is --no-repack), "1", "true", "on"
or "0", "false", "off"; LLAMA_ARG_NO_REPACK set, whatever its value, is --no-repack too, as there. A
LLAMA_ARG_ variable that names no option of the command is said in a note.
"""
from __future__ import annotations

import os

import typer
from typer._click.core import ParameterSource  # typer's own click (cli.py's errors are its too)
from typer._click.globals import get_current_context

# the commands that are llama.cpp's tools reading these (llama-cli, llama-server, llama-perplexity,
# llama-embedding, llama-imatrix, llama-tokenize); `bench` takes llama-bench's flags, which read none
COMMANDS = ("run", "serve", "perplexity", "embed", "calibrate", "tokenize")
# a flag of ours -> llama.cpp's variable for it (common/arg.cpp's set_env; tests/test_llama_env.py
# checks this against the vendored arg.cpp, and that no flag of COMMANDS with one is left out)
VARIABLES = {
    "-m": "LLAMA_ARG_MODEL", "-mu": "LLAMA_ARG_MODEL_URL", "-hf": "LLAMA_ARG_HF_REPO", "-hff": "LLAMA_ARG_HF_FILE", "-hft": "HF_TOKEN",
    "--offline": "LLAMA_ARG_OFFLINE",
    "-t": "LLAMA_ARG_THREADS", "-c": "LLAMA_ARG_CTX_SIZE", "-n": "LLAMA_ARG_N_PREDICT", "-b": "LLAMA_ARG_BATCH",
    "-ub": "LLAMA_ARG_UBATCH", "-fa": "LLAMA_ARG_FLASH_ATTN", "-ctk": "LLAMA_ARG_CACHE_TYPE_K",
    "-ctv": "LLAMA_ARG_CACHE_TYPE_V", "-ngl": "LLAMA_ARG_N_GPU_LAYERS", "--device": "LLAMA_ARG_DEVICE",
    "--tensor-split": "LLAMA_ARG_TENSOR_SPLIT", "-ot": "LLAMA_ARG_OVERRIDE_TENSOR", "-cmoe": "LLAMA_ARG_CPU_MOE",
    "-ncmoe": "LLAMA_ARG_N_CPU_MOE", "--repack": "LLAMA_ARG_REPACK", "--rpc": "LLAMA_ARG_RPC",
    "--pooling": "LLAMA_ARG_POOLING", "--rope-scaling": "LLAMA_ARG_ROPE_SCALING_TYPE",
    "--rope-scale": "LLAMA_ARG_ROPE_SCALE", "--rope-freq-base": "LLAMA_ARG_ROPE_FREQ_BASE",
    "--rope-freq-scale": "LLAMA_ARG_ROPE_FREQ_SCALE", "--yarn-orig-ctx": "LLAMA_ARG_YARN_ORIG_CTX",
    "--yarn-ext-factor": "LLAMA_ARG_YARN_EXT_FACTOR", "--yarn-attn-factor": "LLAMA_ARG_YARN_ATTN_FACTOR",
    "--yarn-beta-slow": "LLAMA_ARG_YARN_BETA_SLOW", "--yarn-beta-fast": "LLAMA_ARG_YARN_BETA_FAST",
    "--jinja": "LLAMA_ARG_JINJA", "--chat-template": "LLAMA_ARG_CHAT_TEMPLATE",
    "--chat-template-file": "LLAMA_ARG_CHAT_TEMPLATE_FILE", "--temp": "LLAMA_ARG_TEMPERATURE",
    "--top-k": "LLAMA_ARG_TOP_K", "--top-p": "LLAMA_ARG_TOP_P", "--min-p": "LLAMA_ARG_MIN_P",
    "--repeat-penalty": "LLAMA_ARG_REPEAT_PENALTY", "--presence-penalty": "LLAMA_ARG_PRESENCE_PENALTY",
    "--frequency-penalty": "LLAMA_ARG_FREQUENCY_PENALTY", "--spec-type": "LLAMA_ARG_SPEC_TYPE",
    "--context-shift": "LLAMA_ARG_CONTEXT_SHIFT", "--swa-full": "LLAMA_ARG_SWA_FULL",
    "-ctxcp": "LLAMA_ARG_CTX_CHECKPOINTS",
    "--log-file": "LLAMA_ARG_LOG_FILE", "-lv": "LLAMA_ARG_LOG_VERBOSITY", "--log-colors": "LLAMA_ARG_LOG_COLORS",
    "-kvu": "LLAMA_ARG_KV_UNIFIED", "--prefill-assistant": "LLAMA_ARG_PREFILL_ASSISTANT",
    "--log-prefix": "LLAMA_ARG_LOG_PREFIX", "--log-timestamps": "LLAMA_ARG_LOG_TIMESTAMPS",
    # llama-server's
    "--host": "LLAMA_ARG_HOST", "--port": "LLAMA_ARG_PORT", "--api-key": "LLAMA_API_KEY",
    "--api-key-file": "LLAMA_ARG_API_KEY_FILE", "-np": "LLAMA_ARG_N_PARALLEL", "-a": "LLAMA_ARG_ALIAS",
    "--timeout": "LLAMA_ARG_TIMEOUT", "--embeddings": "LLAMA_ARG_EMBEDDINGS",
    "--reasoning-format": "LLAMA_ARG_THINK", "--chat-template-kwargs": "LLAMA_ARG_CHAT_TEMPLATE_KWARGS",
    "-rea": "LLAMA_ARG_REASONING", "--reasoning-effort": "LLAMA_ARG_REASONING_EFFORT",
    "--reasoning-budget": "LLAMA_ARG_THINK_BUDGET", "--reasoning-budget-message": "LLAMA_ARG_THINK_BUDGET_MESSAGE",
    "-cb": "LLAMA_ARG_CONT_BATCHING", "--webui": "LLAMA_ARG_UI", "--metrics": "LLAMA_ARG_ENDPOINT_METRICS", "--cache-reuse": "LLAMA_ARG_CACHE_REUSE",
}


def read_llama_cpp_variables(command) -> None:
    """Sets llama.cpp's variable on each option of COMMANDS (of command, the CLI's typer group) that has one (besides its own, where
    it has one: PYEDGEMOE_API_KEY), and notes the LLAMA_ARG_ variables a command will not read."""
    for name in COMMANDS:
        sub = command.commands[name]
        read = set()
        for param in sub.params:
            flags = [*getattr(param, "opts", ()), *getattr(param, "secondary_opts", ())]
            variable = next((VARIABLES[f] for f in flags if f in VARIABLES), None)
            if variable is not None and param.param_type_name == "option":
                own = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar or ())
                param.envvar = [*own, variable] if own else variable  # one: its name alone in errors
                read.add(variable)
                if param.secondary_opts:  # a flag with a negative: llama.cpp takes LLAMA_ARG_NO_... set as off
                    negative = variable.replace("LLAMA_ARG_", "LLAMA_ARG_NO_", 1)
                    read.add(negative)
                    if negative in os.environ:
                        os.environ[variable] = "0"
        sub.callback = _noting_unread(sub.callback, name, read)


def _noting_unread(callback, name: str, read: set[str]):
    def run(*args, **kwargs):
        unread = sorted(v for v in os.environ if v.startswith("LLAMA_ARG_") and v not in read)
        if unread:
            typer.echo(f"note: {', '.join(unread)} set, but `pyedgemoe {name}` has no such option: not used",
                       err=True)
        return callback(*args, **kwargs)
    return run


def from_environment(param_name: str) -> bool:
    """Whether the running command's parameter got its value from an environment variable."""
    ctx = get_current_context(silent=True)
    return ctx is not None and ctx.get_parameter_source(param_name) == ParameterSource.ENVIRONMENT

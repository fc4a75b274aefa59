"""RoPE scaling: llama.cpp's context parameters for positions beyond those a model was trained with
(`--rope-scaling`, `--rope-freq-base`, `--rope-freq-scale`, `--yarn-*`; llama-cpp-python's
`rope_scaling_type`, `rope_freq_base`, ...). Checked here, applied by llama.cpp when the context is
made; each left unset is the model's (llama.cpp's llama_context_default_params). They change the
attention's positions only: the experts and their cache are the same with them."""
from __future__ import annotations

import math

from pyedgemoe.errors import InvalidOptionError

# llama.cpp's enum llama_rope_scaling_type by name (-1, unspecified: the model's)
SCALING_TYPES: dict[str, int] = {"none": 0, "linear": 1, "yarn": 2, "longrope": 3}

# the options (their names are the native Context's keywords, but rope_scaling's: rope_scaling_type),
# their type and help; the CLI's flags are their names with dashes, as llama.cpp's
OPTIONS: dict[str, tuple[type, str]] = {
    "rope_scaling": (str, "RoPE frequency scaling: none, linear or yarn (llama.cpp's --rope-scaling)"),
    "rope_freq_base": (float, "RoPE base frequency (llama.cpp's --rope-freq-base)"),
    "rope_freq_scale": (float, "RoPE frequency scale: 0.25 spreads 4x the positions over what the model was "
                               "trained with (llama.cpp's --rope-freq-scale; its --rope-scale N is 1/N)"),
    "yarn_orig_ctx": (int, "YaRN: the context the model was trained with"),
    "yarn_ext_factor": (float, "YaRN: extrapolation mix factor (0: none; negative: 1 with yarn scaling, else 0)"),
    "yarn_attn_factor": (float, "YaRN: the attention's magnitude scale"),
    "yarn_beta_slow": (float, "YaRN: high correction dim or alpha"),
    "yarn_beta_fast": (float, "YaRN: low correction dim or beta"),
}
AUTOMATIC = "the model's"
# llama-cpp-python's Llama arguments of these and their defaults there, each the model's here (the
# pinned llama.cpp reads no YaRN attention factor nor betas from a file: its own are 1, 32 and 1)
LLAMA_CPP_PYTHON_DEFAULTS: dict[str, object] = {
    "rope_scaling_type": -1, "rope_freq_base": 0.0, "rope_freq_scale": 0.0, "yarn_orig_ctx": 0,
    "yarn_ext_factor": -1.0, "yarn_attn_factor": 1.0, "yarn_beta_slow": 1.0, "yarn_beta_fast": 32.0,
}


def checked(name: str, value):
    """An option's value as the native Context takes it, or InvalidOptionError naming it."""
    kind, _ = OPTIONS[name]
    if name == "rope_scaling":
        if value not in SCALING_TYPES:
            raise InvalidOptionError(f"rope_scaling must be one of {', '.join(SCALING_TYPES)}, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise InvalidOptionError(f"{name} must be {'a number' if kind is float else 'an integer'}, got {value!r}")
    if not math.isfinite(value) or (name == "yarn_orig_ctx" and not 0 <= value < 2**31):
        raise InvalidOptionError(f"{name} must be {'finite' if kind is float else 'a context size'}, got {value!r}")
    if name in ("rope_freq_base", "rope_freq_scale") and value < 0:  # 0: the model's, as in llama.cpp
        raise InvalidOptionError(f"{name} must be positive (0: the model's), got {value!r}")
    return kind(value)


def _given(options) -> dict:
    """These options of an ExpertOptions (None where unset), those set."""
    return {name: options[name] for name in OPTIONS if options[name] is not None}


def _keywords(given: dict) -> dict:
    """The options set as keywords of the native Context and of llama-cpp-python's Llama (the same
    names, rope_scaling_type an enum's value)."""
    given = dict(given)
    if "rope_scaling" in given:
        given["rope_scaling_type"] = SCALING_TYPES[given.pop("rope_scaling")]
    return given


def context_keywords(options) -> dict:
    """The native Context's keywords of the options given (an ExpertOptions: None where unset)."""
    return _keywords(_given(options))


def described(options) -> str:
    """The options given, as the flags that give them ("" when none)."""
    given = _given(options)
    return " ".join(f"--{name.replace('_', '-')} {value:g}" if isinstance(value, float) else
                    f"--{name.replace('_', '-')} {value}" for name, value in given.items())


def positions_trained(trained: int, options) -> int:
    """The positions a model trained with `trained` covers with these options: stretched by a
    frequency scale below 1 (from yarn_orig_ctx where given), as llama.cpp takes them for YaRN."""
    scale = options["rope_freq_scale"]
    if not scale or options["rope_scaling"] == "none" or scale >= 1:
        return trained
    return int((options["yarn_orig_ctx"] or trained) / scale)


def from_llama_cpp_python(arguments: dict) -> dict:
    """The options of llama-cpp-python's Llama arguments (LLAMA_CPP_PYTHON_DEFAULTS' names) given
    other than their defaults there; its rope_scaling_type, an enum's value, by name."""
    options = {}
    for name, value in arguments.items():
        if value is None or (value == LLAMA_CPP_PYTHON_DEFAULTS[name] and not isinstance(value, bool)):
            continue
        if name == "rope_scaling_type":
            names = {number: text for text, number in SCALING_TYPES.items()}
            if isinstance(value, bool) or value not in names:
                raise InvalidOptionError(f"rope_scaling_type must be -1 (the model's) or one of llama.cpp's "
                                         f"types {names}, got {value!r}")
            name, value = "rope_scaling", names[value]
        options[name] = value
    return options


def as_llama_cpp_python(options: dict) -> dict:
    """llama-cpp-python's Llama arguments of the options in `options` (by name, as given)."""
    return _keywords({name: value for name, value in options.items() if name in OPTIONS and value is not None})

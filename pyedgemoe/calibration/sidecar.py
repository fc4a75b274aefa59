"""A model's calibration as the Engine and `pyedgemoe convert` see it: the sidecar
`<model>.calibration.json` next to the model, or the copy `pyedgemoe convert --calibration`
embedded as `edgemoe.calibration.*` metadata (docs/format.md). Both hold t1, t2 and
policy_weights (docs/mixed-precision.md, "The sidecar").

Precedence: explicit options > sidecar > embedded metadata > defaults; this module supplies the
middle two (load_calibration). It does not import the Engine, which reads it.
"""
from __future__ import annotations

import json
import math
import os

import gguf

from pyedgemoe.errors import InvalidOptionError
from pyedgemoe.gguf_format import CALIBRATION_KEY_PREFIX
from pyedgemoe.model_info import read_model_info
from pyedgemoe.output_files import write_whole

SIDECAR_SUFFIX = ".calibration.json"
SIDECAR_VERSION = 1
# the embedded copy's keys (docs/format.md)
T1_KEY = CALIBRATION_KEY_PREFIX + "t1"
T2_KEY = CALIBRATION_KEY_PREFIX + "t2"
POLICY_WEIGHTS_KEY = CALIBRATION_KEY_PREFIX + "policy_weights"
JSON_KEY = CALIBRATION_KEY_PREFIX + "json"  # the whole sidecar
QUANTILE_POINTS = 101  # the stand-ins' swap costs' quantiles at 0, 0.01, ..., 1 (stand_ins.py)


def sidecar_path(model_path: str | os.PathLike) -> str:
    return os.fspath(model_path) + SIDECAR_SUFFIX


def read_sidecar(path: str | os.PathLike) -> dict:
    """A calibration sidecar's contents; InvalidOptionError when it cannot be read or is not version 1."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8
        raise InvalidOptionError(f"cannot read the calibration sidecar {path}: {e}") from None
    except RecursionError:
        raise InvalidOptionError(f"cannot read the calibration sidecar {path}: JSON nested too deep") from None
    return _checked(data, f"calibration sidecar {path}")


def _checked(data, what: str) -> dict:
    if not (isinstance(data, dict) and _integer(data.get("version")) and data["version"] == SIDECAR_VERSION):
        raise InvalidOptionError(f"{what} is not version {SIDECAR_VERSION} (run pyedgemoe calibrate again)")
    t1, t2, weights = data.get("t1"), data.get("t2"), data.get("policy_weights")
    if not (_number(t1) and _number(t2) and t1 <= t2 <= 1):
        raise InvalidOptionError(f"{what} has no valid t1 <= t2 in [0, 1] (run pyedgemoe calibrate again)")
    if "policy_weights" in data and not (isinstance(weights, list) and len(weights) == 4
                                         and all(_number(w) for w in weights) and abs(sum(weights) - 1) < 1e-3):
        raise InvalidOptionError(f"{what} has invalid policy_weights (four non-negative numbers of sum 1)")
    if "n_experts_used" in data and not (_integer(data["n_experts_used"]) and 0 < data["n_experts_used"] < 2**31):
        raise InvalidOptionError(f"{what} has an invalid n_experts_used (a positive integer)")
    _check_tables(data, what)
    return data


# The tables the runtime reads from a calibration (pyedgemoe calibrate writes them; docs/mixed-precision.md
# and docs/systems.md): checked for their structure here, so that a damaged one is an error naming it
# rather than a TypeError where it is used. Whether their layers and experts exist in the model is
# the runtime's check (it knows the model).

def _number(x) -> bool:
    """A finite number >= 0 (an integer within 64 bits: JSON's may have any number of digits)."""
    if isinstance(x, int) and not isinstance(x, bool):
        return 0 <= x < 2**63
    return isinstance(x, float) and math.isfinite(x) and x >= 0


def _integer(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _layer(key) -> bool:
    try:
        int(key)
        return True
    except (TypeError, ValueError):
        return False


def _experts(x) -> bool:
    return isinstance(x, list) and all(_integer(e) and 0 <= e < 2**31 for e in x)


def is_low_experts(x) -> bool:
    """An EdgeMoE map's LOW experts: {layer: [expert, ...]} (a layer as an integer or its text)."""
    return isinstance(x, dict) and all(_layer(k) and _experts(v) for k, v in x.items())


def _square(x) -> bool:
    """A non-empty square matrix of numbers >= 0 (lists of lists)."""
    return (isinstance(x, list) and len(x) > 0
            and all(isinstance(row, list) and len(row) == len(x) and all(_number(v) for v in row) for row in x))


def _drop_costs(table: dict) -> bool:
    """A stand-ins layer's drop costs: n_expert numbers >= 0, or none (a sidecar from before them)."""
    drop = table.get("drop_cost", [])
    return isinstance(drop, list) and (not drop or (len(drop) == len(table["cost"]) and all(_number(v) for v in drop)))


def _path_row(row, n_expert: int) -> bool:
    """[prev2, prev1, n, [[expert, count], ...]] (calibration/paths.py)."""
    if not (isinstance(row, list) and len(row) == 4):
        return False
    prev2, prev1, n, counts = row
    return (_experts(prev2) and _experts(prev1) and _number(n) and n > 0 and isinstance(counts, list)
            and all(isinstance(c, list) and len(c) == 2 and _integer(c[0]) and 0 <= c[0] < n_expert
                    and _number(c[1]) for c in counts))


def _check_tables(data: dict, what: str) -> None:
    def invalid(name: str, shape: str) -> InvalidOptionError:
        return InvalidOptionError(f"{what} has an invalid {name} ({shape}; run pyedgemoe calibrate again)")

    for key in ("best_policy", "best_lossless_policy"):
        if data.get(key) is not None and not isinstance(data[key], str):
            raise invalid(key, "a cache policy's name")
    usage = data.get("expert_usage")
    if usage is not None and not (isinstance(usage, dict) and all(
            _layer(k) and isinstance(v, list) and all(_number(c) for c in v) for k, v in usage.items())):
        raise invalid("expert_usage", "per layer, a list of counts")
    precision_map = data.get("precision_map")
    if precision_map is not None and not (
            isinstance(precision_map, dict) and is_low_experts(precision_map.get("low"))
            and _integer(precision_map.get("n_low")) and _integer(precision_map.get("n_experts"))
            and 0 <= precision_map["n_low"] <= precision_map["n_experts"]):
        raise invalid("precision_map", "the LOW experts per layer, n_low and n_experts")
    paths = data.get("path_statistics")
    if paths is not None and not (
            isinstance(paths, dict) and _integer(paths.get("n_expert")) and paths["n_expert"] > 0
            and isinstance(paths.get("tables"), dict)
            and all(_layer(k) and isinstance(rows, list) and all(_path_row(r, paths["n_expert"]) for r in rows)
                    for k, rows in paths["tables"].items())):
        raise invalid("path_statistics", "per layer, rows of [prev2, prev1, n, [[expert, count], ...]]")
    stand_ins = data.get("stand_ins")
    if stand_ins is not None and not (
            isinstance(stand_ins, dict) and isinstance(stand_ins.get("layers"), dict)
            and all(_layer(k) and isinstance(t, dict) and _square(t.get("cost")) and _drop_costs(t)
                    and isinstance(t.get("swap_cost_quantiles"), list)
                    and len(t["swap_cost_quantiles"]) == QUANTILE_POINTS
                    and all(_number(q) for q in t["swap_cost_quantiles"]) for k, t in stand_ins["layers"].items())):
        raise invalid("stand_ins", "per layer, an n_expert x n_expert cost, n_expert drop costs and its swap costs' "
                      f"{QUANTILE_POINTS} quantiles")
    big_little = data.get("big_little")
    if big_little is not None and not (isinstance(big_little, dict) and _number(big_little.get("gamma"))
                                       and big_little["gamma"] <= 1):
        raise invalid("big_little", "MoBiLE's gamma in [0, 1]")


def embedded_calibration(model_path: str | os.PathLike, metadata: dict | None = None) -> dict | None:
    """The calibration that `pyedgemoe convert --calibration` embedded in the model, or None.
    metadata: the model's key/values if the caller has them (saves reading the header again)."""
    kv = read_model_info(model_path).metadata if metadata is None else metadata
    what = f"calibration embedded in {os.fspath(model_path)}"
    if JSON_KEY in kv:
        if not isinstance(kv[JSON_KEY], str):
            raise InvalidOptionError(f"{what}: {JSON_KEY} is not a string")
        try:
            data = json.loads(kv[JSON_KEY])
        except ValueError as e:
            raise InvalidOptionError(f"{what} is not valid JSON: {e}") from None
        except RecursionError:
            raise InvalidOptionError(f"{what} is not valid JSON: nested too deep") from None
        return _checked(data, what)
    if T1_KEY in kv and T2_KEY in kv:
        # _checked refuses what is not a number
        data = {"version": SIDECAR_VERSION, "t1": kv[T1_KEY], "t2": kv[T2_KEY]}
        if POLICY_WEIGHTS_KEY in kv:  # an array: model_info gives its length only
            data["policy_weights"] = _policy_weights(model_path, what)
        return _checked(data, what)
    return None


def _policy_weights(model_path: str | os.PathLike, what: str) -> list:
    """The embedded edgemoe.calibration.policy_weights array (its items as read; _checked judges them)."""
    try:
        field = gguf.GGUFReader(os.fspath(model_path)).get_field(POLICY_WEIGHTS_KEY)
        weights = field.contents()
    except Exception as e:  # gguf-py raises ValueError, struct.error, IndexError... on a damaged file
        raise InvalidOptionError(f"{what}: cannot read {POLICY_WEIGHTS_KEY}: {e}") from None
    return weights if isinstance(weights, list) else [weights]


def load_calibration(model_path: str | os.PathLike, metadata: dict | None = None,
                     routed_k: int | None = None) -> dict | None:
    """The model's calibration: the sidecar next to it, else the one embedded in its metadata (the
    file's own, without --override-kv's), else None. A sidecar or embedded calibration that cannot
    be read is an error; so is another model's (of_the_model; routed_k: the top-k a run routes)."""
    path = sidecar_path(model_path)
    kv = read_model_info(model_path).metadata if metadata is None else metadata
    if os.path.exists(path):
        return of_the_model(read_sidecar(path), kv, f"calibration sidecar {path}", routed_k)
    data = embedded_calibration(model_path, kv)
    return None if data is None else of_the_model(data, kv, f"calibration embedded in {os.fspath(model_path)}",
                                                  routed_k)


def of_the_model(data: dict, kv: dict, what: str, routed_k: int | None = None) -> dict:
    """data (checked), where what it records of the model it was made on is the model's (kv: its
    metadata): its top-k (the file's, or routed_k where --override-kv routes otherwise: a
    calibration of either is this model's) and its experts per layer; else InvalidOptionError."""
    arch = kv.get("general.architecture")
    n_used, n_expert = (kv.get(f"{arch}.{key}") for key in ("expert_used_count", "expert_count"))
    usage = data.get("expert_usage") if isinstance(data.get("expert_usage"), dict) else {}
    differs = []
    if "n_experts_used" in data and isinstance(n_used, int) and data["n_experts_used"] not in (n_used, routed_k):
        differs.append(f"top-{data['n_experts_used']} routing; this one's is top-{n_used}")
    sizes = sorted({len(counts) for counts in usage.values() if isinstance(counts, list)} - {n_expert})
    if isinstance(n_expert, int) and sizes:
        differs.append(f"{sizes[0]} experts a layer; this one has {n_expert}")
    if differs:
        raise InvalidOptionError(f"{what} is another model's ({', '.join(differs)}): run pyedgemoe calibrate on "
                                 "this model")
    return data


def write_sidecar(data: dict, path: str | os.PathLike) -> str:
    """Writes data as JSON to path, one line per key (the path statistics and the map are large
    tables: a line each keeps the file short to read and to diff), atomically: a reader never
    sees half a file."""
    lines = (f"  {json.dumps(key)}: {json.dumps(value)}" for key, value in data.items())
    return write_whole(path, lambda f: f.write(("{\n" + ",\n".join(lines) + "\n}\n").encode()))


def check_calibration(data: dict) -> dict:
    """data, if it is a valid calibration (version 1, 0 <= t1 <= t2 <= 1, four weights); else InvalidOptionError."""
    return _checked(data, "calibration")


def calibration_metadata(data: dict) -> list[tuple[str, object, str]]:
    """The `edgemoe.calibration.*` keys of docs/format.md for a calibration: (key, value, type)
    with type "f32", "f32_array" or "string"."""
    data = _checked(data, "calibration")
    keys = [(T1_KEY, float(data["t1"]), "f32"), (T2_KEY, float(data["t2"]), "f32")]
    if data.get("policy_weights") is not None:
        keys.append((POLICY_WEIGHTS_KEY, [float(w) for w in data["policy_weights"]], "f32_array"))
    keys.append((JSON_KEY, json.dumps(data, sort_keys=True), "string"))
    return keys

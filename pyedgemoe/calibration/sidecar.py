"""A model's calibration as the Engine and `pyedgemoe convert` see it: the sidecar
`<model>.calibration.json` next to the model, or the copy `pyedgemoe convert --calibration`
embedded as `edgemoe.calibration.*` metadata (docs/format.md). Both hold t1, t2 and
policy_weights (docs/mixed-precision.md, "The sidecar").

Precedence: explicit options > sidecar > embedded metadata > defaults; this module supplies the
middle two (load_calibration). It does not import the Engine, which reads it.
"""
from __future__ import annotations

import json
import os

import gguf

from pyedgemoe.errors import InvalidOptionError
from pyedgemoe.gguf_format import CALIBRATION_KEY_PREFIX
from pyedgemoe.model_info import read_model_info

SIDECAR_SUFFIX = ".calibration.json"
SIDECAR_VERSION = 1
# the embedded copy's keys (docs/format.md)
T1_KEY = CALIBRATION_KEY_PREFIX + "t1"
T2_KEY = CALIBRATION_KEY_PREFIX + "t2"
POLICY_WEIGHTS_KEY = CALIBRATION_KEY_PREFIX + "policy_weights"
JSON_KEY = CALIBRATION_KEY_PREFIX + "json"  # the whole sidecar


def sidecar_path(model_path: str | os.PathLike) -> str:
    return os.fspath(model_path) + SIDECAR_SUFFIX


def read_sidecar(path: str | os.PathLike) -> dict:
    """A calibration sidecar's contents; InvalidOptionError when it cannot be read or is not version 1."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise InvalidOptionError(f"cannot read the calibration sidecar {path}: {e}") from None
    return _checked(data, f"calibration sidecar {path}")


def _checked(data, what: str) -> dict:
    if not isinstance(data, dict) or data.get("version") != SIDECAR_VERSION:
        raise InvalidOptionError(f"{what} is not version {SIDECAR_VERSION} (run pyedgemoe calibrate again)")
    t1, t2, weights = data.get("t1"), data.get("t2"), data.get("policy_weights")
    if not (isinstance(t1, (int, float)) and isinstance(t2, (int, float)) and 0 <= t1 <= t2 <= 1):
        raise InvalidOptionError(f"{what} has no valid t1 <= t2 in [0, 1] (run pyedgemoe calibrate again)")
    if weights is not None and not (isinstance(weights, list) and len(weights) == 4
                                    and all(isinstance(w, (int, float)) and w >= 0 for w in weights)
                                    and sum(weights) > 0):
        raise InvalidOptionError(f"{what} has invalid policy_weights (four non-negative numbers)")
    return data


def embedded_calibration(model_path: str | os.PathLike, metadata: dict | None = None) -> dict | None:
    """The calibration that `pyedgemoe convert --calibration` embedded in the model, or None.
    metadata: the model's key/values if the caller has them (saves reading the header again)."""
    kv = read_model_info(model_path).metadata if metadata is None else metadata
    what = f"calibration embedded in {os.fspath(model_path)}"
    if JSON_KEY in kv:
        try:
            data = json.loads(str(kv[JSON_KEY]))
        except ValueError as e:
            raise InvalidOptionError(f"{what} is not valid JSON: {e}") from None
        return _checked(data, what)
    if T1_KEY in kv and T2_KEY in kv:
        data = {"version": SIDECAR_VERSION, "t1": float(kv[T1_KEY]), "t2": float(kv[T2_KEY])}
        if POLICY_WEIGHTS_KEY in kv:  # an array: model_info gives its length only
            field = gguf.GGUFReader(os.fspath(model_path)).get_field(POLICY_WEIGHTS_KEY)
            data["policy_weights"] = [float(w) for w in field.contents()]
        return _checked(data, what)
    return None


def load_calibration(model_path: str | os.PathLike, metadata: dict | None = None) -> dict | None:
    """The model's calibration: the sidecar next to it, else the one embedded in its metadata, else
    None. A sidecar or embedded calibration that cannot be read is an error."""
    path = sidecar_path(model_path)
    if os.path.exists(path):
        return read_sidecar(path)
    return embedded_calibration(model_path, metadata)


def write_sidecar(data: dict, path: str | os.PathLike) -> str:
    """Writes data as JSON to path, one line per key (the path statistics and the map are large
    tables: a line each keeps the file short to read and to diff), atomically: a reader never
    sees half a file."""
    path = os.fspath(path)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("{\n" + ",\n".join(f"  {json.dumps(key)}: {json.dumps(value)}" for key, value in data.items()) + "\n}\n")
    os.replace(tmp, path)
    return path


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

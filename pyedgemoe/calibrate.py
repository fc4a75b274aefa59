"""Calibration (HOBBIT sec. 3.2 and 3.4): thresholds T1/T2 and cache-policy weights for a model,
from the routing trace of a text, stored in a sidecar next to the model that the Engine reads.

The sidecar is `<model>.calibration.json` (docs/mixed-precision.md).
"""
from __future__ import annotations

import json
import os

from pyedgemoe.errors import InvalidOptionError

SIDECAR_SUFFIX = ".calibration.json"
SIDECAR_VERSION = 1


def sidecar_path(model_path: str | os.PathLike) -> str:
    return os.fspath(model_path) + SIDECAR_SUFFIX


def load_calibration(model_path: str | os.PathLike) -> dict | None:
    """The calibration stored next to the model, or None; a sidecar that cannot be read is an error."""
    path = sidecar_path(model_path)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise InvalidOptionError(f"cannot read the calibration sidecar {path}: {e}") from None
    if not isinstance(data, dict) or data.get("version") != SIDECAR_VERSION:
        raise InvalidOptionError(f"calibration sidecar {path} is not version {SIDECAR_VERSION} "
                                 "(run pyedgemoe calibrate again)")
    return data

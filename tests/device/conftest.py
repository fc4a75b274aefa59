"""The device tests need a GPU in this build of the native module: make test runs them with the
Vulkan variant on Mesa's lavapipe (PYEDGEMOE_REQUIRE_GPU=1: a missing GPU is then a failure);
elsewhere they are skipped when the build has none."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the shared fixtures

from conftest import MOE_ARCHITECTURES, tiny_model  # noqa: E402,F401
from pyedgemoe.devices import gpu_devices  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if gpu_devices():
        return
    if os.environ.get("PYEDGEMOE_REQUIRE_GPU") == "1":
        raise pytest.UsageError("PYEDGEMOE_REQUIRE_GPU=1 but this build of pyedgemoe._native has no GPU device")
    skip = pytest.mark.skip(reason="no GPU device in this build (make test runs these with the Vulkan variant)")
    for item in items:
        item.add_marker(skip)

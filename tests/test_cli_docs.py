"""docs/cli.md says what each flag means in the words `--help` uses: it is made from the command
itself (scripts/cli_reference.py), and must be made again when a flag or its help changes."""
from __future__ import annotations

from pathlib import Path

import cli_reference

REPO = Path(__file__).resolve().parents[1]


def test_the_cli_reference_is_the_commands_own_help():
    assert (REPO / "docs" / "cli.md").read_text() == cli_reference.reference(), \
        "docs/cli.md is out of date: python scripts/cli_reference.py > docs/cli.md"

"""tests/fuzz_corpus/: the inputs that once found something, as recipes (a few hundred bytes each)
that rebuild them from the seeds.

An entry is a JSON object: `found` (what it did before the fix: the finding's signature), `fixed`
(where), optionally `open` (a finding not fixed yet, in code another part of the project owns: the
replay test expects it to fail until then), and `recipe` (generate.py's form).
"""
from __future__ import annotations

import json
from pathlib import Path

from fuzz.mutations import apply
from fuzz.seeds import REPO, Seed

CORPUS_DIR = REPO / "tests" / "fuzz_corpus"


def load(paths: list[Path] | None = None) -> list[tuple[Path, dict]]:
    """(path, entry) for each recipe file named, or for each in tests/fuzz_corpus/."""
    paths = paths or sorted(CORPUS_DIR.glob("*.json"))
    return [(p, json.loads(p.read_text())) for p in paths]


def write_input(seeds: dict[str, Seed], recipe: dict, out: Path) -> None:
    """The input's files under out/ (the seed's files, mutated)."""
    for name, data in apply(seeds[recipe["seed"]].files, recipe["mutations"]).items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(data)

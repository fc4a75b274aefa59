"""The benchmark tables (medians, ours/stock ratios, same tokens) from saved `--json` files.

Measurements of the same cell (model, cap, prompt, output) from several files are merged, so
ours and stock may come from separate runs (docs/benchmarks.md says where they do); FILE:ENGINE
takes only that engine's measurements from FILE:

    python scripts/bench_report.py build/bench/Q12-cap25-ours.json build/bench/Q12-cap25.json:llama_cpp
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from pyedgemoe.bench.runner import ENGINES, format_report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", nargs="+", help="files written by `pyedgemoe bench --json`, each optionally FILE:ENGINE")
    args = p.parse_args()
    results = []
    for arg in args.json:
        path, _, engine = arg.rpartition(":") if arg.rsplit(":", 1)[-1] in ENGINES else (arg, "", "")
        results.extend(r for r in json.loads(Path(path).read_text()) if not engine or r["engine"] == engine)
    print(format_report(results), end="")


if __name__ == "__main__":
    main()

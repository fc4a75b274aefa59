"""python -m fuzz campaign | replay | show (docs/reliability.md)."""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from fuzz import corpus
from fuzz.campaign import run_campaign, table
from fuzz.runner import GOOD, minimize, run_input
from fuzz.seeds import REPO, build_seeds

DEFAULT_WORK = REPO / "build" / "fuzz"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fuzz", description=__doc__)
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK, help="seeds and campaign results go here")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("campaign", help="fuzz for a while; findings under WORK/campaign-SEED/")
    c.add_argument("--minutes", type=float, default=30)
    c.add_argument("--seed", type=int, default=0, help="random seed of the recipes")
    c.add_argument("--jobs", type=int, default=1, help="commands at once")
    r = sub.add_parser("replay", help="run recipes (default: tests/fuzz_corpus/) and say how each went")
    r.add_argument("recipes", nargs="*", type=Path)
    m = sub.add_parser("minimize", help="drop a finding's mutations one at a time while it still reproduces")
    m.add_argument("finding", type=Path)
    s = sub.add_parser("show", help="write the input a recipe makes into a directory, to look at or run by hand")
    s.add_argument("recipe", type=Path)
    s.add_argument("out", type=Path)
    args = parser.parse_args(argv)

    seeds = build_seeds(args.work / "seeds")
    if args.command == "campaign":
        out = args.work / f"campaign-{args.seed}"
        stats = run_campaign(seeds, out, minutes=args.minutes, seed=args.seed, jobs=args.jobs,
                             workdir=Path(tempfile.gettempdir()), log=lambda line: print(line, flush=True))
        print(table(stats))
        print(f"{stats['inputs']} inputs, {stats['commands']} commands in {stats['seconds']:.0f} s; "
              f"{len(stats['findings'])} distinct findings; {out}/stats.json, {out}/findings/")
        return 0
    if args.command == "minimize":
        finding = json.loads(args.finding.read_text())
        print(json.dumps(minimize(seeds, finding["recipe"], finding["signature"]), indent=1))
        return 0
    if args.command == "show":
        entry = json.loads(args.recipe.read_text())
        corpus.write_input(seeds, entry.get("recipe", entry), args.out)
        print(f"wrote {args.out}")
        return 0
    bad = 0
    for path, entry in corpus.load(args.recipes or None):
        r = entry.get("recipe", entry)
        results = run_input(seeds[r["seed"]], r["mutations"], r.get("run_options"), all_commands=True)
        for res in results:
            bad += res.outcome not in GOOD
            print(f"{path.name}: {res.command}: {res.outcome}" + ("" if res.outcome in GOOD else f" ({res.signature})"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

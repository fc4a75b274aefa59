"""The seed corpus: small valid inputs of every parser, and the commands that read them.

Nothing here is committed as a binary: every seed is built from the tiny random Mixtral of
scripts/tiny_moe.py (the test suite's own; 0.6 MB as GGUF, cached under tests/.models), by
pyedgemoe itself:

- std: the standard llama.cpp GGUF, plus a calibration sidecar for `convert --calibration`;
- mp: the multi-precision GGUF (`convert --high f32 --low f16`; row length 48 rules out the quants)
  with its sidecar `model.gguf.calibration.json` from `calibrate --system edgemoe --stand-ins`
  (static precision map, path statistics, expert usage, stand-ins: everything the runtime reads
  from a sidecar);
- mp-embedded: the same model with that calibration embedded as `edgemoe.calibration.*` and no sidecar;
- hf: the Hugging Face checkpoint (config.json, safetensors, tokenizer files) plus a
  model.safetensors.index.json, for `convert` from HF.

Each input is written to its own directory; a command's arguments name files under it as
`{dir}/<file>`, and `{run_options}` stands for the input's choice of RUN_VARIANTS.
"""
from __future__ import annotations

import contextlib
import json
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS_DIR = REPO / "tests" / ".models"  # tests/conftest.py's cache of the tiny models

# what `run` is given: -n 2 on a 64-token context, one thread, greedy; then one of these
RUN_ARGS = ["-p", "Hello world", "-n", "2", "--temp", "0", "-c", "64", "-t", "1"]
RUN_VARIANTS = {
    "std": [[], ["--expert-cache", "mmap"], ["--expert-cache", "50%"],
            ["--expert-cache", "50%", "--prefetch", "hobbit"],
            ["--expert-cache", "50%", "--io", "buffered", "--cache-policy", "lfu", "--no-fill-cache"]],
    "mp": [[], ["--expert-cache", "mmap"], ["--expert-cache", "50%"],
           ["--expert-cache", "50%", "--system", "edgemoe"],
           ["--expert-cache", "50%", "--system", "hobbit"], ["--expert-cache", "50%", "--static-precision"],
           ["--expert-cache", "50%", "--prefetch", "edgemoe", "--io", "buffered"],
           ["--expert-cache", "50%", "--system", "stand-ins"], ["--expert-cache", "50%", "--system", "hobbit-stand-ins"]],
}
RUN_VARIANTS["mp-embedded"] = RUN_VARIANTS["mp"]
CONVERT_ARGS = ["--high", "f32", "--low", "f16", "-t", "1"]


@dataclass
class Command:
    argv: list[str]  # pyedgemoe's arguments
    reads: tuple[str, ...]  # the input files it reads: it runs only when one of them was mutated
    writes: str | None = None  # the file it writes ({dir}/...): none may be left behind on failure


@dataclass
class Seed:
    name: str
    files: dict[str, bytes]
    commands: list[Command]
    run_variants: list[list[str]] = field(default_factory=lambda: [[]])


def _inspect(model: str) -> Command:
    return Command(["inspect", "{dir}/" + model], (model,))


def _run(*reads: str) -> Command:
    return Command(["run", "{dir}/" + reads[0], *RUN_ARGS, "{run_options}"], reads)


def build_seeds(work: Path, models_dir: Path = MODELS_DIR) -> dict[str, Seed]:
    """The seeds, built under `work` (kept: a second call with the same `work` reuses them)."""
    sys.path.insert(0, str(REPO / "scripts"))
    import tiny_moe

    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    std = tiny_moe.tiny_gguf("mixtral", models_dir)
    hf = models_dir / "mixtral" / "hf"
    mp, sidecar, embedded = _multi_precision(std, work)

    hf_files = {f"hf/{p.name}": p.read_bytes() for p in sorted(hf.iterdir()) if p.is_file()}
    from fuzz.mutations import split_safetensors
    header, _ = split_safetensors(hf_files["hf/model.safetensors"])
    index = {"metadata": {}, "weight_map": {name: "model.safetensors" for name in header if name != "__metadata__"}}
    hf_files["hf/model.safetensors.index.json"] = json.dumps(index, indent=2).encode()

    out = "{dir}/out/converted.gguf"
    seeds = [
        Seed("std", {"model.gguf": std.read_bytes(), "calibration.json": sidecar.read_bytes()},
             [_inspect("model.gguf"), _run("model.gguf"),
              Command(["convert", "{dir}/model.gguf", "-o", out, *CONVERT_ARGS, "--calibration",
                       "{dir}/calibration.json"], ("model.gguf", "calibration.json"), writes=out)],
             RUN_VARIANTS["std"]),
        Seed("mp", {"model.gguf": mp.read_bytes(), "model.gguf.calibration.json": sidecar.read_bytes()},
             [_inspect("model.gguf"), _run("model.gguf", "model.gguf.calibration.json")], RUN_VARIANTS["mp"]),
        Seed("mp-embedded", {"model.gguf": embedded.read_bytes()},
             [_inspect("model.gguf"), _run("model.gguf")], RUN_VARIANTS["mp-embedded"]),
        Seed("hf", hf_files,
             [Command(["convert", "{dir}/hf", "-o", out, "--high", "f16", "--low", "f16", "-t", "1"],
                      tuple(hf_files), writes=out)]),
    ]
    return {s.name: s for s in seeds}


def _multi_precision(std: Path, work: Path) -> tuple[Path, Path, Path]:
    """(multi-precision GGUF, its calibration sidecar, the GGUF with that calibration embedded)."""
    from pyedgemoe.calibration.run import calibrate
    from pyedgemoe.calibration.sidecar import read_sidecar, write_sidecar
    from pyedgemoe.convert import convert

    names = ("mp.gguf", "mp.gguf.calibration.json", "mp-embedded.gguf")
    if not all((work / n).exists() for n in names):
        shutil.copyfile(std, work / "std.gguf")
        # relative paths from `work`: the provenance and the sidecar record them, and the seeds'
        # bytes (which recipes' offsets refer to) must not depend on where they were built
        with contextlib.chdir(work):
            convert("std.gguf", "mp.gguf", high="f32", low="f16", force=True, progress=False, n_threads=1)
            text = " ".join(f"the {w} expert routes token {i}" for i, w in enumerate(["first", "second", "third"] * 40))
            calibrate("mp.gguf", text, budget="50%", n_ctx=64, max_tokens=256, system="edgemoe", n_threads=1,
                      trace="mp.routing-trace.npz", text_name="fuzz seed text", stand_ins=True)
            data = read_sidecar("mp.gguf.calibration.json")
            data["seconds"] = {k: 0.0 for k in data["seconds"]}  # the one thing that changes from run to run
            write_sidecar(data, "mp.gguf.calibration.json")
            convert("std.gguf", "mp-embedded.gguf", high="f32", low="f16", force=True, progress=False, n_threads=1,
                    calibration="mp.gguf.calibration.json")
    return tuple(work / n for n in names)

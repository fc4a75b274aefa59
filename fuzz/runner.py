"""Running one input through the real command line and saying how it went.

Each command is `python -m pyedgemoe ...` in a fresh process (its own session, so a hang can be
killed with all its threads) with a timeout, 4 GiB of address space, 1 GiB of file size and no core
files. The outcome, by the house rule (bad input: one `error:` line and a non-zero exit):

    ok         exit 0
    clean      exit non-zero, exactly one `error:` line on stderr, no traceback
    traceback  a Python traceback on stderr
    crash      killed by a signal (segfault, abort, ...)
    hang       still running at the timeout
    unclean    exit non-zero without exactly one `error:` line
    lost       a file damaged: an input changed, a failed command left its output file behind,
               or a successful one wrote an incomplete GGUF (half-written)
"""
from __future__ import annotations

import hashlib
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from fuzz.mutations import apply
from fuzz.seeds import Command, Seed

GOOD = ("ok", "clean")
FINDINGS = ("traceback", "crash", "hang", "unclean", "lost")
TIMEOUT_S = 60.0
ADDRESS_SPACE_BYTES = 4 << 30
FILE_SIZE_BYTES = 1 << 30


@dataclass
class Result:
    command: str  # the subcommand: inspect, run, convert
    outcome: str
    returncode: int | None
    stderr: str  # its last lines
    signature: str  # what tells two findings apart: the subcommand, exception type and place, or signal
    damage: str | None = None  # a file it lost or half-wrote (_damage), whatever the outcome

    def to_dict(self) -> dict:
        return vars(self).copy()


def _limits() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_BYTES, ADDRESS_SPACE_BYTES))
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_BYTES, FILE_SIZE_BYTES))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def pyedgemoe(argv: list[str], timeout: float = TIMEOUT_S) -> tuple[int | None, str]:
    """(exit status, or None on timeout; stderr) of `python -m pyedgemoe argv`."""
    env = {**os.environ, "PYTHONFAULTHANDLER": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "pyedgemoe", *argv], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
                            start_new_session=True, preexec_fn=_limits)
    try:
        _, err = proc.communicate(timeout=timeout)
        return proc.returncode, err.decode("utf-8", "replace")
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        return None, err.decode("utf-8", "replace")


_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
_IMPORT_FAILURE = re.compile(r"^(ImportError|ModuleNotFoundError|SyntaxError|IndentationError)\b", re.M)


def classify(returncode: int | None, stderr: str) -> str:
    if returncode is None:
        return "hang"
    if returncode < 0:
        return "crash"
    if "Traceback (most recent call last)" in stderr:
        return "traceback"
    if returncode == 0:
        return "ok"
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    return "clean" if len(errors) == 1 else "unclean"


def signature(command: str, outcome: str, returncode: int | None, stderr: str) -> str:
    frames = _FRAME.findall(stderr)
    # the innermost frame in our package (or else any), for tracebacks and faulthandler's dumps alike
    ours = [f for f in frames if "pyedgemoe" in f[0] and "site-packages/typer" not in f[0]] or frames
    if outcome == "crash":
        frame = ours[0] if ours else None  # faulthandler lists the most recent call first
        where = f" at {Path(frame[0]).name}:{frame[1]}" if frame else ""
        return f"{command}: {signal.Signals(-returncode).name}{where}"
    if outcome == "traceback":
        # the exception's line: the first unindented line after the last "Traceback" header
        after = stderr[stderr.rindex("Traceback (most recent call last)"):].splitlines()[1:]
        last = next((line for line in after if line and not line[0].isspace()), "")
        where = f" at {Path(ours[-1][0]).name}:{ours[-1][1]}" if ours else ""
        return f"{command}: {last.split(':')[0]}{where}"
    if outcome == "unclean":
        return f"{command}: exit {returncode} without one error line"
    return f"{command}: {outcome}"


def _incomplete_gguf(path: Path) -> str | None:
    """Why the GGUF at path is not whole (a header gguf-py cannot read, tensor data past its end), or None.
    Whether what it says makes sense is not asked: a faithful copy of a damaged input is not half-written."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:
        return f"half-written output: gguf-py cannot read it ({type(e).__name__}: {e})"
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            return f"half-written output: tensor {t.name} ends past the end of the file"
    return None


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def expand(argv: list[str], directory: Path, run_options: list[str]) -> list[str]:
    out = []
    for a in argv:
        if a == "{run_options}":
            out += run_options
        else:
            out.append(a.replace("{dir}", str(directory)))
    return out


def run_input(seed: Seed, mutations: list[dict], run_options: list[str] | None = None, *,
              workdir: Path | None = None, all_commands: bool = False, timeout: float = TIMEOUT_S) -> list[Result]:
    """Writes the mutated input to a fresh directory and runs the seed's commands that read a mutated
    file (all of them with all_commands, or when nothing was mutated)."""
    files = apply(seed.files, mutations)
    mutated = {name for name, data in files.items() if data != seed.files[name]}
    directory = Path(tempfile.mkdtemp(prefix=f"fuzz-{seed.name}-", dir=workdir))
    try:
        for name, data in files.items():
            (directory / name).parent.mkdir(parents=True, exist_ok=True)
            (directory / name).write_bytes(data)
        (directory / "out").mkdir()
        digests = {name: _digest(directory / name) for name in files}
        results = []
        for command in seed.commands:
            if mutated and not all_commands and not mutated & set(command.reads):
                continue
            results.append(_run_command(command, directory, run_options or [], digests, timeout))
        return results
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _run_command(command: Command, directory: Path, run_options: list[str], digests: dict[str, str],
                 timeout: float) -> Result:
    name = command.argv[0]
    argv = expand(command.argv, directory, run_options)
    returncode, stderr = pyedgemoe(argv, timeout)
    for _ in range(3):
        # the package itself failed to import: someone is editing or rebuilding it in this tree
        if not _IMPORT_FAILURE.search(stderr):
            break
        time.sleep(10)
        returncode, stderr = pyedgemoe(argv, timeout)
    outcome = classify(returncode, stderr)
    damage = _damage(command, directory, outcome, digests, timeout)
    if damage and outcome in GOOD:
        outcome = "lost"
    tail = "\n".join(stderr.splitlines()[-25:])
    if outcome == "lost":
        sig = f"{name}: lost ({damage.split(':')[0]})"
    else:
        sig = signature(name, outcome, returncode, stderr)
    return Result(name, outcome, returncode, tail, sig, damage)


def _damage(command: Command, directory: Path, outcome: str, digests: dict[str, str], timeout: float) -> str | None:
    """What the command did to files that it must not have: changed an input, left an output
    behind although it failed, or wrote an incomplete output."""
    changed = [name for name, digest in digests.items()
               if not (directory / name).exists() or _digest(directory / name) != digest]
    if changed:
        return f"input changed: {', '.join(changed)}"
    out_dir = directory / "out"
    left = sorted(p.name for p in out_dir.iterdir())
    try:
        if command.writes is None:
            return f"output written: {', '.join(left)}" if left else None
        out = Path(expand([command.writes], directory, [])[0])
        if outcome != "ok":
            return f"output left behind: {', '.join(left)}" if left else None
        if left != [out.name]:
            return f"output missing or extra files: {', '.join(left) or 'none'}"
        return _incomplete_gguf(out)
    finally:
        for p in out_dir.iterdir():
            shutil.rmtree(p) if p.is_dir() else p.unlink()


def minimize(seeds: dict[str, Seed], recipe: dict, target: str) -> dict:
    """The recipe with every mutation dropped that the finding `target` (a signature) does not need."""
    mutations = list(recipe["mutations"])
    i = 0
    while i < len(mutations) and len(mutations) > 1:
        fewer = mutations[:i] + mutations[i + 1:]
        results = run_input(seeds[recipe["seed"]], fewer, recipe.get("run_options"))
        if any(r.signature == target for r in results):
            mutations = fewer
        else:
            i += 1
    return {**recipe, "mutations": mutations}

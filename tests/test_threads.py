"""Default thread counts (pyedgemoe.threads): one per physical core this process may use (its
affinity mask), never more than its cgroup's CPU quota; and fewer while the machine is busy (the
governor, here against a simulated machine; its effect on real speed is measured in
docs/benchmarks.md, "A busy machine")."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pyedgemoe.threads import ThreadGovernor, cpu_quota, default_threads

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "models" / "demo.gguf"
CPU_CGROUP = Path("/sys/fs/cgroup/cpu")


def python(code: str, prefix: list[str] = (), **env: str) -> str:
    out = subprocess.run([*prefix, sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, **env})
    return out.stdout.strip()


def test_the_default_follows_the_affinity_mask():
    assert python("from pyedgemoe.threads import default_threads as d; print(d().n)", ["taskset", "-c", "0"]) == "1"


def test_the_engine_and_the_cli_say_what_they_chose_and_why():
    code = f"from pyedgemoe import Engine; e = Engine({str(DEMO)!r}, n_ctx=64); print(e.n_threads, e._n_threads_batch)"
    assert python(code, ["taskset", "-c", "0"]) == "1 1"
    out = subprocess.run(["taskset", "-c", "0", sys.executable, "-m", "pyedgemoe", "run", str(DEMO), "-p", "def",
                          "-n", "1", "--verbose"], capture_output=True, text=True, check=True)
    assert "pyedgemoe: threads: default decode, default batch; default 1: 1 physical core among the 1 CPU " \
           "this process may use\n" in out.stderr
    out = subprocess.run([sys.executable, "-m", "pyedgemoe", "run", str(DEMO), "-p", "def", "-n", "1", "-t", "1",
                          "-tb", "2", "--verbose"], capture_output=True, text=True, check=True)
    assert "pyedgemoe: threads: 1 decode, 2 batch\n" in out.stderr


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_quota_is_the_tightest_of_the_cgroup_and_those_above_it(tmp_path):
    # v1: the cpu controller's own mount; the group's parent sets 1.5 CPUs, the group none
    write(tmp_path / "cpu" / "cpu.cfs_quota_us", "-1\n")
    write(tmp_path / "cpu" / "cpu.cfs_period_us", "100000\n")
    write(tmp_path / "cpu" / "box" / "cpu.cfs_quota_us", "150000\n")
    write(tmp_path / "cpu" / "box" / "cpu.cfs_period_us", "100000\n")
    write(tmp_path / "cpu" / "box" / "job" / "cpu.cfs_quota_us", "-1\n")
    write(tmp_path / "cpu" / "box" / "job" / "cpu.cfs_period_us", "100000\n")
    assert cpu_quota("3:cpuset:/\n1:cpu:/box/job\n", root=tmp_path) == 1.5
    assert cpu_quota("1:cpu:/\n", root=tmp_path) is None
    # v2: cpu.max
    write(tmp_path / "v2" / "cpu.max", "max 100000\n")
    write(tmp_path / "v2" / "a" / "cpu.max", "250000 100000\n")
    assert cpu_quota("0::/a\n", root=tmp_path / "v2") == 2.5


def test_the_default_follows_a_real_cgroup_quota(tmp_path):
    group = CPU_CGROUP / f"pyedgemoe-test-{os.getpid()}"
    try:
        group.mkdir()
        (group / "cpu.cfs_quota_us").write_text("50000")  # half a CPU
    except OSError as e:
        pytest.skip(f"cannot make a cpu cgroup here: {e}")
    try:
        out = subprocess.run(["sh", "-c", f"echo $$ > {group}/cgroup.procs && exec {sys.executable} -c "
                              "'from pyedgemoe.threads import default_threads as d; t = d(); print(t.n, t.why)'"],
                             capture_output=True, text=True, check=True).stdout
        assert out.startswith("1 ") and "capped by the cgroup's CPU quota of 0.5" in out
    finally:
        group.rmdir()


class Machine:
    """A simulated 2-CPU machine decoding: tokens/s by thread count, and how many CPUs other
    processes keep busy, changing at given times; a clock the decode advances."""

    def __init__(self, phases: list[tuple[float, dict[int, float], float]]):
        self.phases = phases  # (from this time on, rate by thread count, others' CPUs)
        self.now = 0.0

    def phase(self) -> tuple[dict[int, float], float]:
        return [(rates, others) for start, rates, others in self.phases if start <= self.now][-1][0:2]

    def others(self) -> float:  # as CpuLoad.others
        return self.phase()[1]

    def runnable_lately(self) -> int:  # as CpuLoad.runnable_lately
        return round(self.phase()[1])

    def run(self, governor: ThreadGovernor, until: float) -> dict[int, float]:
        """Decodes until the clock reads `until`; the seconds spent at each thread count."""
        spent: dict[int, float] = {}
        while self.now < until:
            n = governor.n
            seconds = 1 / self.phase()[0][n]
            self.now += seconds
            spent[n] = spent.get(n, 0.0) + seconds
            governor.record(1, seconds)
        return spent


IDLE = ({1: 2500.0, 2: 4000.0}, 0.05)  # the demo model on this project's 2 cores, roughly
BUSY = ({1: 3000.0, 2: 2.0}, 1.3)      # one CPU-bound process per core: two threads collapse


def governor(machine: Machine, load: bool) -> ThreadGovernor:
    return ThreadGovernor(2, cpus=2, load=machine if load else None, clock=lambda: machine.now)


@pytest.mark.parametrize("load", [True, False], ids=["cpu-load", "speed-only"])
def test_an_idle_machine_decodes_on_every_core(load):
    machine = Machine([(0, *IDLE)])
    spent = machine.run(governor(machine, load), until=60)
    assert spent[2] / 60 > 0.99


@pytest.mark.parametrize("load", [True, False], ids=["cpu-load", "speed-only"])
def test_a_busy_machine_decodes_on_fewer_threads(load):
    machine = Machine([(0, *BUSY)])
    g = governor(machine, load)
    spent = machine.run(g, until=60)
    assert g.n == 1
    # with the CPUs' load: never two threads; on speed alone, the first slow token and the probes
    # (each one token at two threads) cost under 10 %
    assert spent.get(2, 0) < (1e-9 if load else 6)


@pytest.mark.parametrize("load", [True, False], ids=["cpu-load", "speed-only"])
def test_when_the_load_goes_the_cores_come_back(load):
    machine = Machine([(0, *BUSY), (30, *IDLE)])
    g = governor(machine, load)
    machine.run(g, until=30)
    assert g.n == 1
    machine.run(g, until=30 + (2 * ThreadGovernor.CHECK_S if load else ThreadGovernor.MAX_PROBE_S + 1))
    assert g.n == 2


def test_a_sudden_slowdown_is_answered_within_two_windows():
    machine = Machine([(0, *IDLE), (5, BUSY[0], IDLE[1])])  # slower, and the CPUs' load does not show it
    g = governor(machine, load=True)
    machine.run(g, until=5)
    assert g.n == 2
    machine.run(g, until=5 + 2 / BUSY[0][2] + 0.01)  # two windows of one slow token each
    assert g.n == 1


def test_given_counts_stay_and_only_defaults_are_governed():
    code = (f"from pyedgemoe import Engine; e = Engine({str(DEMO)!r}, n_ctx=64, n_threads=2); "
            "print(e._governor is None, e.n_threads)")
    assert python(code) == "True 2"
    code = f"from pyedgemoe import Engine; e = Engine({str(DEMO)!r}, n_ctx=64); print(e._governor.n_max)"
    assert python(code, ["taskset", "-c", "0,1"]) == "2"


def test_without_a_quota_the_default_is_the_physical_cores_lscpu_counts():
    if cpu_quota() is not None:
        pytest.skip("this process runs under a CPU quota")
    rows = subprocess.run(["lscpu", "-p=CPU,CORE,SOCKET"], capture_output=True, text=True, check=True).stdout
    cpus = os.sched_getaffinity(0)
    cores = {tuple(r.split(",")[1:]) for r in rows.splitlines() if not r.startswith("#") and int(r.split(",")[0]) in cpus}
    assert default_threads().n == len(cores)

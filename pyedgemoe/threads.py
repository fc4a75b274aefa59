"""How many threads compute, by default, and how they wait: fast on an idle machine and on a busy one.

The count is what users of llama.cpp expect (its `cpu_get_num_math`): one thread per physical core,
here among the CPUs this process may run on (its affinity mask, `taskset`), and never more than its
cgroup's CPU quota (`docker --cpus`, systemd's CPUQuota) allows. A core's second hardware thread
adds little to the matrix math, and a thread more than the CPU time there is only waits for.

On a busy machine that count is too many. ggml's CPU backend runs its threads as an OpenMP team
that meets at a barrier after every graph node, and libgomp's threads spin there before they sleep.
When another process holds one of the cores, a team thread waits for a time slice at every node,
and its partners spin meanwhile: decoding slows by one to three orders of magnitude, erratically
(docs/benchmarks.md, "A busy machine"). No wait policy fixes both cases: a passive wait
(OMP_WAIT_POLICY=PASSIVE) is stable under load but 20x slower idle, a shorter spin
(GOMP_SPINCOUNT) is fast idle and still collapses under load. What does not collapse is fewer
threads. So ThreadGovernor measures the decode's speed and moves the count between 1 and the
default: down when a window of tokens decodes much slower than the last, and now and then a probe
of the neighbouring count, kept when clearly faster.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class ThreadCount:
    n: int
    why: str  # for --verbose


def physical_cores(cpus: set[int]) -> int:
    """The physical cores among these logical CPUs (each CPU its own core where sysfs says nothing)."""
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topology / "physical_package_id").read_text().strip(),
                       (topology / "core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return len(cores)


def _quota_of(directory: Path) -> float | None:
    """The CPU quota one cgroup directory sets, in CPUs (v2 cpu.max or v1 cfs_quota/period)."""
    try:
        quota, period = (directory / "cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def cpu_quota(proc_cgroup: str | None = None, root: Path = CGROUP_ROOT) -> float | None:
    """This process's CPU quota in CPUs, the tightest of its cgroup and the cgroups above it;
    None without one. proc_cgroup: the text of /proc/self/cgroup (read when None)."""
    if proc_cgroup is None:
        try:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            return None
    quotas = []
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one hierarchy
            mount = root
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's own mount
            mount = next((root / name for name in (controllers, "cpu", "cpu,cpuacct") if (root / name).is_dir()), None)
            if mount is None:
                continue
        else:
            continue
        directory = mount / path.lstrip("/")
        while True:
            quota = _quota_of(directory)
            if quota is not None:
                quotas.append(quota)
            if directory == mount or mount not in directory.parents:
                break
            directory = directory.parent
    return min(quotas) if quotas else None


def default_threads() -> ThreadCount:
    """The default number of compute threads here, and why."""
    cpus = os.sched_getaffinity(0)
    n = physical_cores(cpus)
    why = (f"{n} physical core{'s' if n != 1 else ''} among the {len(cpus)} "
           f"CPU{'s' if len(cpus) != 1 else ''} this process may use")
    quota = cpu_quota()
    if quota is not None and quota < n:
        n = max(1, math.floor(quota))
        why += f", capped by the cgroup's CPU quota of {quota:g}"
    return ThreadCount(n, why)


class ThreadGovernor:
    """The decode's thread count (1..n_max), from its measured speed. Windows of decoded tokens are
    timed (record); after each window the count may change, for the next decode (n)."""

    WINDOW_TOKENS = 8        # a window ends after this many tokens ...
    WINDOW_SECONDS = 0.05    # ... or this much decode time, whichever first
    FIRST_PROBE_S = 0.5      # the neighbouring count is tried this long after a probe lost the first time,
    MAX_PROBE_S = 16.0       # twice as long after each probe that lost, up to this
    DROP = 0.5               # a window at most this share of the last one's speed: try fewer threads now
    GAIN = 1.1               # a probe's count is kept when this much faster (not for noise between windows)

    def __init__(self, n_max: int, clock=time.perf_counter):
        self.n_max = n_max
        self.n = n_max
        self._clock = clock
        self._rate: dict[int, float] = {}  # tokens/s of each count's last window
        self._tokens, self._seconds = 0, 0.0
        self._probe_from: int | None = None  # during a probe: the count it is compared with
        self._interval = self.FIRST_PROBE_S
        self._next_probe = clock()  # the first probe right after the first window: a short generation counts too

    def set_max(self, n_max: int) -> None:
        """A new most (the expert reads gave their core back): from there, at once."""
        self.n_max = self.n = n_max
        self._probe_from = None
        self._rate.clear()

    def record(self, tokens: int, seconds: float) -> None:
        self._tokens += tokens
        self._seconds += seconds
        if self._tokens < self.WINDOW_TOKENS and self._seconds < self.WINDOW_SECONDS:
            return
        rate = self._tokens / max(self._seconds, 1e-9)
        self._tokens, self._seconds = 0, 0.0
        last = self._rate.get(self.n)
        self._rate[self.n] = rate
        now = self._clock()
        if self._probe_from is not None:  # the probe's window: keep whichever count was faster
            base, self._probe_from = self._probe_from, None
            if rate > self.GAIN * self._rate[base]:  # checked at once by a probe back (one window can mislead)
                self._interval = self.FIRST_PROBE_S
                self._next_probe = now
            else:
                self.n = base
                self._interval = min(2 * self._interval, self.MAX_PROBE_S)
                self._next_probe = now + self._interval
            return
        dropped = last is not None and rate <= self.DROP * last and self.n > 1
        if dropped or now >= self._next_probe:
            probe = self.n - 1 if dropped or self.n == self.n_max else self.n + 1
            if 1 <= probe <= self.n_max and probe != self.n:
                self._probe_from, self.n = self.n, probe
            else:
                self._next_probe = now + self._interval

"""How many threads compute, by default, and how they wait: fast on an idle machine and on a busy one
(and llama.cpp's --prio, the process's priority: set_priority).

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

from pyedgemoe.errors import InvalidOptionError

CGROUP_ROOT = Path("/sys/fs/cgroup")
# llama.cpp's --prio levels (low -1 to realtime 3) and the nice value each sets (common.cpp's set_process_priority)
PRIORITY_NICE = {-1: 5, 0: 0, 1: -5, 2: -10, 3: -20}


def set_priority(level: int) -> str | None:
    """llama.cpp's --prio LEVEL: this process's nice value for it; where the system refuses (a
    priority above normal needs privileges), a note saying so, and the run goes on, as llama.cpp's."""
    if level not in PRIORITY_NICE:
        raise InvalidOptionError(f"--prio takes -1 (low), 0 (normal), 1 (medium), 2 (high) or 3 (realtime), got {level}")
    try:
        os.setpriority(os.PRIO_PROCESS, 0, PRIORITY_NICE[level])
    except OSError as e:
        return f"--prio {level}: cannot set the process's priority (nice {PRIORITY_NICE[level]}): {e.strerror}"
    return None


@dataclass(frozen=True)
class ThreadCount:
    n: int
    why: str  # for --verbose
    cpus: int = 0  # the logical CPUs this process may run on, within its cgroup's quota (0: not known)


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
        if (directory / "cpu.max").exists():
            quota, period = (directory / "cpu.max").read_text().split()
            return None if quota == "max" else int(quota) / int(period)
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
    return ThreadCount(n, why, len(cpus) if quota is None else max(1, min(len(cpus), math.ceil(quota))))


def _task_state(task: str) -> str:
    """One of this process's threads' state (R: running or runnable); "" for one that just ended."""
    try:
        with open(f"/proc/self/task/{task}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]  # after the name, which may hold spaces
    except OSError:
        return ""


class CpuLoad:
    """How many of this process's CPUs other work keeps busy: between two reads, those CPUs' busy
    time (/proc/stat: user, nice, system, irq, softirq, steal) less this process's own
    (/proc/self/stat), in CPUs. OSError where /proc does not tell."""

    MIN_SECONDS = 0.1  # shorter spans are mostly the clock tick's rounding

    def __init__(self, cpus: set[int] | None = None):
        self._names = {f"cpu{c}" for c in (os.sched_getaffinity(0) if cpus is None else cpus)}
        self._tick = os.sysconf("SC_CLK_TCK")
        self._last = self._read()

    def _read(self) -> tuple[float, int, int]:
        busy = 0
        with open("/proc/stat") as f:
            for line in f:
                name, *fields = line.split()
                if name in self._names:
                    user, nice, system, _, _, irq, softirq, steal = map(int, fields[:8])
                    busy += user + nice + system + irq + softirq + steal
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command's name, which may hold spaces
        return time.monotonic(), busy, int(fields[11]) + int(fields[12])  # utime + stime

    @staticmethod
    def runnable_now() -> int:
        """Other processes' tasks runnable on the machine at this instant (/proc/loadavg less this
        process's own running threads): a first guess, before any time has passed to measure."""
        with open("/proc/loadavg") as f:
            running = int(f.read().split()[3].split("/")[0])
        return max(0, running - sum(_task_state(task) == "R" for task in os.listdir("/proc/self/task")))

    def runnable_lately(self, reads: int = 3, apart_s: float = 0.001) -> int:
        """runnable_now at its least over a few reads: a task that only flickers through the run
        queue (a kernel worker, a process ending) is not load."""
        least = self.runnable_now()
        for _ in range(reads - 1):
            time.sleep(apart_s)
            least = min(least, self.runnable_now())
        return least

    def others(self) -> float | None:
        """CPUs' worth of others' work since the last call that answered; None if too soon."""
        now = self._read()
        seconds = now[0] - self._last[0]
        if seconds < self.MIN_SECONDS:
            return None
        busy, ours = now[1] - self._last[1], now[2] - self._last[2]
        self._last = now
        return max(0.0, (busy - ours) / self._tick / seconds)


def cpu_load() -> CpuLoad | None:
    """A CpuLoad of this process's CPUs, or None where /proc does not tell."""
    try:
        return CpuLoad()
    except (OSError, ValueError):
        return None


class ThreadGovernor:
    """The decode's thread count, 1..n_max. Down when other work takes the CPUs (CpuLoad, read every
    CHECK_S) or when two windows of tokens in a row decode at half the speed before; up, one at a time, by
    a probe: a window with one thread more, kept when clearly faster. A probe up waits for a free CPU.
    Without CpuLoad the probes are blind: a thread fewer at the most, else one more, after a back-off
    that doubles after each probe that lost."""

    WINDOW_TOKENS = 8        # a window ends after this many decoded tokens ...
    WINDOW_SECONDS = 0.05    # ... or this much decode time, whichever first
    CHECK_S = 0.5            # how often the CPUs' load is read
    FIRST_PROBE_S = 0.5      # without CpuLoad: a probe this long after one lost the first time,
    MAX_PROBE_S = 16.0       # twice as long after each, up to this
    DROP = 0.5               # two windows in a row at most this share of the speed before: a thread fewer
    GAIN = 1.1               # a probe's count is kept when this much faster (not for noise between windows)

    def __init__(self, n_max: int, cpus: int | None = None, load: CpuLoad | None = None, clock=time.perf_counter):
        self.n_max = n_max
        self.n = n_max
        self.cpus = len(os.sched_getaffinity(0)) if cpus is None else cpus
        self._load = load
        self._clock = clock
        self._rate: dict[int, float] = {}  # tokens/s of each count's last window
        self._tokens, self._seconds = 0, 0.0
        self._slow = 0  # windows in a row at most DROP of the speed before them
        self._probe_from: int | None = None  # during a probe: the count it is compared with
        self._interval = self.FIRST_PROBE_S
        self._next_probe = clock()
        self._next_check = clock() + CpuLoad.MIN_SECONDS  # the first read that tells something
        if load is not None:  # until then: as many as the CPUs nothing else runs on now
            try:
                self.n = max(1, min(n_max, self.cpus - load.runnable_lately()))
            except (OSError, ValueError, IndexError):
                self.n = n_max

    def set_max(self, n_max: int) -> None:
        """A new most (the expert reads gave their core back): from there, at once."""
        self.n_max = self.n = n_max
        self._probe_from = None
        self._rate.clear()

    def record(self, tokens: int, seconds: float) -> None:
        """A decode call: `tokens` decoded (0 for a prompt's batch) in `seconds`."""
        now = self._clock()
        if self._load is not None and now >= self._next_check and self._probe_from is None:
            self._check_load(now)
        if not tokens:
            return
        self._tokens += tokens
        self._seconds += seconds
        if self._tokens < self.WINDOW_TOKENS and self._seconds < self.WINDOW_SECONDS:
            return
        rate = self._tokens / max(self._seconds, 1e-9)
        self._tokens, self._seconds = 0, 0.0
        last = self._rate.get(self.n)
        dropped = self._probe_from is None and last is not None and rate <= self.DROP * last
        self._slow = self._slow + 1 if dropped else 0
        if not dropped or self._slow >= 2:  # one slow window is a hiccup; a second, the speed now
            self._rate[self.n] = rate
        if self._probe_from is not None:  # the probe's window: keep whichever count was faster
            base, self._probe_from = self._probe_from, None
            if rate > self.GAIN * self._rate[base]:
                self._interval = self.FIRST_PROBE_S
            else:
                self.n = base
                self._interval = min(2 * self._interval, self.MAX_PROBE_S)
            self._next_probe = now + self._interval
        elif self._slow >= 2 and self.n > 1:
            self._slow = 0
            self._probe_from, self.n = self.n, self.n - 1
        elif self._load is None and self.n_max > 1 and now >= self._next_probe:  # blind: the neighbour
            self._probe_from, self.n = self.n, self.n - 1 if self.n == self.n_max else self.n + 1

    def _check_load(self, now: float) -> None:
        try:
            others = self._load.others()
        except (OSError, ValueError):
            self._load = None
            return
        if others is None:  # too soon after the last read
            self._next_check = now + CpuLoad.MIN_SECONDS
            return
        self._next_check = now + self.CHECK_S
        free = self.cpus - others  # CPUs' worth nobody else used
        if free < self.n - 0.5 and self.n > 1:
            self.n = max(1, math.floor(free + 0.5))
        elif free > self.n + 0.75 and self.n < self.n_max and self.n in self._rate:
            self._probe_from, self.n = self.n, self.n + 1
        else:
            return
        self._tokens, self._seconds = 0, 0.0  # a window of the new count starts here

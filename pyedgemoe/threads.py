"""How many threads compute, by default, and how they wait: fast on an idle machine and on a busy one.

The count is what users of llama.cpp expect (its `cpu_get_num_math`): one thread per physical core,
here among the CPUs this process may run on (its affinity mask, `taskset`), and never more than its
cgroup's CPU quota (`docker --cpus`, systemd's CPUQuota) allows. A core's second hardware thread
adds little to the matrix math, and a thread more than the CPU time there is only waits for.

The wait: ggml's CPU backend runs its threads as an OpenMP team. libgomp's threads busy-wait for
the next parallel region by default; when another process holds a core, the waiting thread takes
that core's time from the thread doing the work, and decoding slows by one to two orders of
magnitude (docs/benchmarks.md, "A busy machine"). A passive wait (OMP_WAIT_POLICY=PASSIVE) sleeps
instead: set before libgomp is loaded, unless the user set it.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class ThreadCount:
    n: int
    why: str  # for --verbose


def prefer_passive_openmp_wait() -> None:
    """Before our native module (and with it libgomp) is loaded: a passive OpenMP wait, unless set."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


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

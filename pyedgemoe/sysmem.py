"""Sizes and the machine's memory: parsing and printing byte counts, this process's memory
cgroup and a group's counters, and dropping a file from the page cache."""
from __future__ import annotations

import os
import re
from pathlib import Path

# k/M/G/T are decimal (as disks are sold), KiB/MiB/GiB/TiB binary; case does not matter.
SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
              "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
CGROUP_V1_MEMORY = Path("/sys/fs/cgroup/memory")
CGROUP_V2 = Path("/sys/fs/cgroup")  # the unified hierarchy's root, where cgroup v2 is mounted


def parse_size(text: str, *, percent_of: int | None = None) -> int:
    """'8GiB', '7.5G', '512 MiB', '123456' -> bytes; 'N%' -> N % of percent_of.
    ValueError, with a message for the user, if the text is no size or the bytes are not positive."""
    s = text.strip().lower().replace(" ", "")
    if s.endswith("%"):
        if percent_of is None:
            raise ValueError(f"size {text!r}: a percentage needs a reference size")
        try:
            value = int(percent_of * float(s[:-1]) / 100)
        except (ValueError, OverflowError):  # no number, nan, inf
            raise ValueError(f"cannot parse size {text!r}") from None
    else:
        m = re.fullmatch(r"([0-9]*\.?[0-9]+)([a-z]*)", s)
        if not m or m.group(2) not in SIZE_UNITS:
            raise ValueError(f"cannot parse size {text!r} (examples: 8GiB, 7.5G, 512MiB, 50%)")
        value = int(float(m.group(1)) * SIZE_UNITS[m.group(2)])
    if value <= 0:
        raise ValueError(f"size {text!r} is not positive")
    return value


def format_bytes(n: float | None, decimals: int = 2) -> str:
    """1536 -> '1.50 KiB' (whole bytes below 1 KiB, then KiB, MiB, GiB, TiB); None -> '-'."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} B" if unit == "B" else f"{n:.{decimals}f} {unit}"
        n /= 1024
    return f"{n:.{decimals}f} TiB"


def memory_stat(stat_file: Path) -> dict[str, int]:
    """A cgroup's memory.stat (v1 or v2) as {key: value}; OSError or ValueError if unreadable."""
    return {key: int(value) for key, value in (line.split() for line in stat_file.read_text().splitlines()
                                               if line.count(" ") == 1)}


def own_memory_cgroup_v1() -> Path | None:
    """The directory of this process's cgroup v1 memory group (where a limit set for it is
    written); None without a mounted cgroup v1 memory controller."""
    return next((group for version, group in own_memory_cgroups() if version == "cgroup v1"), None)


def own_memory_cgroups() -> list[tuple[str, Path]]:
    """("cgroup v1" or "cgroup v2", directory) of this process's memory cgroup and of each one above it
    up to the hierarchy's root, its own first: a limit set on any of them bounds it."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:  # no /proc/self/cgroup: no cgroup to speak of
        return []
    groups = []
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            version, root = "cgroup v1", CGROUP_V1_MEMORY
        elif hierarchy == "0" and not controllers:
            version, root = "cgroup v2", CGROUP_V2
        else:
            continue
        group = root / path.lstrip("/")
        if group.is_dir():
            groups += [(version, group)] + [(version, above) for above in group.parents if root in above.parents
                                            or above == root]
    return groups


def evict_from_page_cache(path: str | os.PathLike[str]) -> None:
    """Drop the file's pages from the page cache, wherever they are charged: the next reader
    starts cold, and pages an earlier process read are no free memory for a capped one."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages (a freshly written file) are not dropped by DONTNEED
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)

"""What a result was produced with: the code's git revision, the library versions and the machine.

Benchmark CSVs (`mtp.bench.report`), study reports (`experiments.common`) and evaluation
summaries (`mtp.eval`) all stamp their results from here. Nothing heavy is imported until a
function that needs it runs (versions come from package metadata).
"""

from __future__ import annotations

import datetime
import functools
import os
import platform
import subprocess
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

__all__ = ["REPO", "available_memory", "cache_dir", "cpu_flags", "cpu_model", "current_rss",
           "environment", "free_disk", "git_state", "machine_key", "versions"]

#: The checkout the code runs from (the parent of the `mtp` package).
REPO = Path(__file__).resolve().parents[1]


def git_state(root: Path = REPO, *, exclude: Sequence[str] = (), short: bool = True,
              untracked: bool = False) -> tuple[str, bool]:
    """HEAD's revision under `root` and whether tracked files differ from it (with `untracked`,
    also whether files git does not ignore are uncommitted; paths listed in `exclude`, relative
    to `root`, do not count); ("unknown", False) outside a git checkout."""
    spec = ["--", ".", *(f":(exclude){p}" for p in exclude)] if exclude else []
    try:
        rev = subprocess.run(["git", "rev-parse", *(["--short"] if short else []), "HEAD"],
                             cwd=root, capture_output=True, text=True, timeout=10,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain",
                                f"--untracked-files={'normal' if untracked else 'no'}", *spec],
                               cwd=root, capture_output=True, text=True, timeout=10,
                               check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown", False
    return rev, bool(dirty)


def versions(*dists: str) -> dict[str, str]:
    """Python's version and each installed distribution's (those not installed are left out)."""
    out = {"python": platform.python_version()}
    for dist in dists:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def cache_dir() -> Path:
    """mtp's cache of measurements that hold for one machine (`$MTP_CACHE_DIR`, else
    `$XDG_CACHE_HOME/mtp`, else `~/.cache/mtp`): the reference solutions' CPU times of `mtp eval`,
    the linear path chosen for each weight shape of a decode forward."""
    if os.environ.get("MTP_CACHE_DIR"):
        return Path(os.environ["MTP_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mtp"


@functools.cache
def _cpuinfo_field(name: str) -> str | None:
    """The first value of `name` in /proc/cpuinfo (Linux), None where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":", 1)[0].strip() == name:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    """The CPU's model name (`AMD EPYC`, `Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz`), from
    /proc/cpuinfo, else the platform's processor or machine name (`x86_64`)."""
    return _cpuinfo_field("model name") or platform.processor() or platform.machine()


def cpu_flags() -> frozenset[str]:
    """The CPU's instruction-set flags (`avx512_bf16`, `amx_bf16`, ...), from /proc/cpuinfo;
    empty where it cannot be read."""
    return frozenset((_cpuinfo_field("flags") or "").split())


def machine_key() -> str:
    """What a measurement of this machine holds for: the CPU model, the core count and the
    Python build (`AMD EPYC x2 | CPython 3.11.2`); a cache of timings is keyed by it."""
    return (f"{cpu_model()} x{os.cpu_count()} | {platform.python_implementation()} "
            f"{platform.python_version()}")


def environment() -> dict[str, str]:
    """Hardware, torch threads, library versions, git revision (`+dirty` with uncommitted
    changes) and UTC time: the columns stamped on every benchmark row."""
    import torch

    if torch.cuda.is_available():
        hardware = torch.cuda.get_device_name(0)
    else:
        hardware = f"cpu:{cpu_model()} ({platform.machine()}) x{os.cpu_count()}"
    rev, dirty = git_state()
    found = versions("torch", "triton")
    return {
        "hardware": hardware,
        "threads": str(torch.get_num_threads()),
        "python": found["python"],
        "torch": found.get("torch", torch.__version__),
        "triton": found.get("triton", "none"),
        "git_rev": rev + ("+dirty" if dirty else ""),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _cgroup_room() -> int | None:
    """Bytes the process's cgroup (v2, or v1) may still take, None where it sets no limit."""
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                          "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            cap = Path(limit).read_text().strip()
            used = int(Path(usage).read_text())
        except (OSError, ValueError):
            continue
        if cap.isdigit() and int(cap) < 1 << 60:  # v1 writes an unlimited cap as ~2**63
            return max(0, int(cap) - used)
    return None


def available_memory(device: str = "cpu") -> int:
    """Bytes that new allocations can take on `device` (``cpu``, or ``cuda`` for the first GPU
    Lightning would use): the memory the kernel counts as available (``MemAvailable``, which
    counts page cache as free), and no more than the cgroup's limit leaves; for a GPU, its free
    memory."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    room = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                room = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError):
        pass
    if room is None:  # no /proc: the free physical pages
        room = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    cgroup = _cgroup_room()
    return room if cgroup is None else min(room, cgroup)


def current_rss() -> int:
    """Bytes resident in memory for this process now (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def free_disk(path: str | os.PathLike) -> int | None:
    """Bytes free to an unprivileged user on the file system that holds `path` (or the nearest
    folder above it that exists); None where that cannot be read."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize

"""Resource limits of a sample: the per-process rlimits, and one memory cgroup for all of its
processes where this machine lets the harness make one (:func:`memory_cgroups`), which each of
its interpreters joins before it starts (:func:`join_cgroup_command`)."""

from __future__ import annotations

import math
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Limits:
    """Resource limits for one sample.

    The default timeout leaves room for the slowest reference solution (MBPP task 123 takes about
    5 s alone) on a loaded 2-core machine.
    """

    timeout: float = 20.0
    """Wall-clock seconds before the whole sandbox is killed."""
    cpu_seconds: float | None = None
    """CPU seconds for each process of the completion (RLIMIT_CPU, rounded up to a whole second);
    None means the timeout. Unlike the wall clock, it does not grow when the machine is busy."""
    memory_bytes: int = 2 << 30
    """RLIMIT_AS per process, and the whole sample's memory where a memory cgroup is available
    (``Isolation.memory_cgroup``)."""
    file_bytes: int = 16 << 20
    """RLIMIT_FSIZE: largest file (and captured stdout/stderr) the sample may write."""
    open_files: int = 256
    """RLIMIT_NOFILE."""
    processes: int = 32
    """RLIMIT_NPROC (processes and threads); see ``Isolation.process_limit``."""
    output_bytes: int = 8192
    """How much of the end of stdout/stderr to keep in the result."""


def rlimits(limits: Limits, cpu: float, processes: bool) -> dict[str, tuple[int, int]]:
    """The rlimits of one interpreter, as ``{name: (soft, hard)}``: `cpu` CPU seconds, and
    RLIMIT_NPROC only where `processes` (``Isolation.process_limit``) says it bounds anything."""
    # SIGXCPU at the soft CPU limit (it ends the process, and tells a CPU timeout apart from a
    # memory kill); SIGKILL a second later for a process that catches it.
    soft = max(1, math.ceil(cpu))
    out = {"RLIMIT_AS": limits.memory_bytes, "RLIMIT_CPU": (soft, soft + 1),
           "RLIMIT_FSIZE": limits.file_bytes, "RLIMIT_NOFILE": limits.open_files,
           "RLIMIT_CORE": 0}
    if processes:
        out["RLIMIT_NPROC"] = limits.processes
    return {k: v if isinstance(v, tuple) else (v, v) for k, v in out.items()}


class MemoryCgroups:
    """Memory-limited cgroups for the samples, where this process may create them.

    cgroup v2 (``memory.max``) where the memory controller is enabled below this process's cgroup,
    else the cgroup v1 memory hierarchy (``memory.limit_in_bytes``), else none (the samples keep
    the per-process address-space limit only). A sample's interpreters join its cgroup before
    they start, through a one-line shell, so every process the sample forks is inside it.
    """

    def __init__(self) -> None:
        self.kind, self.root = self._find()

    @staticmethod
    def _find() -> tuple[str, Path | None]:
        try:
            own = Path("/proc/self/cgroup").read_text().splitlines()
            mounts = Path("/proc/self/mountinfo").read_text().splitlines()
        except OSError:
            return "", None
        paths = {}
        for line in own:  # "0::/path" (v2) or "4:memory:/path" (v1)
            _, controllers, path = line.split(":", 2)
            paths["v2" if controllers == "" else controllers] = path
        found = []
        for line in mounts:
            fields = line.split()
            fstype = fields[fields.index("-") + 1]
            options = fields[-1].split(",")
            if fstype == "cgroup2" and "v2" in paths:
                found.append(("cgroup2", Path(fields[4] + paths["v2"]), "memory.max"))
            elif fstype == "cgroup" and "memory" in options and "memory" in paths:
                found.append(("cgroup1", Path(fields[4] + paths["memory"]),
                              "memory.limit_in_bytes"))
        for kind, root, knob in sorted(found):  # cgroup1 sorts after cgroup2
            probe = root / f"mtp-probe-{os.getpid()}-{secrets.token_hex(4)}"
            try:
                probe.mkdir()
            except OSError:
                continue
            try:
                usable = (probe / knob).exists()
                if usable:
                    (probe / knob).write_text(str(1 << 30))
            except OSError:
                usable = False
            finally:
                probe.rmdir()
            if usable:
                return kind, root
        return "", None

    def create(self, tag: str, limit: int) -> Path | None:
        """A fresh cgroup for one sample, limited to `limit` bytes; None where there is none."""
        if self.root is None:
            return None
        path = self.root / tag
        try:
            path.mkdir()
            if self.kind == "cgroup2":
                (path / "memory.max").write_text(str(limit))
                if (path / "memory.swap.max").exists():
                    (path / "memory.swap.max").write_text("0")
            else:
                (path / "memory.limit_in_bytes").write_text(str(limit))
        except OSError:
            self.remove(path)
            return None
        return path

    @staticmethod
    def remove(path: Path | None) -> None:
        """Remove a sample's cgroup once its processes are gone (they may take a moment)."""
        for _ in range(100):
            try:
                if path is not None and path.exists():
                    path.rmdir()
                return
            except OSError:
                time.sleep(0.01)


_memory_cgroups: MemoryCgroups | None = None


def memory_cgroups() -> MemoryCgroups:
    """This process's memory cgroups, found on first use."""
    global _memory_cgroups
    if _memory_cgroups is None:
        _memory_cgroups = MemoryCgroups()
    return _memory_cgroups


# Joins the cgroup named by $1, then becomes the rest of the command line.
_JOIN_CGROUP = 'echo $$ > "$1/cgroup.procs" && shift && exec "$@"'


def join_cgroup_command(cgroup: Path) -> list[str]:
    """The prefix of a command line that moves the process into `cgroup`, then runs the rest."""
    return ["/bin/sh", "-c", _JOIN_CGROUP, "sh", str(cgroup)]

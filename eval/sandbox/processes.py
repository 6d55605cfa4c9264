"""One sandboxed interpreter of a sample (:class:`SandboxedProcess`): its files and command line,
waiting on it, and killing it with everything it started (:func:`kill_all`).

Each interpreter runs a program compiled here once: :mod:`mtp.eval.wire`,
:mod:`mtp.eval.sandbox.confine`, :mod:`mtp.eval.inside` and the call of one of the latter's entry
points on the folder that :func:`~mtp.eval.sandbox.confine.confine` leaves it in.
"""

from __future__ import annotations

import functools
import json
import marshal
import os
import secrets
import select
import shutil
import signal
import subprocess
import time
from pathlib import Path

from mtp.eval import wire
from mtp.eval.sandbox.isolation import (
    SAMPLE_ENV,
    SAMPLE_UIDS,
    Isolation,
    confine_orders,
    confine_source,
    sample_python,
    wrapper_command,
)
from mtp.eval.sandbox.limits import Limits, join_cgroup_command

_TICKS = os.sysconf("SC_CLK_TCK")
# The programs that wrap a sample's interpreter (`wrapper_command`).
_WRAPPERS = ("bwrap", "unshare")


def _processes() -> dict[int, tuple[int, str, int, int]]:
    """Every process: pid -> (parent pid, state, CPU clock ticks of its own and of the children
    it reaped, start time)."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            table[int(entry)] = (int(fields[1]), fields[0], sum(map(int, fields[11:15])),
                                 int(fields[19]))
        except (OSError, IndexError, ValueError):
            continue
    return table


def _subtree(root: int, table: dict[int, tuple[int, str, int, int]]) -> list[int]:
    """`root` and its descendants in `table`."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, *_) in table.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in table:
            out.append(pid)
            todo += children.get(pid, [])
    return out


def _executable(pid: int) -> str:
    try:
        return os.path.basename(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        return ""


def _kill_leftovers(owners: list[tuple[int | None, int, str]]) -> None:
    """Kill every process of the sample and wait until they are gone.

    `owners` holds a ``(uid, session id, tag)`` per sandboxed interpreter. A process belongs to
    the sample if it runs as one of those uids, sits in one of those sessions, or carries one of
    those tags on its command line (the sandbox's own init process, which the kernel is already
    tearing down once the outer bwrap exits, but not synchronously). Loops because a fork bomb
    can outrun a single pass over ``/proc``.
    """
    uids = {uid for uid, _, _ in owners if uid is not None}
    sids = {sid for _, sid, _ in owners}
    needles = [tag.encode() for _, _, tag in owners]
    for _ in range(250):
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                owner = os.stat(f"/proc/{entry}").st_uid
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if fields[0] in "ZX":
                    continue
                if owner not in uids and int(fields[3]) not in sids:
                    with open(f"/proc/{entry}/cmdline", "rb") as f:
                        cmdline = f.read()
                    if not any(needle in cmdline for needle in needles):
                        continue
            except OSError:
                continue
            pids.append(int(entry))
        if not pids:
            return
        _signal(pids, signal.SIGKILL)
        time.sleep(0.02)


def _wait_unreaped(pid: int, timeout: float) -> bool:
    """Wait up to ``timeout`` s for a child to exit, leaving it unreaped; True if it exited."""
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # Linux < 5.3: poll instead
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
            time.sleep(0.01)
        return False
    try:
        ready, _, _ = select.select([pidfd], [], [], timeout)
    finally:
        os.close(pidfd)
    return bool(ready)


def remove_workdir(path: str) -> None:
    """Remove a sample's directory, whatever permissions the sample left on its files."""
    def onerror(func, p, exc_info):  # the sample may have chmod-ed its files to 000
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=onerror)


@functools.cache
def _site_packages() -> list[str]:
    """The sample interpreter's site-packages directories, asked of it once.

    Samples start with ``-S`` and get these on ``sys.path`` directly: the ``site`` module's
    processing of ``.pth`` files can cost more than the rest of a sample (on a machine whose
    ``.pth`` imports ``certifi``), and the benchmarks need only the packages
    themselves (numpy, for the EvalPlus tests)."""
    proc = subprocess.run([sample_python(), "-I", "-c",
                           "import json, site; print(json.dumps(site.getsitepackages()))"],
                          capture_output=True, text=True, timeout=60)
    try:
        return [d for d in json.loads(proc.stdout) if os.path.isdir(d)]
    except ValueError:
        return []


@functools.cache
def _program(entry: str, confine: str) -> bytes:
    """What a sandboxed interpreter runs, compiled once here rather than at every start: its
    ``sys.path``, :mod:`mtp.eval.wire`, :mod:`mtp.eval.sandbox.confine`, :mod:`mtp.eval.inside`,
    then the call of one of the latter's entry points on what ``confine`` (its orders the
    literal `confine`) returns. The sample interpreter is this one's base, so the bytecode
    fits."""
    eval_dir = Path(__file__).parents[1]  # mtp.eval's folder
    source = "\n".join([f"import sys\nsys.path.extend({_site_packages()!r})",
                        (eval_dir / "wire.py").read_text(), confine_source(),
                        (eval_dir / "inside.py").read_text(),
                        f"{entry}(confine(sys.argv[1], {confine}))", ""])
    return marshal.dumps(compile(source, "<mtp.eval.inside>", "exec", dont_inherit=True))


# The interpreter's command line: run the compiled program that lies in its working directory.
_BOOT = "import marshal; exec(marshal.loads(open('.program', 'rb').read()))"


class SandboxedProcess:
    """One sandboxed interpreter of a sample, running an entry point of :mod:`mtp.eval.inside`.

    It gets its own directory (``/tmp`` inside bwrap, and for the completion under unshare),
    its own uid where the isolation gives fresh uids, its orders in ``.orders``, and only the
    pipe ends named in `fds`; `confined`: it runs the completion, so it gets the view of the
    filesystem that :func:`~mtp.eval.sandbox.isolation.wrapper_command` gives untrusted code,
    and a read-only host (:func:`~mtp.eval.sandbox.isolation.confine_orders`).
    """

    def __init__(self, base: str, name: str, entry: str, files: dict[str, str], orders: dict,
                 fds: tuple[int, ...], rlimits: dict, limits: Limits, isolation: Isolation,
                 cgroup: Path | None = None, confined: bool = False) -> None:
        self.tag = "mtp-sample-" + secrets.token_hex(8)
        self.uid = secrets.choice(range(*SAMPLE_UIDS)) if isolation.fresh_uid else None
        self.workdir = os.path.join(base, name)
        self.out_path = os.path.join(base, name + ".out")
        os.mkdir(self.workdir, 0o700)
        if self.uid is not None:
            os.chown(self.workdir, self.uid, self.uid)
        orders = {**orders, "rlimits": rlimits, "uid": self.uid}
        confine = repr(confine_orders(isolation, confined, limits.file_bytes))
        files = {".orders": wire.encode(orders), ".program": _program(entry, confine),
                 **{name: text.encode("utf-8", "surrogatepass") for name, text in files.items()}}
        for file, data in files.items():
            with open(os.path.join(self.workdir, file), "wb") as f:
                f.write(data)
            if self.uid is not None:
                os.chown(os.path.join(self.workdir, file), self.uid, self.uid)
        prefix = wrapper_command(isolation, self.workdir, confined)
        if cgroup is not None:
            prefix = join_cgroup_command(cgroup) + prefix
        inner = "/tmp" if isolation.method == "bwrap" else self.workdir
        cmd = prefix + [sample_python(), "-I", "-S", "-B", "-c", _BOOT, inner, self.tag]
        # Closed to other uids: under a bare process another sample's could read it.
        with open(self.out_path, "wb", opener=lambda p, f: os.open(p, f, 0o600)) as out:
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                pass_fds=fds, start_new_session=True, cwd=self.workdir,
                env=SAMPLE_ENV | {"HOME": self.workdir, "TMPDIR": self.workdir},
            )

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` s for the process to end, leaving it unreaped; True if it did."""
        return _wait_unreaped(self.proc.pid, max(0.0, timeout))

    def alive(self) -> bool:
        """Whether the process is still running."""
        return not self.wait(0)

    def cpu_seconds(self) -> float:
        """CPU seconds of every process in the sandbox, its own and those of the children each
        has reaped: what a per-process limit misses in a sample that forks."""
        table = _processes()
        return sum(table[p][2] for p in _subtree(self.proc.pid, table)) / _TICKS

    def left_running(self) -> int:
        """How many processes the sandbox holds besides the wrappers and the interpreter.

        Counted from ``/proc`` here, not by the sample: the interpreter is the first child of
        the last wrapper (bubblewrap's or unshare's process), found from their executables, which
        the sample cannot change without ending itself."""
        table = _processes()
        chain = [self.proc.pid]
        while _executable(chain[-1]) in _WRAPPERS:
            children = [p for p in table if table[p][0] == chain[-1]]
            if not children:
                break
            chain.append(min(children, key=lambda p: table[p][3]))
        return sum(table[p][1] not in "ZX" for p in _subtree(self.proc.pid, table)
                   if p not in chain)

    def output(self, limit: int) -> str:
        with open(self.out_path, "rb") as f:
            f.seek(max(0, os.path.getsize(self.out_path) - limit))
            return f.read().decode(errors="replace")


def _signal(pids, sig: int) -> None:
    """Send `sig` to each of `pids` that still exists."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def _stop_trees(roots: list[int]) -> set[int]:
    """Stop (SIGSTOP) `roots` and all their descendants, scanning until none is left running:
    a stopped process cannot fork, and its children stay in the tree until it is killed."""
    stopped: set[int] = set()
    for _ in range(100):
        table = _processes()
        pids = {p for r in roots for p in _subtree(r, table)} - stopped
        if not pids:
            break
        _signal(pids, signal.SIGSTOP)
        stopped |= pids
    return stopped


def kill_all(procs: list[SandboxedProcess]) -> list[int]:
    """Kill the processes and everything they started; their exit statuses."""
    # Unreaped until now, their pids (the sessions' ids) cannot have been reused, so the
    # clean-up cannot hit a stranger. The trees are stopped first: a process killed before its
    # children would leave them to the host's init, out of reach of the tree.
    _signal(_stop_trees([p.proc.pid for p in procs]), signal.SIGKILL)
    for p in procs:
        try:
            os.killpg(p.proc.pid, signal.SIGKILL)
        except OSError:
            pass
    _kill_leftovers([(p.uid, p.proc.pid, p.tag) for p in procs])
    return [p.proc.wait() for p in procs]

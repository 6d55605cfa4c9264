"""Run untrusted completions: completion and tests in separate sandboxed interpreters.

**Two processes per sample.** The completion runs in one fresh ``python -I -S``; the benchmark's
tests run in another that never executes completion code. The tests reach the functions they call
(the entry point) through proxies: each call crosses a pipe as a message, is answered by the
completion's process, and its result crosses back (:mod:`mtp.eval.inside`, :mod:`mtp.eval.wire`).
Arguments and results cross as plain data only (None, bool, int, float, complex, str, bytes, and
lists, tuples, dicts, sets and frozensets of them, matched by exact type), rebuilt on arrival as
fresh builtin objects; anything else fails the sample with its type named. Exceptions the
completion raises reach the tests as exceptions of the nearest builtin class, with their args.
The tests' process reports to the harness on a pipe of its own, which the completion never
holds; the harness decides with both processes' exit statuses. So none of these can pass:

* a value that lies about equality (an object whose ``__eq__`` is always true, or a subclass of
  ``int`` or ``str`` with one): it cannot cross;
* reading or rewriting the harness's memory, walking frames or the heap: the harness is not in
  the completion's process, and the verdict channel is not among its descriptors;
* patching builtins or modules, a trace function that skips ``assert``: they change the
  completion's interpreter only;
* exiting early (``os._exit(0)``), writing fake verdicts on every descriptor, or printing a
  marker: the tests see a broken channel, and a broken channel fails the sample whatever the
  tests do with the exception (``except BaseException`` included);
* leaving a background process: the completion's process counts and kills the others at the end
  (the PID namespace or the per-sample uid kills them in any case).

Tasks whose tests need more than calls (MBPP task 367 builds its inputs from the completion's
``Node`` class) run with ``shared=True``: completion, then tests, in one interpreter, with a
random token the verdict must carry, the builtins and the tests' modules snapshotted and
compared, and an audit hook on trace functions. That design does not close the two holes above
(a completion that walks frames finds the token); :mod:`mtp.eval.execution` decides which tasks
need it, and the results mark them.

**Layers**, outermost first (``bwrap`` mode), for each of the two interpreters:

* bubblewrap: read-only bind of ``/``; ``/root``, ``/home``, ``/run`` ... hidden under read-only
  tmpfs (the Python installation is bound back when it lives there); a private working directory
  mounted at ``/tmp``; fresh ``/dev`` and ``/proc``; new PID, network, IPC, UTS and cgroup
  namespaces (so there is no network, and everything the sample starts dies with it);
  ``--die-with-parent``, ``--new-session``, ``--clearenv`` and ``no_new_privs``.
* A fresh uid per interpreter when the harness runs as root (a random unprivileged uid, dropped
  to before any untrusted code runs). The kernel exempts root from ``RLIMIT_NPROC``, so this is
  what lets that limit bound a fork bomb (without root, bwrap's fresh user namespace does, since
  its process count starts from zero); it also means the sample can signal nothing but its own
  processes, and cannot reach the tests' process, which is in another PID namespace too.
* Resource limits: address space, CPU time (``Limits.cpu_seconds``, per task from
  :mod:`mtp.eval.execution`), file size, open files, processes, no core dumps; a memory cgroup
  for all the completion's processes together where one can be made (``Isolation.memory_cgroup``:
  cgroup v2, else the v1 memory hierarchy); plus a wall-clock backstop enforced from outside and
  capped captured output.

Where bubblewrap is missing or refused, :func:`detect_isolation` falls back to ``unshare`` (new
PID + network namespaces), then to a bare process in its own session; it warns once and the
result says which isolation held. In the ``process`` fallback without a fresh uid the
completion runs as the harness's user and could reach the tests' process (and the host).

Limits of the isolation: without a memory cgroup, memory is bounded per process (address
space), so a fork bomb that also allocates can reach ``processes x memory_bytes``; disk use in
the private directory is bounded per file, not in total; in the weakest fallback (``process``,
no PID namespace, no fresh uid) a double-forked process that calls ``setsid`` and ``exec``
escapes the clean-up. The completion's sandbox sees the read-only root, benchmark files
included, except the directories `run_program` is told to hide: the harness hides the
benchmark's own data (:func:`mtp.eval.execution.data_paths`), so a completion cannot look its
answers up there.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import marshal
import math
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from mtp.eval import wire

__all__ = ["ExecResult", "Isolation", "Limits", "detect_isolation", "run_program"]

# Directories hidden from the sample (secrets, sockets, other users' files). Those that hold the
# Python installation are bound back read-only.
_MASKED_DIRS = ("/root", "/home", "/run", "/var/run", "/var/tmp", "/mnt", "/media", "/srv")
# Per-sample uids are drawn from a range that no distribution allocates to real users.
_UID_RANGE = (2_000_000_000, 2_100_000_000)
_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    # Math libraries otherwise start one thread per core; threads count against RLIMIT_NPROC.
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


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


@dataclass(frozen=True)
class Isolation:
    """Which isolation holds for the samples of a run (recorded in ``summary.json``)."""

    method: str
    """``bwrap``, ``unshare`` or ``process``."""
    read_only_root: bool
    network_isolated: bool
    pid_namespace: bool
    private_tmp: bool
    fresh_uid: bool
    """Each sample runs as its own unprivileged uid (only when the harness runs as root)."""
    process_limit: bool
    """RLIMIT_NPROC bounds fork bombs: the kernel exempts root, so this needs a fresh uid, or a
    fresh user namespace (its process count starts from zero) when the harness is not root."""
    note: str = ""
    memory_cgroup: str = ""
    """``cgroup2`` or ``cgroup1``: each sample's processes share one memory limit in a cgroup of
    their own; empty where no memory cgroup can be made (the per-process limit still holds)."""

    def to_dict(self) -> dict:
        """Return the fields as a JSON-ready dict."""
        return asdict(self)


@dataclass(frozen=True)
class ExecResult:
    """What happened to one sample."""

    passed: bool
    outcome: str
    """``passed``, ``failed``, ``timeout`` or ``error`` (the harness itself could not run it)."""
    error: str
    """Why it did not pass ("" when it passed)."""
    duration: float
    output: str
    """The end of the sample's stdout and stderr, at most ``Limits.output_bytes``."""
    tag: str
    """A random string on the sample's command line, to find stray processes with ``ps``."""
    cpu: float | None = None
    """CPU seconds the completion's process reported using, when it passed. Self-reported, so
    only trustworthy for trusted code: the time limits are calibrated on reference solutions."""


_detected: dict[str, Isolation] = {}
_warned = False


def _sample_python() -> str:
    """The base interpreter behind this one: samples need the standard library only, and a
    virtual environment may live where the sandbox hides it (under /tmp, say, which becomes the
    sample's private directory)."""
    return str(Path(getattr(sys, "_base_executable", sys.executable)).resolve())


def _python_dirs() -> list[str]:
    """Directories the interpreter needs, to bind back when they sit under a masked directory."""
    dirs = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    dirs.add(str(Path(sys.executable).resolve().parent.parent))
    return sorted(d for d in dirs if d)


def _is_under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _hideable(path: str, python_dirs: list[str]) -> bool:
    """Whether a directory can be hidden from a sample: below the top level, and holding no
    part of the Python installation (masking `/usr` would leave the interpreter without its
    libraries)."""
    return (os.path.isdir(path) and not os.path.islink(path) and path.count("/") >= 2
            and not any(_is_under(d, path) for d in python_dirs))


def _bwrap_command(workdir: str, as_root: bool, hide: Sequence[str] = ()) -> list[str]:
    cmd = ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
    python_dirs = _python_dirs()
    hidden = sorted({d for d in (os.path.realpath(h) for h in hide) if _hideable(d, python_dirs)})
    # the outermost only: a directory inside one already hidden (or masked) is hidden with it
    hidden = [d for d in hidden if not any(_is_under(d, o) and d != o
                                           for o in [*_MASKED_DIRS, *hidden])]
    for masked in [*_MASKED_DIRS, *hidden]:
        if not os.path.isdir(masked) or os.path.islink(masked):
            continue
        cmd += ["--tmpfs", masked]
        for d in python_dirs:
            if _is_under(d, masked) and d != masked:
                # bwrap would create the missing parents with mode 0700, closed to the sample uid.
                parents = [str(p) for p in Path(d).parents if _is_under(str(p), masked)]
                for parent in reversed(parents):
                    if parent != masked:
                        cmd += ["--perms", "0755", "--dir", parent]
                cmd += ["--ro-bind", d, d]
        cmd += ["--remount-ro", masked]
    cmd += ["--bind", workdir, "/tmp", "--chdir", "/tmp", "--setenv", "HOME", "/tmp",
            "--setenv", "TMPDIR", "/tmp"]
    cmd += ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--hostname", "sandbox", "--die-with-parent", "--new-session"]
    if as_root:
        # Enough to drop to the per-sample uid; no_new_privs stops setuid binaries regaining it.
        cmd += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        cmd += ["--unshare-user"]
    cmd += ["--clearenv"]
    for key, value in _ENV.items():
        cmd += ["--setenv", key, value]
    return cmd + ["--"]


def _unshare_command() -> list[str]:
    cmd = ["unshare", "--pid", "--net", "--ipc", "--uts", "--fork", "--kill-child",
           "--mount-proc"]
    if os.geteuid() != 0:
        cmd.append("--map-root-user")
    return cmd + ["--"]


def _python_readable_by_others() -> bool:
    """Whether an unprivileged uid could run this interpreter (every directory world-searchable)."""
    for d in _python_dirs() + [str(Path(sys.executable).resolve().parent)]:
        path = Path(d)
        for p in [path, *path.parents]:
            try:
                if not p.stat().st_mode & 0o001:
                    return False
            except OSError:
                return False
    return True


def detect_isolation(requested: str = "auto") -> Isolation:
    """Find the strongest isolation that works here, trying it for real once per process.

    Args:
        requested: ``auto`` (strongest available), or force ``bwrap``, ``unshare`` or ``process``.

    Returns:
        The isolation that the samples of this process will get.

    Raises:
        RuntimeError: If a forced method does not work here.
    """
    global _warned
    if requested in _detected:
        return _detected[requested]
    as_root = os.geteuid() == 0
    order = ["bwrap", "unshare", "process"] if requested == "auto" else [requested]
    if requested not in ("auto", "bwrap", "unshare", "process"):
        raise ValueError(f"unknown isolation {requested!r}; use auto, bwrap, unshare or process")
    failures = []
    for method in order:
        ok, why = _probe(method, as_root)
        if ok:
            break
        failures.append(f"{method}: {why}")
    else:
        raise RuntimeError(f"isolation {requested!r} does not work here: {'; '.join(failures)}")
    fresh_uid = as_root and (method == "bwrap" or _python_readable_by_others())
    nproc = fresh_uid or (not as_root and method != "process")
    note = "; ".join(failures)
    if method == "bwrap":
        iso = Isolation("bwrap", True, True, True, True, fresh_uid, nproc, note)
    elif method == "unshare":
        iso = Isolation("unshare", False, True, True, False, fresh_uid, nproc, note)
    else:
        if as_root and not fresh_uid:
            note += ("; samples run as root with no namespaces: a hostile sample can harm the "
                     "host (install bubblewrap)")
        iso = Isolation("process", False, False, False, False, fresh_uid, nproc, note.lstrip("; "))
    if method != "bwrap" and requested == "auto" and not _warned:
        _warned = True
        warnings.warn(f"bubblewrap is unavailable ({note}); samples run with weaker isolation: "
                      f"{iso}", RuntimeWarning, stacklevel=2)
    iso = dataclasses.replace(iso, memory_cgroup=_cgroups().kind)
    _detected[requested] = iso
    return iso


def _probe(method: str, as_root: bool) -> tuple[bool, str]:
    if method == "process":
        return True, ""
    tool = "bwrap" if method == "bwrap" else "unshare"
    if shutil.which(tool) is None:
        return False, f"{tool} not found"
    with tempfile.TemporaryDirectory(prefix="mtp-probe-") as d:
        prefix = _bwrap_command(d, as_root) if method == "bwrap" else _unshare_command()
        try:
            proc = subprocess.run(prefix + [_sample_python(), "-I", "-c", "pass"],
                                  stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            return False, str(e)
    if proc.returncode != 0:
        return False, proc.stderr.decode(errors="replace").strip()[:300] or f"rc {proc.returncode}"
    return True, ""


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
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
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


def _rmtree(path: str) -> None:
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
    processing of ``.pth`` files can cost more than the rest of a sample (70 ms of 120 on a
    machine whose ``.pth`` imports ``certifi``), and the benchmarks need only the packages
    themselves (numpy, for the EvalPlus tests)."""
    proc = subprocess.run([_sample_python(), "-I", "-c",
                           "import json, site; print(json.dumps(site.getsitepackages()))"],
                          capture_output=True, text=True, timeout=60)
    try:
        return [d for d in json.loads(proc.stdout) if os.path.isdir(d)]
    except ValueError:
        return []


@functools.cache
def _program(entry: str) -> bytes:
    """What a sandboxed interpreter runs, compiled once here (5 ms a start saved): its
    ``sys.path``, :mod:`mtp.eval.wire`, :mod:`mtp.eval.inside`, then the call of one of the
    latter's entry points. The sample interpreter is this one's base, so the bytecode fits."""
    here = Path(__file__).parent
    source = "\n".join([f"import sys\nsys.path.extend({_site_packages()!r})",
                        (here / "wire.py").read_text(), (here / "inside.py").read_text(),
                        f"{entry}(sys.argv[1])", ""])
    return marshal.dumps(compile(source, "<mtp.eval.inside>", "exec", dont_inherit=True))


# The interpreter's command line: run the compiled program that lies in its working directory.
_BOOT = "import marshal; exec(marshal.loads(open('.program', 'rb').read()))"


class _MemoryCgroup:
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


_memory_cgroups: _MemoryCgroup | None = None


def _cgroups() -> _MemoryCgroup:
    global _memory_cgroups
    if _memory_cgroups is None:
        _memory_cgroups = _MemoryCgroup()
    return _memory_cgroups


# Joins the cgroup named by $1, then becomes the rest of the command line.
_JOIN_CGROUP = 'echo $$ > "$1/cgroup.procs" && shift && exec "$@"'


class _Process:
    """One sandboxed interpreter of a sample, running an entry point of :mod:`mtp.eval.inside`.

    It gets its own directory (``/tmp`` inside bwrap), its own uid where the isolation gives
    fresh uids, its orders in ``.orders``, and only the pipe ends named in `fds`.
    """

    def __init__(self, base: str, name: str, entry: str, files: dict[str, str], orders: dict,
                 fds: tuple[int, ...], rlimits: dict, limits: Limits, isolation: Isolation,
                 cgroup: Path | None = None, hide: Sequence[str] = ()) -> None:
        self.tag = "mtp-sample-" + secrets.token_hex(8)
        self.uid = secrets.choice(range(*_UID_RANGE)) if isolation.fresh_uid else None
        self.workdir = os.path.join(base, name)
        self.out_path = os.path.join(base, name + ".out")
        os.mkdir(self.workdir, 0o700)
        if self.uid is not None:
            os.chown(self.workdir, self.uid, self.uid)
        scope = "all" if isolation.pid_namespace else ("uid" if self.uid is not None
                                                       else "session")
        orders = {**orders, "rlimits": rlimits, "uid": self.uid, "proc_scope": scope}
        files = {".orders": wire.encode(orders), ".program": _program(entry),
                 **{name: text.encode("utf-8", "surrogatepass") for name, text in files.items()}}
        for file, data in files.items():
            with open(os.path.join(self.workdir, file), "wb") as f:
                f.write(data)
            if self.uid is not None:
                os.chown(os.path.join(self.workdir, file), self.uid, self.uid)
        if isolation.method == "bwrap":
            prefix = _bwrap_command(self.workdir, os.geteuid() == 0, hide)
        elif isolation.method == "unshare":
            prefix = _unshare_command()
        else:
            prefix = []
        if cgroup is not None:
            prefix = ["/bin/sh", "-c", _JOIN_CGROUP, "sh", str(cgroup), *prefix]
        inner = "/tmp" if isolation.method == "bwrap" else self.workdir
        cmd = prefix + [_sample_python(), "-I", "-S", "-B", "-c", _BOOT, inner, self.tag]
        with open(self.out_path, "wb") as out:
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                pass_fds=fds, start_new_session=True, cwd=self.workdir,
                env=_ENV | {"HOME": self.workdir, "TMPDIR": self.workdir},
            )

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` s for the process to end, leaving it unreaped; True if it did."""
        return _wait_unreaped(self.proc.pid, max(0.0, timeout))


    def output(self, limit: int) -> str:
        with open(self.out_path, "rb") as f:
            f.seek(max(0, os.path.getsize(self.out_path) - limit))
            return f.read().decode(errors="replace")


def _kill(procs: list[_Process]) -> list[int]:
    """Kill the processes and everything they started; their exit statuses."""
    # Unreaped until now, their pids (the sessions' ids) cannot have been reused, so the
    # clean-up cannot hit a stranger.
    for p in procs:
        try:
            os.killpg(p.proc.pid, signal.SIGKILL)
        except OSError:
            pass
    _kill_leftovers([(p.uid, p.proc.pid, p.tag) for p in procs])
    return [p.proc.wait() for p in procs]


def _rlimits(limits: Limits, cpu: float, processes: bool) -> dict[str, tuple[int, int]]:
    # SIGXCPU at the soft CPU limit (it ends the process, and tells a CPU timeout apart from a
    # memory kill); SIGKILL a second later for a process that catches it.
    soft = max(1, math.ceil(cpu))
    out = {"RLIMIT_AS": limits.memory_bytes, "RLIMIT_CPU": (soft, soft + 1),
           "RLIMIT_FSIZE": limits.file_bytes, "RLIMIT_NOFILE": limits.open_files,
           "RLIMIT_CORE": 0}
    if processes:
        out["RLIMIT_NPROC"] = limits.processes
    return {k: v if isinstance(v, tuple) else (v, v) for k, v in out.items()}


def _read_all(fd: int) -> bytes:
    os.set_blocking(fd, False)
    data = b""
    try:
        while chunk := os.read(fd, 1 << 16):
            data += chunk
    except BlockingIOError:
        pass
    return data


def _death(returncode: int, isolation: Isolation) -> str:
    """Why a process ended, from its exit status ('' for a plain exit)."""
    sig = -returncode if returncode < 0 else (returncode - 128 if returncode > 128
                                              and isolation.method != "process" else 0)
    if not sig:
        return ""
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def run_program(
    candidate: str,
    test: str,
    *,
    entry_point: str = "",
    proxied: Sequence[str] | None = None,
    helpers: str = "",
    shared: bool = False,
    limits: Limits | None = None,
    isolation: Isolation | None = None,
    hide: Sequence[str] = (),
) -> ExecResult:
    """Run one sample in fresh sandboxed interpreters and report whether its tests passed.

    By default completion and tests run in two processes (see the module's docstring); the
    verdict is the tests' report, read here with both processes' exit statuses.

    Args:
        candidate: Untrusted program (for HumanEval: prompt + completion; for MBPP: the
            completion). It runs as module ``candidate``, so ``if __name__ == "__main__"`` blocks
            are skipped.
        test: Trusted test program; it must raise if the sample is wrong.
        entry_point: The function the tests call.
        proxied: The names the tests take from the completion, each a function called across
            the pipe (default: the entry point).
        helpers: Trusted code run before the tests in their namespace (HumanEval's prompt, whose
            helper functions some tests call); the completion cannot replace them.
        shared: Run the completion and the tests in one interpreter instead, with the tests in a
            namespace holding the candidate's globals and untouched builtins (for tasks whose
            tests need more than calls).
        limits: Resource limits (defaults: :class:`Limits`).
        isolation: From :func:`detect_isolation` (default: the strongest available).
        hide: Directories the completion's sandbox shows empty (bwrap only): where the
            benchmark's data lies, so that a completion cannot look its answers up.

    Returns:
        The result; ``passed`` only if the tests ran to the end.
    """
    limits = limits or Limits()
    isolation = isolation or detect_isolation()
    cpu = limits.cpu_seconds or limits.timeout
    base = tempfile.mkdtemp(prefix="mtp-sbx-")
    pipes: list[int] = []
    procs: list[_Process] = []
    cgroup = None
    start = time.monotonic()
    try:
        result_r, result_w = os.pipe()
        pipes += [result_r, result_w]
        cgroup = _cgroups().create("mtp-" + secrets.token_hex(8), limits.memory_bytes)
        if shared:
            token = secrets.token_hex(16)
            procs.append(_Process(
                base, "sample", "run_shared", {"candidate.py": candidate, "test.py": test},
                {"result_fd": result_w, "token": token, "entry_point": entry_point},
                (result_w,), _rlimits(limits, cpu, isolation.process_limit), limits, isolation,
                cgroup, hide))
        else:
            calls_r, calls_w = os.pipe()  # tests -> completion
            replies_r, replies_w = os.pipe()  # completion -> tests
            pipes += [calls_r, calls_w, replies_r, replies_w]
            procs.append(_Process(
                base, "candidate", "serve_candidate", {"candidate.py": candidate},
                {"calls_fd": calls_r, "replies_fd": replies_w}, (calls_r, replies_w),
                _rlimits(limits, cpu, isolation.process_limit), limits, isolation, cgroup, hide))
            procs.append(_Process(
                base, "tests", "run_tests", {"test.py": test, "helpers.py": helpers},
                {"calls_fd": calls_w, "replies_fd": replies_r, "result_fd": result_w,
                 "proxied": list(proxied if proxied is not None else [entry_point])},
                (calls_w, replies_r, result_w),
                # the tests' own process: no CPU limit below the wall clock's
                _rlimits(limits, limits.timeout, isolation.process_limit), limits, isolation))
        for fd in pipes[1:]:  # the children hold their ends now
            os.close(fd)
        pipes = pipes[:1]
        judge = procs[-1]  # the process whose report is the verdict
        timed_out = not judge.wait(start + limits.timeout - time.monotonic())
        channel = _read_all(result_r)
        found = wire.messages(channel)
        # The tests saw the completion's process end: wait (briefly) to learn how, from its
        # exit status (the outer sandbox process may trail its child by a moment).
        ended = bool(found) and found[-1].get("ended") is True
        candidate_ended = procs[0].wait(5.0 if ended and not timed_out else 0)
        statuses = _kill(procs)  # whatever happened, nothing of the sample survives
        duration = time.monotonic() - start
        output = "".join(p.output(limits.output_bytes) for p in procs[:1])[-limits.output_bytes:]
    except OSError as e:
        _kill(procs)
        return ExecResult(False, "error", f"could not run the sample: {e}",
                          time.monotonic() - start, "", procs[0].tag if procs else "")
    finally:
        for fd in pipes:
            os.close(fd)
        _MemoryCgroup.remove(cgroup)
        _rmtree(base)

    tag = procs[0].tag
    death = _death(statuses[0], isolation) if candidate_ended else ""
    if timed_out:
        return ExecResult(False, "timeout", f"timed out after {limits.timeout:g} s", duration,
                          output, tag)
    if death == "SIGXCPU":
        return ExecResult(False, "timeout", f"used more than {math.ceil(cpu)} s of CPU",
                          duration, output, tag)
    # The last message on the channel is the verdict; in shared mode the completion shares the
    # channel, so a pass must also carry the token it never saw.
    verdict = found[-1] if found and found[-1].get("status") in ("passed", "failed", "error") \
        else None
    passed = (verdict is not None and verdict["status"] == "passed" and statuses[-1] == 0
              and (not shared or verdict.get("token") == token))
    if passed:
        cpu = verdict.get("cpu")
        return ExecResult(True, "passed", "", duration, output, tag,
                          cpu if type(cpu) is float else None)
    if verdict is not None and verdict["status"] in ("failed", "error"):
        why = str(verdict.get("detail", ""))
        if death and not shared:
            why += f" (the completion's process was killed by {death})"
        return ExecResult(False, verdict["status"], why, duration, output, tag)
    death = _death(statuses[-1], isolation)
    if death:
        why = f"killed by {death}" + (" (resource limit?)" if death == "SIGKILL" else "")
    elif statuses[-1] == 0:
        why = "exited with status 0 before the tests finished"
    else:
        why = f"exited with status {statuses[-1]} before the tests finished"
    return ExecResult(False, "failed", why, duration, output, tag)

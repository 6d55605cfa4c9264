"""Run untrusted completions: one fresh ``python -I`` per sample, inside bubblewrap when possible.

Layers, outermost first (``bwrap`` mode):

* bubblewrap: read-only bind of ``/``; ``/root``, ``/home``, ``/run`` ... hidden under read-only
  tmpfs (the Python installation is bound back when it lives there); a private working directory
  mounted at ``/tmp``; fresh ``/dev`` and ``/proc``; new PID, network, IPC, UTS and cgroup
  namespaces (so there is no network, and everything the sample starts dies with it);
  ``--die-with-parent``, ``--new-session``, ``--clearenv`` and ``no_new_privs``.
* A fresh uid per sample when the harness runs as root (a random unprivileged uid, dropped to by
  the wrapper before any untrusted code runs). The kernel exempts root from ``RLIMIT_NPROC``, so
  this is what lets that limit bound a fork bomb (without root, bwrap's fresh user namespace
  does, since its process count starts from zero); it also means the sample can signal nothing
  but its own processes.
* Resource limits set by the wrapper: address space, CPU time, file size, open files, processes,
  no core dumps; plus a wall-clock timeout enforced from outside and capped captured output.

Where bubblewrap is missing or refused, :func:`detect_isolation` falls back to ``unshare`` (new
PID + network namespaces), then to a bare process in its own session; it warns once and the
result says which isolation held.

How a sample passes. The parent writes a random token into a file the wrapper reads and deletes
before the completion runs; the wrapper writes ``PASS <token>`` to a private pipe only after the
tests returned, and the parent requires that line *and* exit status 0. That closes the ways a
completion could fake a pass:

* exiting early with status 0 (``os._exit(0)``, ``sys.exit(0)``): no token was written;
* printing a marker: stdout is not the result channel, and the token is unknown to it;
* patching builtins or test modules: the tests run in their own namespace with a copy of the
  builtins taken before the completion ran, and any change to the builtins or to a module the
  tests import (or a replaced ``sys.modules`` entry) fails the sample;
* skipping ``assert``: the tests are compiled with ``optimize=0`` whatever the flags, and an
  audit hook fails any sample that installs a trace or profile function (which could jump over
  lines);
* leaving a background process: the wrapper fails the sample if any other live process of the
  sandbox exists when the tests end, and the PID namespace (or the per-sample uid) kills it.

Limits of the isolation: memory is bounded per process (address space), so a fork bomb that
also allocates can reach ``processes x memory_bytes`` in the worst case (no cgroup is used);
disk use in the private directory is bounded per file, not in total; in the weakest fallback
(``process``, no PID namespace, no fresh uid) a double-forked process that calls ``setsid`` and
``exec`` escapes the clean-up.

What is not closed: code written against this harness's internals (walking the interpreter's
frames to read the token) and return values that lie about equality (an object whose ``__eq__``
is always true). Those need a different test design, not a stronger sandbox; the host stays safe
either way.
"""

from __future__ import annotations

import json
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
from dataclasses import asdict, dataclass
from pathlib import Path

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
    cpu_seconds: int | None = None
    """RLIMIT_CPU; None means the timeout rounded up."""
    memory_bytes: int = 2 << 30
    """RLIMIT_AS, per process."""
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


# The wrapper runs first inside the sandbox, as ``python -I -B -c _WRAPPER WORKDIR TAG``. It is
# trusted code: it reads its orders, drops privileges, then runs the completion and the tests.
_WRAPPER = r'''
import os, sys

def _harness(workdir):
    import ast, builtins, importlib, json, resource, types

    spec_path = os.path.join(workdir, ".harness.json")
    with open(spec_path) as f:
        spec = json.load(f)
    os.unlink(spec_path)
    fd, token, entry_point = spec["result_fd"], spec["token"], spec["entry_point"]

    def reap():
        """Kill and count the other live processes of this sample."""
        me, found = os.getpid(), []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in (me, 1):
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read().rsplit(")", 1)[1].split()
                uid = os.stat(f"/proc/{entry}").st_uid
            except OSError:
                continue
            ppid, sid = int(stat[1]), int(stat[3])
            mine = (spec["proc_scope"] == "all" or ppid == me or sid == os.getsid(0)
                    or (spec["proc_scope"] == "uid" and uid == os.getuid()))
            if mine and stat[0] not in "ZX":
                found.append(int(entry))
                try:
                    os.kill(int(entry), 9)
                except OSError:
                    pass
        return len(found)

    def finish(status, detail):
        try:
            reap()
        finally:
            os.write(fd, (json.dumps({"status": status, "detail": detail[-2000:]}) + "\n"
                          ).encode())
            os._exit(1)

    for name, value in spec["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (value, value))
    if spec["uid"] is not None:
        os.setgroups([])
        os.setgid(spec["uid"])
        os.setuid(spec["uid"])
        if os.getuid() == 0 or os.geteuid() == 0:
            finish("error", "could not drop root")
    os.chdir(workdir)

    with open("candidate.py") as f:
        candidate_src = f.read()
    with open("test.py") as f:
        test_src = f.read()
    os.unlink("test.py")
    test_code = compile(test_src, "test.py", "exec", dont_inherit=True, optimize=0)
    try:
        candidate_code = compile(candidate_src, "candidate.py", "exec", dont_inherit=True,
                                 optimize=0)
    except BaseException as e:
        finish("failed", f"{type(e).__name__}: {e}")

    # The modules the tests import, loaded now so a snapshot can prove them untouched later.
    guarded = {"builtins": builtins}
    for node in ast.walk(ast.parse(test_src)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module]
        else:
            continue
        for name in names:
            try:
                importlib.import_module(name)
            except BaseException:
                continue  # the test will fail on it in its own words
            parts = name.split(".")
            for i in range(1, len(parts) + 1):
                sub = ".".join(parts[:i])
                if sub != "sys" and sub in sys.modules:
                    guarded[sub] = sys.modules[sub]
    snapshot = {name: dict(vars(mod)) for name, mod in guarded.items()}

    def tampering():
        for name, mod in guarded.items():
            if sys.modules.get(name) is not mod:
                return f"replaced module {name!r}"
            now = vars(mod)
            for key, value in snapshot[name].items():
                if now.get(key, tampering) is not value:
                    return f"changed {name}.{key}"
        return ""

    hooked = []

    def audit(event, args):
        if event in ("sys.settrace", "sys.setprofile"):
            hooked.append(event)

    sys.addaudithook(audit)

    module = types.ModuleType("candidate")
    module.__file__ = os.path.join(workdir, "candidate.py")
    sys.modules["candidate"] = module
    try:
        exec(candidate_code, vars(module))
    except BaseException as e:
        finish("failed", f"{type(e).__name__}: {e}")

    pristine = snapshot["builtins"]
    ns = {k: v for k, v in vars(module).items()
          if not k.startswith("__") and (k not in pristine or k == entry_point)}
    ns.update(__builtins__=dict(pristine), __name__="__test__")
    try:
        exec(test_code, ns)
    except BaseException as e:
        finish("failed", f"{type(e).__name__}: {e}")

    if hooked:
        finish("failed", f"the completion called {hooked[0]}")
    problem = tampering()
    if problem:
        finish("failed", f"the completion tampered with the test environment: {problem}")
    left = reap()
    if left:
        finish("failed", f"left {left} process(es) running")
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except BaseException:
            pass
    os.write(fd, f"PASS {token}\n".encode())
    os._exit(0)

_harness(sys.argv[1])
'''


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


def _bwrap_command(workdir: str, as_root: bool) -> list[str]:
    cmd = ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
    python_dirs = _python_dirs()
    for masked in _MASKED_DIRS:
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


def _kill_leftovers(uid: int | None, sid: int, tag: str) -> None:
    """Kill every process of the sample and wait until they are gone.

    A process belongs to the sample if it runs as the sample's uid, sits in its session, or
    carries its tag on the command line (the sandbox's own init process, which the kernel is
    already tearing down once the outer bwrap exits, but not synchronously). Loops because a fork
    bomb can outrun a single pass over ``/proc``.
    """
    needle = tag.encode()
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
                if owner != uid and int(fields[3]) != sid:
                    with open(f"/proc/{entry}/cmdline", "rb") as f:
                        if needle not in f.read():
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


def run_program(
    candidate: str,
    test: str,
    *,
    entry_point: str = "",
    limits: Limits | None = None,
    isolation: Isolation | None = None,
) -> ExecResult:
    """Run one sample in a fresh sandboxed interpreter and report whether its tests passed.

    Args:
        candidate: Untrusted program (for HumanEval: prompt + completion; for MBPP: the
            completion). It runs as module ``candidate``, so ``if __name__ == "__main__"`` blocks
            are skipped.
        test: Trusted test program, run afterwards in a namespace holding the candidate's globals
            and untouched builtins; it must raise if the sample is wrong.
        entry_point: Name the tests call; kept even if it shadows a builtin.
        limits: Resource limits (defaults: :class:`Limits`).
        isolation: From :func:`detect_isolation` (default: the strongest available).

    Returns:
        The result; ``passed`` only if the tests ran to the end.
    """
    limits = limits or Limits()
    isolation = isolation or detect_isolation()
    tag = "mtp-sample-" + secrets.token_hex(8)
    token = secrets.token_hex(16)
    uid = secrets.choice(range(*_UID_RANGE)) if isolation.fresh_uid else None
    base = tempfile.mkdtemp(prefix="mtp-sbx-")
    workdir = os.path.join(base, "work")
    os.mkdir(workdir, 0o700)
    read_fd, write_fd = os.pipe()
    start = time.monotonic()
    try:
        if uid is not None:
            os.chown(workdir, uid, uid)
        inner_dir = "/tmp" if isolation.method == "bwrap" else workdir
        cpu = limits.cpu_seconds or int(limits.timeout + 0.999)
        rlimits = {"RLIMIT_AS": limits.memory_bytes, "RLIMIT_CPU": cpu,
                   "RLIMIT_FSIZE": limits.file_bytes, "RLIMIT_NOFILE": limits.open_files,
                   "RLIMIT_CORE": 0}
        if isolation.process_limit:
            rlimits["RLIMIT_NPROC"] = limits.processes
        scope = "all" if isolation.pid_namespace else ("uid" if uid is not None else "session")
        spec = {"result_fd": write_fd, "token": token, "entry_point": entry_point,
                "rlimits": rlimits, "uid": uid, "proc_scope": scope}
        for name, text in ((".harness.json", json.dumps(spec)), ("candidate.py", candidate),
                           ("test.py", test)):
            with open(os.path.join(workdir, name), "w") as f:
                f.write(text)
            if uid is not None:
                os.chown(os.path.join(workdir, name), uid, uid)
        if isolation.method == "bwrap":
            prefix = _bwrap_command(workdir, os.geteuid() == 0)
        elif isolation.method == "unshare":
            prefix = _unshare_command()
        else:
            prefix = []
        cmd = prefix + [_sample_python(), "-I", "-B", "-c", _WRAPPER, inner_dir, tag]
        out_path = os.path.join(base, "output")
        with open(out_path, "wb") as out:
            try:
                proc = subprocess.Popen(
                    cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                    pass_fds=(write_fd,), start_new_session=True, cwd=workdir,
                    env=_ENV | {"HOME": workdir, "TMPDIR": workdir},
                )
            except OSError as e:
                return ExecResult(False, "error", f"could not start the sandbox: {e}",
                                  time.monotonic() - start, "", tag)
            os.close(write_fd)
            write_fd = -1
            # Wait without reaping: until the process is reaped its pid, which is also the
            # sample's session id, cannot be reused, so the clean-up below cannot hit a stranger.
            timed_out = not _wait_unreaped(proc.pid, limits.timeout)
            # Whatever happened, nothing of the sample may survive it.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            _kill_leftovers(uid, proc.pid, tag)
            returncode = proc.wait()
        duration = time.monotonic() - start
        os.set_blocking(read_fd, False)
        channel = b""
        try:
            while chunk := os.read(read_fd, 1 << 16):
                channel += chunk
        except BlockingIOError:
            pass
        with open(out_path, "rb") as f:
            f.seek(max(0, os.path.getsize(out_path) - limits.output_bytes))
            output = f.read().decode(errors="replace")
    finally:
        os.close(read_fd)
        if write_fd >= 0:
            os.close(write_fd)
        _rmtree(base)

    lines = channel.decode(errors="replace").splitlines()
    if timed_out:
        return ExecResult(False, "timeout", f"timed out after {limits.timeout:g} s", duration,
                          output, tag)
    if returncode == 0 and lines and lines[-1] == f"PASS {token}":
        return ExecResult(True, "passed", "", duration, output, tag)
    verdict = None
    for line in reversed(lines):
        try:
            verdict = json.loads(line)
            break
        except ValueError:
            continue
    if isinstance(verdict, dict) and verdict.get("status") in ("failed", "error"):
        return ExecResult(False, verdict["status"], str(verdict.get("detail", "")), duration,
                          output, tag)
    if returncode < 0:
        why = f"killed by {signal.Signals(-returncode).name}"
    elif returncode > 128 and isolation.method == "bwrap":
        why = f"killed by signal {returncode - 128} (resource limit?)"
    elif returncode == 0:
        why = "exited with status 0 before the tests finished"
    else:
        why = f"exited with status {returncode} before the tests finished"
    return ExecResult(False, "failed", why, duration, output, tag)

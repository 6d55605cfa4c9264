"""Which isolation a sample gets: bubblewrap, unshare or a bare process, found by trying each.

Holds the :class:`Isolation` record, :func:`detect_isolation`, the command line that wraps a
sandboxed interpreter (:func:`wrapper_command`): bubblewrap's or unshare's, and what
:mod:`~mtp.eval.sandbox.confine` does first in each interpreter (:func:`confine_orders`). Under
bubblewrap the completion's interpreter sees the filesystem by allow-list (:func:`confined_view`:
the system's programs and libraries, the interpreter's standard library and `SAMPLE_PACKAGES`, a
private ``/tmp``, its own ``/proc``); the tests' interpreter, trusted, sees the root read-only
with the directories of secrets masked. Under the fallbacks the host is made read-only for the
completion by :mod:`~mtp.eval.sandbox.confine`, checked here once with a write that must fail
(:func:`detect_isolation`). The layers themselves are described in :mod:`mtp.eval.sandbox`.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

from mtp.eval.sandbox.confine import CONFINE_FAILED
from mtp.eval.sandbox.limits import Limits, memory_cgroups

from mtp.util.errors import UserError

# Directories hidden from the sample (secrets, sockets, other users' files). Those that hold the
# Python installation are bound back read-only.
_MASKED_DIRS = ("/root", "/home", "/run", "/var/run", "/var/tmp", "/mnt", "/media", "/srv")
#: The environment a sandboxed interpreter gets, besides ``HOME`` and ``TMPDIR`` (its directory).
SAMPLE_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    # Math libraries otherwise start one thread per core; threads count against RLIMIT_NPROC.
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


#: The uids a sample's interpreters drop to when the harness runs as root: a range that no
#: distribution allocates to real users.
SAMPLE_UIDS = (2_000_000_000, 2_100_000_000)


@dataclass(frozen=True)
class Isolation:
    """Which isolation holds for the samples of a run (recorded in ``summary.json``)."""

    method: str
    """``bwrap``, ``unshare`` or ``process``."""
    read_only_root: bool
    """The completion's root filesystem is mounted read-only (``read_only_by`` bwrap or mount)."""
    network_isolated: bool
    pid_namespace: bool
    private_tmp: bool
    """The completion's ``/tmp`` is its own folder, and ``/dev/shm`` its own (bwrap, mount)."""
    fresh_uid: bool
    """Each sample runs as its own unprivileged uid (only when the harness runs as root)."""
    process_limit: bool
    """RLIMIT_NPROC bounds fork bombs: the kernel exempts root, so this needs a fresh uid, or a
    fresh user namespace (its process count starts from zero) when the harness is not root."""
    note: str = ""
    memory_cgroup: str = ""
    """``cgroup2`` or ``cgroup1``: each sample's processes share one memory limit in a cgroup of
    their own; empty where no memory cgroup can be made (the per-process limit still holds)."""
    host_read_only: bool = False
    """No write of the completion's reaches the host outside its own folder, checked with a
    write that must fail when the isolation was found (bubblewrap's binds are taken as
    given). The tests' process, trusted, keeps what it may write."""
    read_only_by: str = ""
    """What holds the host read-only: ``bwrap`` (read-only binds), ``mount`` (unshare: every
    mount remounted read-only in the completion's mount namespace), ``landlock`` (a Landlock
    ruleset allowing writes in its folder only), or empty: nothing, and the completion writes
    wherever its uid may."""
    completion_uid: str = ""
    """The uid the completion runs as, seen from the host: ``fresh per sample, A-B`` (the
    harness is root; `SAMPLE_UIDS`) or the harness's own uid (``0`` only where the harness is
    root and was told to allow it). Every completion runs with ``no_new_privs``."""

    def to_dict(self) -> dict:
        """Return the fields as a JSON-ready dict."""
        return asdict(self)


class UnsafeIsolation(UserError, RuntimeError):
    """Completions would run as root, and the caller did not allow it."""


#: The installed packages untrusted code may import besides the standard library: EvalPlus's
#: tests use numpy, and completions may.
SAMPLE_PACKAGES = ("numpy",)
# The system's programs and libraries; a link among them (``/lib -> usr/lib``) stays a link.
_SYSTEM_DIRS = ("/usr/bin", "/usr/lib", "/usr/lib64", "/usr/libexec", "/bin", "/lib", "/lib32",
                "/lib64", "/sbin", "/usr/sbin")
_SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/localtime")
# Where packages are installed, hidden inside the system's directories (``SAMPLE_PACKAGES``
# are bound back).
_PACKAGE_DIRS = ("/usr/lib/python3", "/usr/lib/python3*/*-packages",
                 "/usr/lib64/python3*/*-packages", "/usr/local/lib/python3*/*-packages")


@functools.cache
def _interpreter_paths() -> dict:
    """What the sample interpreter is made of, asked of it once: its executable, standard
    library, shared library and package directories."""
    code = ("import json, os, site, sys, sysconfig; print(json.dumps({'exe': sys.executable, "
            "'stdlib': os.path.dirname(os.__file__), 'libdir': sysconfig.get_config_var('LIBDIR')"
            " or '', 'site': site.getsitepackages()}))")
    proc = subprocess.run([sample_python(), "-I", "-c", code], capture_output=True, text=True,
                          timeout=60)
    try:
        return json.loads(proc.stdout)
    except ValueError:
        raise RuntimeError(f"the sample interpreter {sample_python()} did not describe itself: "
                           f"{proc.stderr.strip()[-300:]}") from None


@functools.cache
def confined_view() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """What a completion's interpreter sees of the host under bubblewrap, read-only: the paths
    bound, and the package directories inside them shown empty (all but `SAMPLE_PACKAGES`)."""
    paths = _interpreter_paths()
    exe = os.path.realpath(paths["exe"])
    shown = {d for d in _SYSTEM_DIRS if os.path.lexists(d)}
    shown |= {f for f in _SYSTEM_FILES if os.path.isfile(f)}
    shown |= {exe, os.path.realpath(paths["stdlib"])}
    if paths["libdir"]:
        shown |= set(glob.glob(os.path.join(paths["libdir"], "libpython*")))
    masked = {os.path.realpath(d) for pattern in _PACKAGE_DIRS for d in glob.glob(pattern)}
    masked |= {os.path.realpath(d) for d in paths["site"] if os.path.isdir(d)}
    for site in paths["site"]:
        for name in SAMPLE_PACKAGES:
            shown |= {os.path.realpath(d) for d in (os.path.join(site, name),
                                                    os.path.join(site, name + ".libs"))
                      if os.path.isdir(d)}
    masked = {d for d in masked if any(_is_under(d, s) and d != s for s in shown)
              and not any(_is_under(d, m) and d != m for m in masked)}
    return tuple(sorted(shown)), tuple(sorted(masked))


_detected: dict[str, Isolation] = {}
_warned = False


def sample_python() -> str:
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


def _dirs_for(path: str, made: set[str]) -> list[str]:
    """bwrap arguments that make `path`'s missing parents, world-readable (bwrap would make
    them 0700, closed to the sample's uid)."""
    out = []
    for parent in reversed(Path(path).parents):
        if str(parent) != "/" and str(parent) not in made:
            made.add(str(parent))
            out += ["--perms", "0755", "--dir", str(parent)]
    return out


def _confined_binds() -> list[str]:
    """bwrap arguments for :func:`confined_view`, on an empty root."""
    shown, masked = confined_view()
    made: set[str] = set()
    out = []
    for path in shown:  # sorted: a directory comes before what lies inside it
        if os.path.islink(path) and path in _SYSTEM_DIRS:
            out += _dirs_for(path, made) + ["--symlink", os.readlink(path), path]
            continue
        if any(_is_under(path, s) and path != s for s in shown):
            continue  # in sight with its parent, or bound below a mask of the parent's
        out += _dirs_for(path, made) + ["--ro-bind", path, path]
        if path in masked or not os.path.isdir(path):
            continue
        for mask in (m for m in masked if _is_under(m, path) and m != path):
            out += ["--tmpfs", mask]
            for inner in (i for i in shown if _is_under(i, mask) and i != mask):
                out += _dirs_for(inner, {mask, *(str(p) for p in Path(mask).parents)})
                out += ["--ro-bind", inner, inner]
            out += ["--remount-ro", mask]
    return out


def _bwrap_command(workdir: str, as_root: bool, confined: bool = False) -> list[str]:
    cmd = ["bwrap"]
    if confined:
        cmd += _confined_binds()
    else:
        cmd += ["--ro-bind", "/", "/"]
        python_dirs = _python_dirs()
        for masked in _MASKED_DIRS:
            if not os.path.isdir(masked) or os.path.islink(masked):
                continue
            cmd += ["--tmpfs", masked]
            for d in python_dirs:
                if _is_under(d, masked) and d != masked:
                    # bwrap would create the missing parents with mode 0700, closed to the
                    # sample uid.
                    parents = [str(p) for p in Path(d).parents if _is_under(str(p), masked)]
                    for parent in reversed(parents):
                        if parent != masked:
                            cmd += ["--perms", "0755", "--dir", parent]
                    cmd += ["--ro-bind", d, d]
            cmd += ["--remount-ro", masked]
    cmd += ["--dev", "/dev", "--proc", "/proc"]
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
    for key, value in SAMPLE_ENV.items():
        cmd += ["--setenv", key, value]
    return cmd + ["--"]


def _unshare_command() -> list[str]:
    # --mount-proc gives each interpreter a mount namespace of its own; private, so that what
    # `confine` mounts there never propagates to the host's.
    cmd = ["unshare", "--pid", "--net", "--ipc", "--uts", "--fork", "--kill-child",
           "--mount-proc", "--propagation", "private"]
    if os.geteuid() != 0:
        cmd.append("--map-root-user")
    return cmd + ["--"]


def wrapper_command(isolation: Isolation, workdir: str, confined: bool = False) -> list[str]:
    """The command line a sandboxed interpreter's own follows: bubblewrap's (`workdir` mounted at
    ``/tmp``; `confined`: the allow-list view of :func:`confined_view`, for untrusted code),
    unshare's, or none for a bare process."""
    if isolation.method == "bwrap":
        return _bwrap_command(workdir, os.geteuid() == 0, confined)
    if isolation.method == "unshare":
        return _unshare_command()
    return []


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


@functools.cache
def interpreter_binds() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The directories that hide the interpreter from another uid (not searchable by others,
    such as ``/root`` when Python lives there), each with the interpreter's directories inside
    it: what :mod:`~mtp.eval.sandbox.confine` covers with an empty tmpfs and binds back, so
    that a sample's uid can run the interpreter without seeing the rest."""
    masks: dict[str, list[str]] = {}
    for d in _python_dirs():
        closed = [str(p) for p in Path(d).parents
                  if str(p) != "/" and not os.stat(p).st_mode & 0o001]
        if closed:
            masks.setdefault(closed[-1], []).append(d)
    return tuple((mask, tuple(d for d in dirs if not any(_is_under(d, o) and d != o
                                                         for o in dirs)))
                 for mask, dirs in sorted(masks.items()))


@functools.cache
def confine_source() -> str:
    """The text of :mod:`~mtp.eval.sandbox.confine`, which every sandboxed program runs first."""
    return Path(__file__).with_name("confine.py").read_text()


def confine_orders(isolation: Isolation, completion: bool, shm_bytes: int) -> dict | None:
    """What :func:`mtp.eval.sandbox.confine.confine` does first in a sandboxed interpreter
    (None under bubblewrap, which does it all): for the `completion`, make the host read-only
    as ``isolation.read_only_by`` says (`shm_bytes`: the size of its private ``/dev/shm``);
    for both interpreters under unshare with fresh uids, bring the interpreter within their
    reach; ``no_new_privs`` always."""
    if isolation.method == "bwrap":
        return None
    reach = interpreter_binds() if isolation.method == "unshare" and isolation.fresh_uid else ()
    return {"read_only": isolation.read_only_by if completion else "",
            "reach": [[mask, list(dirs)] for mask, dirs in reach], "shm_bytes": shm_bytes,
            "host_mount_ns": os.readlink("/proc/self/ns/mnt"),
            "uid_follows": isolation.fresh_uid}


def _completion_uid(fresh: bool) -> str:
    return f"fresh per sample, {SAMPLE_UIDS[0]}-{SAMPLE_UIDS[1] - 1}" if fresh else str(
        os.geteuid())


def detect_isolation(requested: str = "auto", *, allow_root: bool = False) -> Isolation:
    """Find the strongest isolation that works here, trying it for real once per process.

    Args:
        requested: ``auto`` (strongest available), or force ``bwrap``, ``unshare`` or ``process``.
        allow_root: Run completions as root where the harness is root and no unprivileged uid
            can be had (a bare process whose interpreter other uids cannot reach); refused
            otherwise.

    Returns:
        The isolation that the samples of this process will get.

    Raises:
        RuntimeError: If a forced method does not work here.
        UnsafeIsolation: If completions would run as root and `allow_root` is false.
    """
    global _warned
    if requested not in ("auto", "bwrap", "unshare", "process"):
        raise ValueError(f"unknown isolation {requested!r}; use auto, bwrap, unshare or process")
    if requested not in _detected:
        iso, fell_back = _detect(requested)
        _detected[requested] = iso
        if not _warned and (fell_back or not iso.host_read_only):
            _warned = True
            why = f"bubblewrap is unavailable ({iso.note}); " if fell_back else ""
            warnings.warn(f"{why}samples run with weaker isolation: {iso}", RuntimeWarning,
                          stacklevel=2)
    iso = _detected[requested]
    if iso.completion_uid == "0" and not allow_root:
        raise UnsafeIsolation(
            f"isolation {iso.method!r} would run completions as root: no namespace to drop "
            f"privileges in, and other uids cannot reach the interpreter {sample_python()}. A "
            "completion running as root can change or delete any file of the host and stop "
            "any of its processes. Install bubblewrap, or make the interpreter readable by "
            "other users, or pass --unsafe-completions-as-root (allow_root=True) to run them "
            "as root anyway")
    return iso


def _detect(requested: str) -> tuple[Isolation, bool]:
    """The isolation, and whether ``auto`` fell back from bubblewrap."""
    as_root = os.geteuid() == 0
    order = ["bwrap", "unshare", "process"] if requested == "auto" else [requested]
    failures = []
    for method in order:
        ok, why = _probe(method, as_root)
        if ok:
            break
        failures.append(f"{method}: {why}")
    else:
        raise RuntimeError(f"isolation {requested!r} does not work here: {'; '.join(failures)}")
    common = {"method": method, "network_isolated": method != "process",
              "pid_namespace": method != "process", "memory_cgroup": memory_cgroups().kind}
    if method == "bwrap":
        return Isolation(**common, read_only_root=True, private_tmp=True, fresh_uid=as_root,
                         process_limit=True, note="; ".join(failures), host_read_only=True,
                         read_only_by="bwrap", completion_uid=_completion_uid(as_root)), False
    # The guards that may hold the host read-only here, strongest first; the empty one, none.
    for guard in (["mount"] if method == "unshare" else []) + ["landlock", ""]:
        # Under `mount` the interpreter is brought within the sample uid's reach.
        fresh = as_root and (guard == "mount" or _python_readable_by_others())
        iso = Isolation(**common, read_only_root=guard == "mount", private_tmp=guard == "mount",
                        fresh_uid=fresh, process_limit=fresh or (not as_root and
                                                                 method != "process"),
                        host_read_only=bool(guard), read_only_by=guard,
                        completion_uid=_completion_uid(fresh))
        who = "its fresh uid" if fresh else f"uid {iso.completion_uid}"
        why = _writes_reach_host(iso) if guard else (
            f"nothing holds the host read-only: a completion writes wherever {who} may")
        if not guard or not why:
            break
        failures.append(f"{guard}: {why}")
    if guard == "":
        failures.append(why)
    return dataclasses.replace(iso, note="; ".join(failures)), method != order[0]


def _probe(method: str, as_root: bool) -> tuple[bool, str]:
    if method == "process":
        return True, ""
    tool = "bwrap" if method == "bwrap" else "unshare"
    if shutil.which(tool) is None:
        return False, f"{tool} not found"
    with tempfile.TemporaryDirectory(prefix="mtp-probe-") as d:
        prefix = _bwrap_command(d, as_root) if method == "bwrap" else _unshare_command()
        try:
            proc = subprocess.run(prefix + [sample_python(), "-I", "-c", "pass"],
                                  stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            return False, str(e)
    if proc.returncode != 0:
        return False, proc.stderr.decode(errors="replace").strip()[:300] or f"rc {proc.returncode}"
    return True, ""


# A completion's first steps, as `processes` runs them (confine, then the drop to its uid),
# then writes: outside its folder (each must fail), inside it (must succeed).
_WRITE_PROBE = """
import os, sys
workdir = confine(sys.argv[1], {orders!r})
if {uid!r} is not None:
    os.setgroups([])
    os.setgid({uid!r})
    os.setuid({uid!r})
os.chdir(workdir)
import json  # the standard library, in the sample uid's reach
for path in {targets!r}:
    try:
        with open(path, "w") as f:
            f.write("written from the sandbox")
    except OSError:
        continue
    sys.exit(f"wrote {{path}}")
with open("scratch", "w") as f:
    f.write("its own folder stays writable")
print("read-only")
"""


def _writes_reach_host(iso: Isolation) -> str:
    """Why the host is not read-only for a completion under `iso` ('' where it is): run its
    first steps, then write to a folder the harness opened to every uid, and to ``/var/tmp``."""
    uid = secrets.choice(range(*SAMPLE_UIDS)) if iso.fresh_uid else None
    with tempfile.TemporaryDirectory(prefix="mtp-probe-") as d:
        os.chmod(d, 0o711)
        work, shared = os.path.join(d, "work"), os.path.join(d, "shared")
        os.mkdir(work, 0o700)
        os.mkdir(shared)
        os.chmod(shared, 0o777)  # only the guard, not the sample uid's permissions, can stop it
        if uid is not None:
            os.chown(work, uid, uid)
        targets = [os.path.join(shared, "written")]
        if os.path.isdir("/var/tmp") and os.stat("/var/tmp").st_mode & 0o002:
            targets.append(f"/var/tmp/mtp-probe-{secrets.token_hex(8)}")
        orders = confine_orders(iso, True, Limits.file_bytes)
        program = confine_source() + _WRITE_PROBE.format(orders=orders, uid=uid, targets=targets)
        try:
            proc = subprocess.run(
                wrapper_command(iso, work, True) + [sample_python(), "-I", "-S", "-B", "-c",
                                                    program, work],
                stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60, cwd=work,
                env=SAMPLE_ENV | {"HOME": work, "TMPDIR": work})
        except (OSError, subprocess.TimeoutExpired) as e:
            return str(e)
        finally:
            written = [t for t in targets if os.path.exists(t)]
            for t in written:
                os.unlink(t)
    if written:
        return f"a completion wrote {written[0]}"
    if proc.returncode != 0 or proc.stdout.strip() != "read-only":
        why = proc.stderr.strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        if proc.returncode == CONFINE_FAILED:
            return why[0].removeprefix("mtp sandbox: ")
        return why[0]
    return ""

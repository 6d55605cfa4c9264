"""Which isolation a sample gets: bubblewrap, unshare or a bare process, found by trying each.

Holds the :class:`Isolation` record, :func:`detect_isolation`, and the command line that wraps a
sandboxed interpreter (:func:`wrapper_command`): bubblewrap's or unshare's. Under bubblewrap the
completion's interpreter sees the filesystem by allow-list (:func:`confined_view`: the system's
programs and libraries, the interpreter's standard library and `SAMPLE_PACKAGES`, a private
``/tmp``, its own ``/proc``); the tests' interpreter, trusted, sees the root read-only with
the directories of secrets masked. The layers themselves are described in
:mod:`mtp.eval.sandbox`.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

from mtp.eval.sandbox.limits import memory_cgroups

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
    cmd = ["unshare", "--pid", "--net", "--ipc", "--uts", "--fork", "--kill-child",
           "--mount-proc"]
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
    iso = dataclasses.replace(iso, memory_cgroup=memory_cgroups().kind)
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
            proc = subprocess.run(prefix + [sample_python(), "-I", "-c", "pass"],
                                  stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            return False, str(e)
    if proc.returncode != 0:
        return False, proc.stderr.decode(errors="replace").strip()[:300] or f"rc {proc.returncode}"
    return True, ""

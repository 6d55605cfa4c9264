"""The host is read-only for a completion under every isolation: bubblewrap, unshare (its mount
namespace remounted read-only) and a bare process (Landlock), run as root and as a regular user.

A completion of HumanEval/0 writes outside its folder, to the benchmark data file and to the
calibration cache of the run that scores it (`mtp eval`, end to end). Every write fails, the
host is as it was, and the summary says what held and under which uid the completion ran. The
same completion run naively, as the same user, changes all three, so these tests can fail.
"""

from __future__ import annotations

import ast
import dataclasses
import gzip
import hashlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
from eval_helpers import DATA
from mtp.eval.cli import main as eval_main
from mtp.eval.sandbox import Isolation, Limits, detect_isolation, isolation, run_program
from mtp.eval.sandbox.isolation import SAMPLE_UIDS, UnsafeIsolation, interpreter_binds

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox needs Linux")

ISOLATIONS = ("bwrap", "unshare", "process")
EXPECTED_GUARD = {"bwrap": "bwrap", "unshare": "mount", "process": "landlock"}
REGULAR_UID = 1_999_999_999  # outside the sample uids, and no real user's
HUMANEVAL = DATA / "humaneval" / "HumanEval.jsonl.gz"


def _visible_dir() -> Path:
    """Where a test's files lie in the completion's sight (under unshare its /tmp is its own
    folder, so a file under the host's /tmp would be out of reach, not kept from change)."""
    for d in ("/var/tmp", "/dev/shm"):
        if os.path.isdir(d) and os.stat(d).st_mode & 0o002:
            return Path(d)
    pytest.skip("no world-writable directory outside /tmp to lay the targets in")


def _as_user(user: str) -> tuple[list[str], int]:
    """The command prefix that runs a program as `user` (``root`` or ``regular``), and its uid.

    As root, a regular user is `REGULAR_UID`, in a mount namespace where the interpreter is
    within its reach (bound back below an empty tmpfs, as the sandbox does for its samples);
    run by a regular user, that user itself."""
    if user == "root":
        if os.geteuid() != 0:
            pytest.skip("the harness as root needs root")
        return [], 0
    if os.geteuid() != 0:
        return [], os.geteuid()
    if shutil.which("unshare") is None:
        pytest.skip("no unshare to run the harness as a regular user")
    orders = {"read_only": "", "reach": [[m, list(d)] for m, d in interpreter_binds()],
              "shm_bytes": 0, "host_mount_ns": os.readlink("/proc/self/ns/mnt"),
              "uid_follows": True}
    boot = (f"import os, sys\nfrom mtp.eval.sandbox.confine import confine\n"
            f"confine(os.getcwd(), {orders!r})\nos.setgroups([])\nos.setgid({REGULAR_UID})\n"
            f"os.setuid({REGULAR_UID})\nos.execv(sys.argv[1], sys.argv[1:])\n")
    prefix = ["unshare", "--mount", "--propagation", "private", "--", sys.executable, "-c", boot]
    probe = subprocess.run(prefix + [sys.executable, "-c", "import mtp.eval.harness"],
                           capture_output=True, text=True, timeout=120, cwd="/")
    if probe.returncode != 0:
        pytest.skip(f"cannot run the harness as uid {REGULAR_UID}: {probe.stderr[-300:]}")
    return prefix, REGULAR_UID


# HumanEval/0's body, then module code that runs when the completion loads: it tries to change
# each target, records what it managed, and writes in its own folder (which it must still do).
# The answer is right only if every write outside failed. Where it has namespaces of its own,
# it first tries to undo its guard (`UNDO`).
ATTACK = '''
    return _answer(numbers, threshold)


import os
import tempfile

TARGETS = None  # the paths to change, filled in by the test
UIDS = None  # the uids it may run as (as the host sees them), filled in where the test knows
with open("/proc/self/status") as _f:
    _NO_NEW_PRIVS = "NoNewPrivs:\t1" in _f.read()
_UID = os.getuid()  # before UNDO, whose user namespace would show another
UNDO
_CHANGED = []
for _path in TARGETS:
    for _how in ("append", "create", "remove"):
        try:
            if _how == "append" and os.path.exists(_path):
                with open(_path, "ab") as _f:
                    _f.write(b"pwned")
            elif _how == "create":
                with open(_path + ".new", "w") as _f:
                    _f.write("pwned")
            elif _how == "remove":
                os.remove(_path)
            else:
                continue
            _CHANGED.append((_how, _path))
        except OSError:
            pass
for _own in ("scratch.txt", os.path.join(tempfile.gettempdir(), "scratch-2.txt")):
    with open(_own, "w") as _f:
        _f.write("its own folder stays writable")


def _answer(numbers, threshold):
    if _CHANGED:
        return f"changed the host: {_CHANGED}"
    if not _NO_NEW_PRIVS or (UIDS is not None and _UID not in range(*UIDS)):
        return f"runs as uid {_UID}, no_new_privs {_NO_NEW_PRIVS}"
    return any(abs(a - b) < threshold for i, a in enumerate(numbers)
               for j, b in enumerate(numbers) if i != j)
'''


def _state(paths: list[Path]) -> dict[str, str | None]:
    """What the host holds at `paths`: each file's sha256, or None where there is none."""
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() if p.exists() else None
            for p in paths}


@pytest.mark.parametrize("user", ["root", "regular"])
@pytest.mark.parametrize("method", ISOLATIONS)
def test_a_completion_changes_nothing_on_the_host(method, user):
    prefix, uid = _as_user(user)
    run = Path(tempfile.mkdtemp(prefix="mtp-read-only-", dir=_visible_dir()))
    try:
        _check_a_run(method, user, prefix, uid, run)
    finally:
        shutil.rmtree(run, ignore_errors=True)


def _check_a_run(method: str, user: str, prefix: list[str], uid: int, run: Path) -> None:
    refused = user == "root" and method == "process" and _root_would_run_as_root()
    for d in ("home", "cache", "outside", "out"):
        (run / d).mkdir()
    data = run / "HumanEval.jsonl.gz"  # this run's benchmark data: a copy, in sight
    shutil.copyfile(HUMANEVAL, data)
    cache = run / "cache" / "eval-reference-cpu.json"
    outside = [run / "outside" / "pwned.txt", run / "home" / ".bashrc"]
    (run / "home" / ".bashrc").write_text("# the user's own\n")
    targets = [*outside, data, cache]
    rows = [json.loads(line) for line in gzip.open(data, "rt")]
    completions = run / "completions.jsonl"
    with completions.open("w") as f:
        attack = ATTACK.replace("TARGETS = None", f"TARGETS = {[str(t) for t in targets]!r}")
        if user == "root":  # (a regular user's uid reads otherwise inside a user namespace)
            attack = attack.replace("UIDS = None", f"UIDS = {(0, 1) if refused else SAMPLE_UIDS}")
        # Never on the host: a remount there would be a remount of the host's root.
        undo = UNDO if method != "process" else "\n"
        f.write(json.dumps({"task_id": rows[0]["task_id"],
                            "completion": attack.replace("\nUNDO\n", undo)}) + "\n")
        f.write(json.dumps({"task_id": rows[1]["task_id"],
                            "completion": rows[1]["canonical_solution"]}) + "\n")
    for path in [run, *run.rglob("*")]:
        if os.geteuid() == 0:
            os.chown(path, uid, uid)
        # Open to every uid: only the guard, not a sample uid's permissions, may stop a write.
        path.chmod(0o777 if path.is_dir() else 0o666)
    before = _state([*outside, data])
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(run / "home"),
           "MTP_CACHE_DIR": str(run / "cache"), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "LANG": "C.UTF-8"}
    command = [sys.executable, "-m", "mtp.eval", "humaneval", "--completions", str(completions),
               "--data-file", str(data), "--limit", "2", "--timeout", "10", "--isolation",
               method, "--output", str(run / "out"), "--workers", "1"]
    if refused:  # no other uid to be had: refused, naming the flag, unless it is given
        proc = subprocess.run(prefix + command, capture_output=True, text=True, env=env,
                              cwd=run, timeout=300)
        assert proc.returncode == 2, proc.stderr
        assert "--unsafe-completions-as-root" in proc.stderr
        assert not (run / "out" / "samples.jsonl").exists()
        command.append("--unsafe-completions-as-root")
    proc = subprocess.run(prefix + command, capture_output=True, text=True, env=env, cwd=run,
                          timeout=300)
    if proc.returncode != 0 and "does not work here" in proc.stderr:
        pytest.skip(f"{method} as {user}: {proc.stderr.strip().splitlines()[-1][-300:]}")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((run / "out" / "summary.json").read_text())
    held = summary["isolation"]
    if not held["host_read_only"]:
        pytest.skip(f"{method} as {user}: nothing holds the host read-only here: {held['note']}")
    samples = {r["task_id"]: r for r in map(json.loads, (run / "out" / "samples.jsonl").open())}
    assert samples[rows[0]["task_id"]]["passed"], samples[rows[0]["task_id"]]["error"]
    assert samples[rows[1]["task_id"]]["passed"], samples[rows[1]["task_id"]]["error"]
    assert _state([*outside, data]) == before
    assert before[str(data)] == hashlib.sha256(HUMANEVAL.read_bytes()).hexdigest()
    assert not any(Path(str(t) + ".new").exists() for t in targets)
    # The cache, written by the run before it scored: there to attack, and as the run left it.
    cached = json.loads(cache.read_text())
    assert len(cached["tasks"]) == 2 and "pwned" not in cache.read_text()
    assert held["method"] == method and held["read_only_by"] == EXPECTED_GUARD[method]
    expected_uid = str(uid) if uid != 0 or refused else "fresh per sample"
    assert held["completion_uid"].startswith(expected_uid), held
    # The same completion run naively, as the same user, changes every target.
    program = rows[0]["prompt"] + attack.replace("\nUNDO\n", "\n") + "\nprint(_CHANGED)\n"
    naive = subprocess.run(prefix + [sys.executable, "-c", program], capture_output=True,
                           text=True, env=env | {"TMPDIR": str(run / "home")},
                           cwd=run / "home", timeout=60)
    assert naive.returncode == 0, naive.stderr
    changed = {path for _, path in ast.literal_eval(naive.stdout)}
    assert changed == {str(t) for t in targets}


def _root_would_run_as_root() -> bool:
    return detect_isolation("process", allow_root=True).completion_uid == "0"


# The completion's and the tests' processes try the same writes: only the completion's fail.
BOTH_WRITE = '''
import os
def f():
    out = {}
    for path in PATHS:
        try:
            with open(path + ".completion", "w") as fh:
                fh.write("x")
            out[path] = "written"
        except OSError as e:
            out[path] = os.strerror(e.errno)
    return out
'''
# Under unshare the completion first tries to undo its guard: remount its root read-write, in
# its own mount namespace and in a new user and mount namespace of its own making.
UNDO = '''
import ctypes
_libc = ctypes.CDLL(None, use_errno=True)
_REMOUNT_BIND = ctypes.c_ulong(32 | 4096)
_libc.mount(None, b"/", None, _REMOUNT_BIND, None)
if _libc.unshare(0x10000000 | 0x00020000) == 0:  # CLONE_NEWUSER | CLONE_NEWNS
    _libc.mount(None, b"/", None, _REMOUNT_BIND, None)
'''
TESTS_WRITE = '''
for path in PATHS:
    with open(path + ".tests", "w") as fh:
        fh.write("x")
got = f()
assert all(v != "written" for v in got.values()), got
assert set(got.values()) <= EXPECTED, got
'''


@pytest.mark.parametrize("method", ["unshare", "process"])
def test_only_the_completion_loses_write_access(method):
    """Under the fallbacks the tests' process, trusted, writes where it could (bubblewrap gives
    it a read-only root of its own); the completion's writes fail, each for the reason its
    guard gives: a read-only file system (mount, which the completion first tries to undo) or a
    denied permission (Landlock)."""
    try:
        iso = detect_isolation(method, allow_root=True)
    except RuntimeError as e:
        pytest.skip(str(e))
    if not iso.host_read_only:
        pytest.skip(f"nothing holds the host read-only under {method} here: {iso.note}")
    run = Path(tempfile.mkdtemp(prefix="mtp-read-only-", dir=_visible_dir()))
    try:
        os.chmod(run, 0o777)  # a sample uid's permissions would let it write here
        paths = [str(run / "shared"), "/var/tmp/" + f"mtp-both-{secrets.token_hex(4)}"]
        expected = {"mount": {"Read-only file system"},
                    "landlock": {"Permission denied"}}[iso.read_only_by]
        header = f"PATHS = {paths!r}\nEXPECTED = {expected!r}\n"
        undo = UNDO if method == "unshare" else ""  # in its namespaces only, never the host's
        result = run_program(header + undo + BOTH_WRITE, header + TESTS_WRITE, entry_point="f",
                             limits=Limits(timeout=30.0), isolation=iso)
        assert result.passed, result
        for path in paths:
            assert Path(path + ".tests").exists() and not Path(path + ".completion").exists()
    finally:
        for path in [str(run / "shared"), *paths[1:]]:
            for end in (".tests", ".completion"):
                Path(path + end).unlink(missing_ok=True)
        shutil.rmtree(run, ignore_errors=True)


@pytest.fixture
def fresh_detection(monkeypatch):
    """detect_isolation as on a fresh start: nothing found yet, nothing warned."""
    monkeypatch.setattr(isolation, "_detected", {})
    monkeypatch.setattr(isolation, "_warned", False)


def test_root_completions_are_refused_without_the_flag(monkeypatch, fresh_detection, capsys):
    """As root, with no namespace and an interpreter other uids cannot reach, a bare process
    would run completions as root: refused, by detect_isolation and by `mtp eval`, naming the
    flag that allows it; with it, the summary says uid 0."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    monkeypatch.setattr(isolation, "_python_readable_by_others", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(UnsafeIsolation, match="--unsafe-completions-as-root"):
            detect_isolation("process")
        assert detect_isolation("process", allow_root=True).completion_uid == "0"
    code = eval_main(["humaneval", "--completions", "/nonexistent.jsonl", "--isolation",
                      "process"])
    assert code == 2
    assert "--unsafe-completions-as-root" in capsys.readouterr().err


@pytest.mark.parametrize("method, fails", [
    ("unshare", {"mount": "mount /tmp: Operation not permitted"}),
    ("process", {"landlock": "Landlock: Function not implemented"}),
])
def test_a_guard_that_does_not_hold_is_recorded(monkeypatch, fresh_detection, method, fails):
    """Where a guard fails its check (an old kernel, a container that forbids mounts), the next
    is tried, and the summary's record says which held and why the others did not; with none
    left, that the host is writable, and a warning says so."""
    checked = []

    def check(iso: Isolation) -> str:
        checked.append(iso.read_only_by)
        return fails.get(iso.read_only_by, "")

    monkeypatch.setattr(isolation, "_writes_reach_host", check)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            iso = detect_isolation(method, allow_root=True)
        except RuntimeError as e:
            pytest.skip(str(e))
    for guard, why in fails.items():
        assert f"{guard}: {why}" in iso.note
    if method == "unshare":  # mount failed: Landlock holds instead
        assert checked == ["mount", "landlock"]
        assert iso.read_only_by == "landlock" and iso.host_read_only
        assert not iso.read_only_root and not iso.private_tmp
        assert not [w for w in caught if issubclass(w.category, RuntimeWarning)]
    else:  # nothing left
        assert checked == ["landlock"]
        assert iso.read_only_by == "" and not iso.host_read_only
        assert "nothing holds the host read-only" in iso.note
        assert any("weaker isolation" in str(w.message) for w in caught)


def test_a_sandbox_that_cannot_be_set_up_runs_nothing():
    """Orders to remount in a process that shares the harness's mount namespace (a bare
    process told `mount`) are refused before any mount: the sample ends as an error of the
    harness, its code never ran, and the host's mounts are as they were."""
    try:
        iso = detect_isolation("process", allow_root=True)
    except RuntimeError as e:
        pytest.skip(str(e))
    mounts = Path("/proc/self/mountinfo").read_text()
    marker = Path(tempfile.mkdtemp(prefix="mtp-confine-")) / "ran"
    marker.parent.chmod(0o777)
    try:
        result = run_program(f"open({str(marker)!r}, 'w').close()\ndef f():\n    return 1\n",
                             "assert f() == 1\n", entry_point="f", limits=Limits(timeout=30.0),
                             isolation=dataclasses.replace(iso, read_only_by="mount"))
        assert result.outcome == "error", result
        assert "shares the harness's mount namespace" in result.error
        assert not marker.exists()
        assert Path("/proc/self/mountinfo").read_text() == mounts
    finally:
        shutil.rmtree(marker.parent)

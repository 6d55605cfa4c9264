"""Run one sample: :func:`run_program` starts its sandboxed interpreters, waits for the verdict,
and reads it with their exit statuses. The design and its layers: :mod:`mtp.eval.sandbox`."""

from __future__ import annotations

import math
import os
import secrets
import signal
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

from mtp.eval import wire
from mtp.eval.sandbox.isolation import Isolation, detect_isolation
from mtp.eval.sandbox.limits import Limits, MemoryCgroups, memory_cgroups, rlimits
from mtp.eval.sandbox.processes import SandboxedProcess, kill_all, remove_workdir


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

    By default completion and tests run in two processes (see :mod:`mtp.eval.sandbox`); the
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
    procs: list[SandboxedProcess] = []
    cgroup = None
    start = time.monotonic()
    try:
        result_r, result_w = os.pipe()
        pipes += [result_r, result_w]
        cgroup = memory_cgroups().create("mtp-" + secrets.token_hex(8), limits.memory_bytes)
        if shared:
            token = secrets.token_hex(16)
            procs.append(SandboxedProcess(
                base, "sample", "run_shared", {"candidate.py": candidate, "test.py": test},
                {"result_fd": result_w, "token": token, "entry_point": entry_point},
                (result_w,), rlimits(limits, cpu, isolation.process_limit), limits, isolation,
                cgroup, hide))
        else:
            calls_r, calls_w = os.pipe()  # tests -> completion
            replies_r, replies_w = os.pipe()  # completion -> tests
            pipes += [calls_r, calls_w, replies_r, replies_w]
            procs.append(SandboxedProcess(
                base, "candidate", "serve_candidate", {"candidate.py": candidate},
                {"calls_fd": calls_r, "replies_fd": replies_w}, (calls_r, replies_w),
                rlimits(limits, cpu, isolation.process_limit), limits, isolation, cgroup, hide))
            procs.append(SandboxedProcess(
                base, "tests", "run_tests", {"test.py": test, "helpers.py": helpers},
                {"calls_fd": calls_w, "replies_fd": replies_r, "result_fd": result_w,
                 "proxied": list(proxied if proxied is not None else [entry_point])},
                (calls_w, replies_r, result_w),
                # the tests' own process: no CPU limit below the wall clock's
                rlimits(limits, limits.timeout, isolation.process_limit), limits, isolation))
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
        statuses = kill_all(procs)  # whatever happened, nothing of the sample survives
        duration = time.monotonic() - start
        output = "".join(p.output(limits.output_bytes) for p in procs[:1])[-limits.output_bytes:]
    except OSError as e:
        kill_all(procs)
        return ExecResult(False, "error", f"could not run the sample: {e}",
                          time.monotonic() - start, "", procs[0].tag if procs else "")
    finally:
        for fd in pipes:
            os.close(fd)
        MemoryCgroups.remove(cgroup)
        remove_workdir(base)

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

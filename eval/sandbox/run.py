"""Run one sample: :func:`run_program` starts its sandboxed interpreters, waits for the verdict,
and reads it with their exit statuses. The design and its layers: :mod:`mtp.eval.sandbox`."""

from __future__ import annotations

import math
import os
import secrets
import select
import signal
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

from mtp.eval import wire
from mtp.eval.sandbox.confine import CONFINE_FAILED
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


VERDICTS = ("passed", "failed", "error")
"""The statuses of a verdict on the tests' channel."""
_POLL_SECONDS = 0.25
"""How often the wait for a verdict reads the CPU time of the completion's processes."""


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


def _wait_for_verdict(result_r: int, judge: SandboxedProcess, sample: SandboxedProcess,
                      deadline: float, cpu_limit: int) -> tuple[list[dict], str]:
    """Read the tests' channel until it holds a verdict or ends, watching the CPU time of every
    process of the completion's sandbox. The messages read, and why the wait stopped early
    (``timeout``, ``cpu``) or ''."""
    channel, over = b"", 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return wire.messages(channel), "timeout"
        if select.select([result_r], [], [], min(_POLL_SECONDS, left))[0]:
            chunk = os.read(result_r, 1 << 16)
            channel += chunk
            found = wire.messages(channel)
            if not chunk or (found and found[-1].get("status") in VERDICTS):
                return found, ""
        # Two readings in a row over the limit: a child reaped between the reads of its own
        # and its parent's line can be counted twice in one.
        over = over + 1 if sample.cpu_seconds() > cpu_limit else 0
        if over >= 2:
            return wire.messages(channel), "cpu"
        if not judge.alive():
            return wire.messages(channel + _read_all(result_r)), ""


def run_program(
    candidate: str,
    test: str,
    *,
    entry_point: str = "",
    proxied: Sequence[str] | None = None,
    helpers: str = "",
    limits: Limits | None = None,
    isolation: Isolation | None = None,
) -> ExecResult:
    """Run one sample in fresh sandboxed interpreters and report whether its tests passed.

    Completion and tests run in two processes (see :mod:`mtp.eval.sandbox`); the verdict is
    the tests' report, read here with the completion's exit status and what its sandbox holds.

    Args:
        candidate: Untrusted program (for HumanEval: prompt + completion; for MBPP: the
            completion). It runs as module ``candidate``, so ``if __name__ == "__main__"`` blocks
            are skipped.
        test: Trusted test program; it must raise if the sample is wrong.
        entry_point: The function the tests call.
        proxied: The names the tests take from the completion: functions and classes are
            called across the pipe, constants cross as data (default: the entry point).
        helpers: Trusted code run before the tests in their namespace (HumanEval's prompt, whose
            helper functions some tests call); the completion cannot replace them.
        limits: Resource limits (defaults: :class:`Limits`).
        isolation: From :func:`detect_isolation` (default: the strongest available).

    Returns:
        The result; ``passed`` only if the tests ran to the end and the completion left no
        process running.
    """
    limits = limits or Limits()
    isolation = isolation or detect_isolation()
    cpu = limits.cpu_seconds or limits.timeout
    names = list(proxied if proxied is not None else [entry_point])
    base = tempfile.mkdtemp(prefix="mtp-sbx-")
    if isolation.fresh_uid and isolation.method != "bwrap":
        # The sample's uids reach their folders by path here (bwrap binds them at /tmp).
        os.chmod(base, 0o711)
    pipes: list[int] = []
    procs: list[SandboxedProcess] = []
    cgroup = None
    start = time.monotonic()
    try:
        result_r, result_w = os.pipe()
        calls_r, calls_w = os.pipe()  # tests -> completion
        replies_r, replies_w = os.pipe()  # completion -> tests
        pipes += [result_r, result_w, calls_r, calls_w, replies_r, replies_w]
        cgroup = memory_cgroups().create("mtp-" + secrets.token_hex(8), limits.memory_bytes)
        procs.append(SandboxedProcess(
            base, "candidate", "serve_candidate", {"candidate.py": candidate},
            {"calls_fd": calls_r, "replies_fd": replies_w, "proxied": names}, (calls_r, replies_w),
            rlimits(limits, cpu, isolation.process_limit), limits, isolation, cgroup,
            confined=True))
        procs.append(SandboxedProcess(
            base, "tests", "run_tests", {"test.py": test, "helpers.py": helpers},
            {"calls_fd": calls_w, "replies_fd": replies_r, "result_fd": result_w,
             "proxied": names, "hold_seconds": limits.timeout},
            (calls_w, replies_r, result_w),
            # the tests' own process: no CPU limit below the wall clock's
            rlimits(limits, limits.timeout, isolation.process_limit), limits, isolation))
        for fd in pipes[1:]:  # the children hold their ends now
            os.close(fd)
        pipes = pipes[:1]
        sample, judge = procs
        found, stopped = _wait_for_verdict(result_r, judge, sample, start + limits.timeout,
                                           math.ceil(cpu))
        # The tests saw the completion's process end: wait (briefly) to learn how, from its
        # exit status (the outer sandbox process may trail its child by a moment).
        ended = bool(found) and found[-1].get("ended") is True
        candidate_ended = sample.wait(5.0 if ended and not stopped else 0)
        left = sample.left_running() if found and found[-1].get("status") == "passed" else 0
        statuses = kill_all(procs)  # whatever happened, nothing of the sample survives
        duration = time.monotonic() - start
        outputs = [p.output(limits.output_bytes) for p in procs]
        output = outputs[0]
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
    if stopped == "timeout":
        return ExecResult(False, "timeout", f"timed out after {limits.timeout:g} s", duration,
                          output, tag)
    if death == "SIGXCPU" or stopped == "cpu":
        where = "" if death == "SIGXCPU" else " across its processes"
        return ExecResult(False, "timeout", f"used more than {math.ceil(cpu)} s of CPU{where}",
                          duration, output, tag)
    verdict = found[-1] if found and found[-1].get("status") in VERDICTS else None
    if (isolation.method != "bwrap" and CONFINE_FAILED in statuses
            and not (verdict and verdict["status"] == "passed")):
        said = outputs[statuses.index(CONFINE_FAILED)].splitlines()
        return ExecResult(False, "error", said[-1] if said else "the sandbox could not be set up",
                          duration, output, tag)
    if verdict is not None and verdict["status"] == "passed":
        if left:
            return ExecResult(False, "failed", f"left {left} process(es) running", duration,
                              output, tag)
        cpu = verdict.get("cpu")
        return ExecResult(True, "passed", "", duration, output, tag,
                          cpu if type(cpu) is float else None)
    if verdict is not None:
        why = str(verdict.get("detail", ""))
        if death:
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

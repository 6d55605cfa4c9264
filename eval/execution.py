"""How each task's samples run: which process holds what, and the limits that apply.

**Plan.** A sample's completion and its tests run in separate processes
(:func:`mtp.eval.sandbox.run_program`): the tests reach the names they take from the completion
through calls across a pipe and never run completion code. That covers more than the entry
point: MBPP task 367 builds its trees from the completion's ``Node`` class, whose instances the
tests hold by reference, and answers such as a ``collections.Counter`` (MBPP 40, 88) or an
``re.Match`` (MBPP+ 737, 787, 794) cross as data (:mod:`mtp.eval.wire`). Names the tests take
from trusted task code (HumanEval/32's ``poly``, defined by its prompt) are defined in the tests'
own process from that code.

**Time limits.** Each task's CPU limit is a multiple of its reference solution's own CPU time on
this machine, with a floor (:class:`TimePolicy`). CPU time, unlike the wall clock, does not grow
when the machine is busy or ``--workers`` is larger, so the verdicts do not depend on either.
The reference times are measured once per machine and cached (:func:`calibrate`); the wall
clock stays as a backstop, well above the CPU limit, for samples that sleep.
"""

from __future__ import annotations

import builtins
import dataclasses
import hashlib
import json
import symtable
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from mtp.eval.data import Task
from mtp.eval.sandbox import ExecResult, Isolation, Limits, confined_view, run_program

from mtp.util.atomic import write_json
from mtp.util.environment import cache_dir, machine_key

__all__ = ["Calibration", "Execution", "Plan", "TimePolicy", "calibrate", "completion_view",
           "plan", "prepare", "run_task", "task_limits"]


@dataclass(frozen=True)
class Plan:
    """How one task's samples run."""

    proxied: tuple[str, ...]
    """Names the tests take from the completion: the entry point first."""
    helpers: str
    """Trusted task code run in the tests' process first (HumanEval's prompt)."""


def _free_names(source: str) -> set[str]:
    """Global names a program reads without defining them (builtins excluded)."""
    top = symtable.symtable(source, "test", "exec")
    defined = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    read: set[str] = set()

    def walk(table: symtable.SymbolTable) -> None:
        for s in table.get_symbols():
            if (table is top and s.is_referenced()) or (table is not top and s.is_global()):
                read.add(s.get_name())
        for child in table.get_children():
            walk(child)

    walk(top)
    return {n for n in read - defined if not hasattr(builtins, n)}


def _defined_names(source: str) -> set[str]:
    top = symtable.symtable(source, "helpers", "exec")
    return {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}


def plan(task: Task) -> Plan:
    """Decide how a task's samples run (see the module docstring). Test code that does not
    parse here takes the entry point alone, and fails in the tests' process."""
    try:
        needed = _free_names(task.test) - {task.entry_point}
        helpers = task.prompt if task.completes_prompt else ""
        trusted = _defined_names(helpers) - {task.entry_point} if helpers else set()
    except SyntaxError:
        return Plan((task.entry_point,), "")
    return Plan((task.entry_point, *sorted(needed - trusted)),
                helpers if needed & trusted else "")


def run_task(task: Task, completion: str, limits: Limits, isolation: Isolation,
             how: Plan | None = None) -> ExecResult:
    """Run one sample of a task under `how` (default: its :func:`plan`)."""
    p = how or plan(task)
    return run_program(task.program(completion), task.test, entry_point=task.entry_point,
                       proxied=p.proxied, helpers=p.helpers, limits=limits, isolation=isolation)


def completion_view(isolation: Isolation) -> list[str] | str:
    """What a completion sees of the host's files, for ``summary.json``: the paths of the
    allow-list (bubblewrap), or a sentence where the isolation shows it the whole filesystem."""
    if isolation.method != "bwrap":
        return (f"the whole filesystem, as its own uid ({isolation.method} isolation cannot "
                f"hide files)")
    shown, masked = confined_view()
    return [*shown, *(f"{m} (empty but for the packages listed)" for m in masked)]


@dataclass(frozen=True)
class TimePolicy:
    """A task's CPU limit: ``max(floor, factor x its reference solution's CPU seconds)``."""

    factor: float = 4.0
    floor: float = 2.0
    """CPU seconds; covers the interpreter's start and the quick tasks, whose reference times
    are mostly start-up."""
    wall_factor: float = 3.0
    """The wall-clock backstop: ``max(Limits.timeout, wall_factor x CPU limit + 5 s)``."""

    def cpu_limit(self, reference_cpu: float) -> float:
        """The CPU limit, in seconds, of a task whose reference takes `reference_cpu`."""
        return max(self.floor, self.factor * reference_cpu)

    def to_dict(self) -> dict:
        """The policy, for ``summary.json``."""
        return dataclasses.asdict(self)


def task_limits(base: Limits, policy: TimePolicy, reference: float | None) -> Limits:
    """The limits for one task: `base` with the policy's CPU limit and wall-clock backstop.

    A task without a reference time (none could be measured) keeps `base` unchanged."""
    if reference is None:
        return base
    cpu = policy.cpu_limit(reference)
    return dataclasses.replace(base, cpu_seconds=cpu,
                               timeout=max(base.timeout, policy.wall_factor * cpu + 5.0))


def _task_key(task: Task) -> str:
    """Names a task's reference run: its program and tests, hashed."""
    h = hashlib.sha256()
    for part in (task.task_id, task.program(task.canonical_solution), task.test):
        h.update(part.encode("utf-8", "surrogatepass") + b"\0")
    return h.hexdigest()[:24]


CALIBRATION_LIMITS = Limits(timeout=300.0)
"""The limits a reference solution is measured under (trusted code: time is all it may need)."""


@dataclass(frozen=True)
class Calibration:
    """What the reference solutions showed on this machine: their CPU seconds."""

    cpu: dict[str, float | None]
    """Task id to the reference's CPU seconds; None where the reference did not pass."""
    path: Path | None
    """The cache file."""


def calibrate(
    tasks: Iterable[Task],
    *,
    isolation: Isolation,
    workers: int,
    limits: Limits | None = None,
    cache: Path | None = None,
    on_result: Callable[[Task, ExecResult], None] | None = None,
) -> Calibration:
    """Run each task's reference solution where the cache has no result for this machine.

    A reference runs in the sandbox under its task's plan with `limits` (default:
    `CALIBRATION_LIMITS`, generous in time: MBPP+ task 599's reference takes 40 s). A reference
    that does not pass gets None and a warning naming it: its task then runs with the run's
    limits as given. New results are added to the cache file, which is replaced atomically (an
    interrupted run leaves the old file whole).
    """
    limits = limits or CALIBRATION_LIMITS
    path = cache or cache_dir() / "eval-reference-cpu.json"
    key = machine_key()
    try:
        stored = json.loads(path.read_text())
        known = dict(stored["tasks"]) if stored.get("machine") == key else {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        known = {}
    tasks = list(tasks)
    todo = [t for t in tasks if _task_key(t) not in known]

    def measure(task: Task) -> tuple[Task, ExecResult]:
        return task, run_task(task, task.canonical_solution, limits, isolation)

    if todo:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            for task, result in pool.map(measure, todo):
                if on_result:
                    on_result(task, result)
                cpu = result.cpu if result.passed else None
                if cpu is None:
                    warnings.warn(f"{task.task_id}: the reference solution does not pass here "
                                  f"({result.outcome}: {result.error[:200]}); its samples run "
                                  f"without a calibrated CPU limit", stacklevel=2)
                known[_task_key(task)] = {"cpu": None if cpu is None else round(cpu, 4)}
        write_json(path, {"machine": key, "tasks": known}, indent=0, sort_keys=True,
                   what="the cache of reference solution times")
    return Calibration({t.task_id: known[_task_key(t)]["cpu"] for t in tasks}, path)


def limits_table(tasks: Iterable[Task], base: Limits, policy: TimePolicy,
                 calibration: Calibration) -> dict[str, Limits]:
    """Each task's limits (see :func:`task_limits`)."""
    return {t.task_id: task_limits(base, policy, calibration.cpu.get(t.task_id)) for t in tasks}


@dataclass
class Execution:
    """Everything a run needs to execute its samples: each task's plan and limits."""

    base: Limits
    """The limits given; the calibrated CPU limit and wall clock replace theirs per task."""
    policy: TimePolicy | None
    """None: `base` applies to every task as given (fixed limits)."""
    calibration: Calibration | None = None
    table: dict[str, Limits] = dataclasses.field(default_factory=dict)

    def limits(self, task_id: str) -> Limits:
        """The task's limits."""
        return self.table.get(task_id, self.base)

    def run(self, task: Task, completion: str, isolation: Isolation) -> ExecResult:
        """Run one sample of `task`."""
        return run_task(task, completion, self.limits(task.task_id), isolation)

    def describe(self, tasks: Iterable[Task], isolation: Isolation) -> dict:
        """How the run executed, for ``summary.json``: the names each task's tests take from
        the completion, the limits, and what a completion sees of the host."""
        tasks = list(tasks)
        cpu = {t.task_id: self.limits(t.task_id).cpu_seconds for t in tasks}
        return {
            "modes": {"calls": len(tasks), "shared": {}},
            "names_from_completions": {t.task_id: list(p.proxied[1:]) for t in tasks
                                       if len((p := plan(t)).proxied) > 1},
            "limits": {
                "policy": self.policy.to_dict() if self.policy else "fixed",
                "machine": machine_key(),
                "reference_cache": str(self.calibration.path) if self.calibration else None,
                "cpu_enforced_as": "RLIMIT_CPU of each process of the completion, rounded up to "
                                   "a whole second, and the same limit on the sum over its "
                                   "processes, read from /proc",
                "cpu_seconds": {k: None if v is None else round(v, 3)
                                for k, v in sorted(cpu.items())},
                "wall_seconds_max": max((self.limits(t.task_id).timeout for t in tasks),
                                        default=self.base.timeout),
                "memory_bytes": self.base.memory_bytes,
                "uncalibrated_tasks": sorted(k for k, v in cpu.items() if v is None),
            },
            "completion_view": completion_view(isolation),
        }


def prepare(
    tasks: Iterable[Task],
    *,
    base: Limits,
    policy: TimePolicy | None,
    isolation: Isolation,
    workers: int,
    cache: Path | None = None,
    on_result: Callable[[Task, ExecResult], None] | None = None,
) -> Execution:
    """Limits for `tasks`: calibrated from the reference solutions (measured where the cache
    lacks them) unless `policy` is None or `base` fixes the CPU limit already."""
    if policy is None or base.cpu_seconds is not None:
        return Execution(base, None)
    tasks = list(tasks)
    generous = dataclasses.replace(base, timeout=max(base.timeout, CALIBRATION_LIMITS.timeout))
    calibration = calibrate(tasks, isolation=isolation, workers=workers, limits=generous,
                            cache=cache, on_result=on_result)
    return Execution(base, policy, calibration, limits_table(tasks, base, policy, calibration))

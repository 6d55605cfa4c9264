"""`mtp bench sandbox`: what running the tests in their own process costs, per benchmark.

Scores the reference solutions of a benchmark with completion and tests in separate processes
(``calls``, the default) and in one (``shared``), the two modes alternating round by round so
that a slow spell of the machine falls on both alike, with the same fixed limits (no
calibration). Prints the median wall time of a whole run per mode, per sample, and the ratio;
every round must pass every task.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from mtp.bench.report import publish
from mtp.eval.data import DataError, load_benchmark
from mtp.eval.execution import Execution, Plan
from mtp.eval.harness import default_workers, score
from mtp.eval.sandbox import Limits, detect_isolation


class _Shared(Execution):
    """Every task shared: the mode the comparison is against."""

    def plan(self, task) -> Plan:
        return Plan(True, (), "", "the mode compared against")


def run(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """`mtp bench sandbox`: print the table and append it to `--csv`."""
    args.workers = args.workers or default_workers()
    for flag, value in (("--rounds", args.rounds), ("--workers", args.workers),
                        ("--limit", 1 if args.limit is None else args.limit)):
        if value < 1:
            p.error(f"{flag} must be >= 1 (got {value})")
    try:
        bench = load_benchmark(args.benchmark, args.data_file)
    except DataError as e:
        p.error(f"--data-file: {e}" if args.data_file else str(e))
    if args.limit:
        bench.tasks = bench.tasks[: args.limit]
    completions = [{"task_id": t.task_id, "sample": 0, "completion": t.canonical_solution}
                   for t in bench.tasks]
    isolation = detect_isolation()
    limits = Limits()
    modes = {"calls": Execution(limits, None), "shared": _Shared(limits, None)}
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.rounds):
        for mode, execution in modes.items():
            start = time.monotonic()
            results = score(bench, completions, workers=args.workers, isolation=isolation,
                            execution=execution)
            times[mode].append(time.monotonic() - start)
            failed = [r["task_id"] for r in results if not r["passed"]]
            if failed:
                print(f"mtp bench sandbox: {mode}: references failed: {failed[:10]}",
                      file=sys.stderr)
                return 1
    base = statistics.median(times["shared"])
    rows = [{"benchmark": bench.name, "mode": mode, "samples": len(completions),
             "workers": args.workers, "isolation": isolation.method, "rounds": args.rounds,
             "wall_s": statistics.median(t), "ms_per_sample": 1e3 * statistics.median(t)
             / len(completions), "vs_shared": statistics.median(t) / base}
            for mode, t in times.items()]
    publish(rows, args.csv, args.command)
    return 0

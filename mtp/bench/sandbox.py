"""`mtp bench sandbox`: what each isolation costs, per benchmark.

Scores the reference solutions of a benchmark under each isolation that works here (bubblewrap,
unshare, a bare process: :func:`mtp.eval.sandbox.detect_isolation`), the isolations
alternating round by round so that a slow spell of the machine falls on all alike, with the
same fixed limits (no calibration). Prints the median wall time of a whole run per isolation,
per sample, and the ratio to the first, with what held the host read-only for the completion
(``Isolation.read_only_by``, ``no`` for nothing) and the uid it ran as (``fresh per sample``,
or the harness's own); every round must pass every task. The reference solutions are trusted,
so a bare process runs them as root where the harness is root and no other uid can be had.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from mtp.bench.report import publish
from mtp.eval.data import DataError, load_benchmark
from mtp.eval.execution import Execution
from mtp.eval.harness import default_workers, score
from mtp.eval.sandbox import Limits, detect_isolation

ISOLATIONS = ("bwrap", "unshare", "process")


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
    isolations = {}
    for method in ISOLATIONS:
        try:
            # Only the benchmark's own reference solutions run here: trusted, even as root.
            isolations[method] = detect_isolation(method, allow_root=True)
        except RuntimeError as e:
            print(f"mtp bench sandbox: {method} left out: {e}", file=sys.stderr)
    execution = Execution(Limits(), None)
    times: dict[str, list[float]] = {m: [] for m in isolations}
    for _ in range(args.rounds):
        for method, isolation in isolations.items():
            start = time.monotonic()
            results = score(bench, completions, workers=args.workers, isolation=isolation,
                            execution=execution)
            times[method].append(time.monotonic() - start)
            failed = [r["task_id"] for r in results if not r["passed"]]
            if failed:
                print(f"mtp bench sandbox: {method}: references failed: {failed[:10]}",
                      file=sys.stderr)
                return 1
    first = next(iter(times))
    base = statistics.median(times[first])
    rows = [{"benchmark": bench.name, "isolation": method,
             "host_read_only": isolations[method].read_only_by or "no",
             "completion_uid": isolations[method].completion_uid.split(",")[0],
             "samples": len(completions), "workers": args.workers, "rounds": args.rounds,
             "wall_s": statistics.median(t),
             "ms_per_sample": 1e3 * statistics.median(t) / len(completions),
             f"vs_{first}": statistics.median(t) / base}
            for method, t in times.items()]
    publish(rows, args.csv, args.command)
    return 0

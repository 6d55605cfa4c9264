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

from mtp.eval.data import load_benchmark
from mtp.eval.execution import Execution, Plan
from mtp.eval.harness import default_workers, score
from mtp.eval.sandbox import Limits, detect_isolation


class _Shared(Execution):
    """Every task shared: the mode the comparison is against."""

    def plan(self, task) -> Plan:
        return Plan(True, (), "", "the mode compared against")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mtp bench sandbox", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--benchmark", default="humaneval",
                        choices=("humaneval", "humaneval+", "mbpp", "mbpp-sanitized", "mbpp+"))
    parser.add_argument("--data-file", default=None)
    parser.add_argument("--limit", type=int, default=None, help="first N tasks only")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each mode")
    parser.add_argument("--workers", type=int, default=default_workers())
    parser.add_argument("--csv", default="bench_results/sandbox.csv")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.workers < 1:
        parser.error("--rounds and --workers must be >= 1")
    from mtp.bench import publish  # imports torch: late

    bench = load_benchmark(args.benchmark, args.data_file)
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
    publish(rows, args.csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Write a benchmark's reference solutions as a completions file, to check the harness.

    python -m mtp.eval.canonical humaneval > humaneval-canonical.jsonl
    python -m mtp.eval.canonical mbpp --data-file ../shared/data/mbpp/mbpp.jsonl > mbpp.jsonl
    mtp eval humaneval --completions humaneval-canonical.jsonl   # expect pass@1 = 1.0
"""

from __future__ import annotations

import argparse
import json
import sys

from mtp.eval.cli import add_data_arguments, add_mbpp_data_arguments, benchmark_name
from mtp.eval.data import DataError, load_benchmark

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Print one ``{"task_id", "completion"}`` line per task; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m mtp.eval.canonical", description=__doc__)
    subs = parser.add_subparsers(dest="benchmark", required=True)
    for name in ("humaneval", "mbpp"):
        p = subs.add_parser(name)
        add_data_arguments(p)
        if name == "mbpp":
            add_mbpp_data_arguments(p)
    args = parser.parse_args(argv)
    try:
        benchmark = load_benchmark(benchmark_name(args), args.data_file)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for task in benchmark.tasks[: args.limit]:
        print(json.dumps({"task_id": task.task_id, "completion": task.canonical_solution}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

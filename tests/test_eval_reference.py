"""Reference solutions pass, empty and wrong completions score 0 (real sandbox, real data).

The full sets (164 HumanEval + 500 MBPP) run in the default suite: with the default workers
(half the cores) they take about 35 s on a 2-core machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mtp.eval.data import load_benchmark
from mtp.eval.harness import evaluate_completions, load_completions

DATA = Path(os.environ.get("MTP_SHARED_DATA", Path(__file__).parents[1].parent / "shared" / "data"))
MBPP_FILE = DATA / "mbpp" / "mbpp.jsonl"


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def _canonical(tmp_path: Path, *args: str) -> Path:
    """Write the canonical completions file the way a user would."""
    out = tmp_path / "canonical.jsonl"
    proc = subprocess.run([sys.executable, "-m", "mtp.eval.canonical", *args],
                          capture_output=True, text=True, check=True)
    out.write_text(proc.stdout)
    return out


@pytest.mark.parametrize("name, data_file, n_tasks", [
    ("humaneval", None, 164),
    ("mbpp", MBPP_FILE, 500),
])
def test_reference_solutions_all_pass(tmp_path, name, data_file, n_tasks):
    args = [name] + (["--data-file", str(data_file)] if data_file else [])
    bench = load_benchmark(name, data_file)
    completions = load_completions(_canonical(tmp_path, *args), bench)
    summary = evaluate_completions(bench, completions=completions, ks=[1],
                                   output_dir=tmp_path / "out")
    failed = [json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").open()
              if not json.loads(line)["passed"]]
    assert failed == []
    assert summary["n_tasks"] == n_tasks and summary["n_passed"] == n_tasks
    assert summary["pass@1"] == 1.0


@pytest.mark.parametrize("name, file", [
    ("humaneval+", "HumanEvalPlus-OriginFmt.jsonl.gz"),
    ("mbpp+", "MbppPlus-OriginFmt.jsonl.gz"),
])
def test_plus_reference_subset_passes(name, file):
    bench = load_benchmark(name, DATA / "evalplus" / file)
    bench.tasks = bench.tasks[:8]
    completions = [{"task_id": t.task_id, "sample": 0, "completion": t.canonical_solution}
                   for t in bench.tasks]
    assert evaluate_completions(bench, completions=completions, ks=[1])["pass@1"] == 1.0


@pytest.mark.parametrize("name, data_file, wrong", [
    ("humaneval", None, "    return None\n"),
    ("mbpp", MBPP_FILE, "def solution(*args):\n    return None\n"),
])
def test_empty_and_wrong_completions_score_zero(name, data_file, wrong):
    bench = load_benchmark(name, data_file)
    bench.tasks = bench.tasks[:10]
    completions = [{"task_id": t.task_id, "sample": i, "completion": c}
                   for t in bench.tasks for i, c in enumerate(["", wrong])]
    summary = evaluate_completions(bench, completions=completions, ks=[1, 2])
    assert summary["n_passed"] == 0
    assert summary["pass@1"] == 0.0 and summary["pass@2"] == 0.0

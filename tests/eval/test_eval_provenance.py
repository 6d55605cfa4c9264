"""A rerun into an existing ``--output`` reuses results only when everything that produced them
matches; otherwise it refuses, naming the flag, or with ``--fresh`` sets them aside."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from eval_helpers import DATA
from mtp.eval.cli import main
from mtp.eval.data import DataError, load_benchmark
from mtp.eval.provenance import PROVENANCE, check_or_record, claimed, path_digest

HUMANEVAL_PLUS = DATA / "evalplus" / "HumanEvalPlus-OriginFmt.jsonl.gz"



@pytest.fixture
def scored(tmp_path):
    """Two HumanEval tasks scored into out/ (one right, one wrong)."""
    tasks = load_benchmark("humaneval").tasks[:2]
    comp = tmp_path / "c.jsonl"
    comp.write_text("".join(json.dumps({"task_id": t.task_id, "completion": c}) + "\n" for t, c in
                            zip(tasks, [tasks[0].canonical_solution, "    return None\n"])))
    args = ["humaneval", "--completions", str(comp), "--limit", "2", "--k", "1",
            "--output", str(tmp_path / "out"), "--timeout", "20"]
    assert main(args) == 0
    return args, tmp_path / "out"


def _files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}


@pytest.mark.parametrize("change, flag", [
    (["--timeout", "30"], "--timeout (then 20.0, now 30.0)"),
    (["--plus", "--data-file", str(HUMANEVAL_PLUS)], "benchmark (--plus, --sanitized) (then "
                                                     "'humaneval', now 'humaneval+')"),
    (["--memory-gb", "1"], "--memory-gb"),
])
def test_changed_settings_are_refused_naming_the_flag(scored, capsys, change, flag):
    args, out = scored
    before = _files(out)
    capsys.readouterr()
    assert main([*args, *change]) == 2
    err = capsys.readouterr().err
    assert flag in err and "--fresh" in err, err
    assert _files(out) == before  # nothing rewritten


def test_same_settings_resume_and_fresh_sets_old_results_aside(scored, capsys):
    args, out = scored
    before = _files(out)
    assert main(args) == 0  # the same command: resumed, same results
    assert json.loads(_files(out)["summary.json"])["pass@1"] == 0.5
    assert main([*args, "--timeout", "30", "--fresh"]) == 0
    (stale,) = out.glob("stale-*")
    assert {n: (stale / n).read_bytes() for n in ("samples.jsonl", PROVENANCE)} == \
        {n: before[n] for n in ("samples.jsonl", PROVENANCE)}
    assert json.loads((out / PROVENANCE).read_text())["--timeout"] == 30.0
    assert json.loads((out / "summary.json").read_text())["pass@1"] == 0.5  # scored afresh


def test_a_second_run_into_an_output_in_use_is_refused(scored, capsys):
    """Two runs appending to one folder at once would leave two results for one sample: while
    one holds it, another is refused before it reads or writes anything there."""
    args, out = scored
    before = _files(out)
    capsys.readouterr()
    with claimed(out):  # another `mtp eval` running into it now
        assert main([*args, "--timeout", "30", "--fresh"]) == 2
    assert "is in use by another mtp eval running now" in capsys.readouterr().err
    assert _files(out) == before and not list(out.glob("stale-*"))
    assert main(args) == 0  # free again


def test_results_without_provenance_are_not_trusted(tmp_path):
    (tmp_path / "samples.jsonl").write_text("")
    with pytest.raises(DataError, match="without a provenance.json"):
        check_or_record(tmp_path, {"--ckpt": "a"})
    assert check_or_record(tmp_path, {"--ckpt": "a"}, fresh=True) is not None


def test_another_checkpoint_is_another_digest(tmp_path):
    a, b = tmp_path / "a.ckpt", tmp_path / "b.ckpt"
    a.write_bytes(b"weights")
    b.write_bytes(b"weightz")
    assert path_digest(a) != path_digest(b)
    check_or_record(tmp_path / "out", {"--ckpt": path_digest(a)})
    (tmp_path / "out" / "samples.jsonl").write_text("{}\n")
    with pytest.raises(DataError, match="--ckpt"):
        check_or_record(tmp_path / "out", {"--ckpt": path_digest(b)})
    d = tmp_path / "export"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"x")
    first = path_digest(d)
    (d / "mtp_heads.safetensors").write_bytes(b"y")  # a directory: every file counts
    assert path_digest(d) != first


def test_k_above_the_samples_is_an_error(scored, capsys):
    args, _ = scored
    k = args.index("--k")
    assert main([*args[:k], "--k", "5,10", *args[k + 2:]]) == 2
    assert "--k 5,10" in capsys.readouterr().err


def test_greedy_with_several_samples_is_refused(tmp_path, capsys):
    """Greedy decoding gives one completion; n copies of it are not n samples for pass@k."""
    ckpt = tmp_path / "model.ckpt"
    ckpt.write_bytes(b"")  # refused before the checkpoint is read
    assert main(["humaneval", "--ckpt", str(ckpt), "--n-samples", "4", "--k", "1"]) == 2
    err = capsys.readouterr().err
    assert "--n-samples 4 at --temperature 0" in err and "--temperature > 0" in err


def test_duplicate_completions_are_counted_and_warned_about(tmp_path, capsys):
    task = load_benchmark("humaneval").tasks[0]
    comp = tmp_path / "c.jsonl"
    lines = [task.canonical_solution, task.canonical_solution, "    return None\n",
             task.canonical_solution]
    comp.write_text("".join(json.dumps({"task_id": task.task_id, "completion": c}) + "\n"
                            for c in lines))
    with pytest.warns(UserWarning, match="2 of 4 samples repeat an earlier sample"):
        assert main(["humaneval", "--completions", str(comp), "--limit", "1", "--k", "1,2",
                     "--output", str(tmp_path / "out")]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["duplicate_samples"] == 2 and summary["n_samples"] == 4
    assert summary["pass@1"] == 0.75

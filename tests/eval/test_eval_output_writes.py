"""`mtp eval --output DIR` on a disk that fills (issue 41, case 3): one line naming the file and
what it holds, exit 2, the samples scored before intact line by line, and a rerun on a disk
with room completes them. Also: the flags of a generation run that no checkpoint need be loaded
to refuse (`--seed`, a temperature too small to divide by, `--n-samples` beyond the memory)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from checkpoint_helpers import debug_checkpoint
from disk_helpers import failing_writes, fill, resize, small_disk
from mtp.eval.cli import main
from mtp.eval.data import load_benchmark


def _completions(tmp_path: Path) -> Path:
    """A completion for each of the first two HumanEval tasks (one right, one wrong)."""
    tasks = load_benchmark("humaneval").tasks[:2]
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"task_id": t.task_id, "completion": c}) + "\n"
                            for t, c in zip(tasks, [tasks[0].canonical_solution,
                                                    "    return None\n"])))
    return path


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]  # each whole JSON


def _run(completions: Path, out: Path, limit: int) -> int:
    return main(["humaneval", "--completions", str(completions), "--limit", str(limit), "--k",
                 "1", "--output", str(out), "--timeout", "20"])


def test_a_full_disk_keeps_the_earlier_samples_and_a_rerun_completes_them(tmp_path, monkeypatch,
                                                                           capsys):
    completions, out = _completions(tmp_path), tmp_path / "out"
    assert _run(completions, out, 1) == 0
    first = (out / "samples.jsonl").read_text()
    failed = failing_writes(monkeypatch, "samples.jsonl")  # half a line, then a full disk
    assert _run(completions, out, 2) == 2
    err = capsys.readouterr().err
    assert f"mtp eval: error: cannot write scored samples {out / 'samples.jsonl'}: No space " \
           "left on device" in err and "Traceback" not in err and failed
    assert (out / "samples.jsonl").read_text() == first  # the earlier line whole, no fragment
    monkeypatch.undo()  # room again
    assert _run(completions, out, 2) == 0
    rows = _lines(out / "samples.jsonl")
    assert rows[0] == json.loads(first) and [r["task_id"] for r in rows] == \
        ["HumanEval/0", "HumanEval/1"]
    assert json.loads((out / "summary.json").read_text())["n_samples"] == 2


def test_on_a_real_full_disk_too(tmp_path, capsys):
    completions = _completions(tmp_path)
    with small_disk(tmp_path / "disk", "1m") as disk:
        out = disk / "out"
        assert _run(completions, out, 1) == 0
        first = (out / "samples.jsonl").read_text()
        filler = fill(disk, leave=0)
        assert _run(completions, out, 2) == 2
        err = capsys.readouterr().err
        assert "mtp eval: error: cannot write " in err and "No space left on device" in err
        assert str(out) in err and "Traceback" not in err
        # a line may still fit in the file's last page: whatever is there is whole lines
        assert (out / "samples.jsonl").read_text().startswith(first)
        _lines(out / "samples.jsonl")
        filler.unlink()
        resize(disk, "2m")
        assert _run(completions, out, 2) == 0
        assert [r["task_id"] for r in _lines(out / "samples.jsonl")] == \
            ["HumanEval/0", "HumanEval/1"]


@pytest.mark.parametrize("args, message", [
    (["--temperature", "1e-40"], "--temperature 1e-40 is too small to divide the logits by"),
    (["--temperature", "0.8", "--seed", "1180591620717411303424"],
     "--seed must be a whole number in [0, 4294967295]"),
    (["--temperature", "0.8", "--n-samples", "100000000000"],
     "--n-samples 100000000000: 164 tasks x 100000000000 samples hold at least"),
    (["--dtype", "bf16"], "--dtype bf16: this CPU (Old CPU) has no native bf16 products"),
], ids=["temperature", "seed", "n-samples", "dtype"])
def test_generation_flags_are_refused_before_the_checkpoint_loads(tmp_path, capsys, args,
                                                                  message, monkeypatch):
    from mtp.util import environment

    monkeypatch.setattr(environment, "cpu_flags", lambda: frozenset({"avx2"}))  # no bf16
    monkeypatch.setattr(environment, "cpu_model", lambda: "Old CPU")
    ckpt = debug_checkpoint(tmp_path / "tiny.ckpt")
    assert main(["humaneval", "--ckpt", str(ckpt), "--k", "1", *args]) == 2
    assert message in capsys.readouterr().err


def test_a_decode_batch_beyond_the_memory_is_refused_once_the_model_is_known(tmp_path,
                                                                             monkeypatch, capsys):
    """The KV cache and logits of --batch-size prompts at once, against the memory (here 1 MiB,
    as on a machine that has little left), before any prompt is decoded."""
    ckpt = debug_checkpoint(tmp_path / "tiny.ckpt")
    monkeypatch.setattr("mtp.util.environment.available_memory", lambda device="cpu": 1 << 20)
    assert main(["humaneval", "--ckpt", str(ckpt), "--k", "1", "--batch-size", "100",
                 "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "decoding 100 prompts at once needs about" in err and "lower --batch-size 100" in err
    assert not (tmp_path / "out" / "samples.jsonl").exists()

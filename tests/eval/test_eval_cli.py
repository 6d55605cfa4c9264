"""`mtp eval`'s inputs and notes: an `--output` that is a file, a completions line that is not
UTF-8, and prompts cut to fit the context length, counted and said."""

from pathlib import Path

import pytest
from checkpoint_helpers import debug_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """An untrained debug checkpoint with a 32-token context length."""
    return debug_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny.ckpt")


def _completions(path: Path) -> Path:
    from mtp.eval.data import load_benchmark

    task = load_benchmark("humaneval").tasks[0]
    path.write_bytes(b'{"task_id": "%s", "completion": "    return 1\\n"}\n' %
                     task.task_id.encode() + b'{"task_id": "HumanEval/0", "completion": "\xff"}\n')
    return path


def test_eval_output_that_is_a_file_is_refused_naming_it(tmp_path, capsys):
    from mtp.eval.cli import main as eval_main

    comp = tmp_path / "c.jsonl"
    comp.write_text('{"task_id": "HumanEval/0", "completion": "    return 1\\n"}\n')
    out = tmp_path / "out"
    out.write_text("not a folder\n")
    assert eval_main(["humaneval", "--completions", str(comp), "--limit", "1",
                      "--output", str(out)]) == 2
    assert f"--output {out} is a file; it must be a directory" in capsys.readouterr().err
    assert out.read_text() == "not a folder\n"
    below = out / "results"  # a file where a folder of the path should be
    from mtp.eval.data import DataError
    from mtp.eval.provenance import check_or_record

    with pytest.raises(DataError, match=rf"--output {below}: cannot create it"):
        check_or_record(below, {"x": 1})


def test_a_completions_line_that_is_not_utf8_names_file_and_line(tmp_path, capsys):
    from mtp.eval.cli import main as eval_main

    comp = _completions(tmp_path / "c.jsonl")
    assert eval_main(["humaneval", "--completions", str(comp)]) == 2
    assert f"{comp}:2: not UTF-8 (byte 43 of the line is 0xff)" in capsys.readouterr().err


def test_eval_says_how_many_prompts_were_cut_and_rows_stopped_at_the_window(ckpt, tmp_path,
                                                                         capsys):
    from mtp.eval.completer import load_completer

    completer = load_completer(str(ckpt), decoder="greedy")
    long_prompt = "def add(a, b):\n    return a + b\n" * 8  # far more than 32 tokens
    texts = completer.complete([long_prompt, "x"], max_new_tokens=20, temperature=0.0,
                               top_p=1.0, stop=[], seed=0)
    assert len(texts) == 2
    # room for the prompt: max(32 - 20, 32 // 2) = 16 tokens; the long prompt is cut to them
    assert (completer.rows, completer.prompts_cut) == (2, 1)
    assert completer.at_context_end == 1  # 16 + 20 > 32: stopped at the context length, "x" was not
    from mtp.eval.cli import main as eval_main

    assert eval_main(["humaneval", "--ckpt", str(ckpt), "--limit", "1", "--max-new-tokens",
                      "20", "--output", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert "mtp eval: note: 1 of 1 completions continue a prompt cut to its last tokens, to " \
           "fit the context length (--model.max_seq_len 32) with --max-new-tokens 20" in err

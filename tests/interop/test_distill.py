"""`mtp distill`: the model's own greedy answers to requests made from documented functions, in
its chat template, appended and resumable."""

from __future__ import annotations

import json

import pytest
import torch
from mtp.eval.chat import ChatTemplate

from mtp.cli import main
from mtp.config import ModelConfig
from mtp.data.bpe import train_tokenizer
from mtp.decoding.generation import generate
from mtp.interop.distill import requests
from mtp.model.checkpoint import save_checkpoint
from mtp.model.transformer import MTPTransformer

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SOURCE = '''
def add(a, b=1):
    """Return the sum of a and b, which must both be numbers of any kind.

    More detail that the request leaves out."""
    return a + b


def _private(x):
    """A private helper that is documented at length but never requested."""


def short(x):
    """Too short."""


def join_words(words, sep=" "):
    """Join the words with the separator between each pair of them, in order.

    >>> join_words(["a", "b"], "-")
    'a-b'
    """
    return sep.join(words)


class Box:
    def method(self):
        """A method, not a top-level function, documented at some length here."""
'''


@pytest.fixture()
def setup(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text(SOURCE)
    (src / "b.py").write_text(SOURCE.replace("add", "mul").replace("sum", "product")
                              .replace("join_words", "glue"))
    (src / "broken.py").write_text("def (:\n")
    tok = train_tokenizer([SOURCE] * 10, 400, 1 << 20, eot_token="<|im_end|>")
    torch.manual_seed(0)
    cfg = ModelConfig.from_name("debug", vocab_size=400, n_future=2, max_seq_len=512,
                                eot_token="<|im_end|>", chat_template=TEMPLATE)
    model = MTPTransformer(cfg).eval()
    save_checkpoint(tmp_path / "m.ckpt", model, tok)
    return tmp_path, src, model, tok


def test_requests_are_documented_public_functions(setup):
    _, src, _, _ = setup
    got = requests(src, 10, seed=0)
    assert len(got) == 4 and got == requests(src, 10, seed=0)
    assert sorted(r.split("`")[1] for r in got) == ["add(a, b=1)", "glue(words, sep=' ')",
                                                   "join_words(words, sep=' ')", "mul(a, b=1)"]
    assert all("More detail" not in r and "private" not in r and "Too short" not in r
               for r in got)
    assert requests(src, 2, seed=0) == got[:2]


def test_benchmark_style_requests_are_worded_as_the_chat_formats(setup):
    """`--style benchmark`: each request is what `mtp eval --prompt-format chat` would send for
    a HumanEval task with the function's stub, or an MBPP task with its doctests as asserts."""
    from mtp.eval.data import Task
    from mtp.eval.prompts import chat_request

    _, src, _, _ = setup
    got = requests(src, 10, seed=0, style="benchmark")
    assert len(got) == 4 and got == requests(src, 10, seed=0, style="benchmark")
    humaneval = [r for r in got if r.startswith("Please provide a self-contained Python script")]
    mbpp = [r for r in got if r.startswith("You are an expert Python programmer")]
    assert len(humaneval) == len(mbpp) == 2
    stub = Task("add", 'def add(a, b=1):\n    """Return the sum of a and b, which must both be '
                'numbers of any kind.\n\n    More detail that the request leaves out.\n    """\n',
                "add", "", "", completes_prompt=True)
    mul = stub.prompt.replace("add", "mul").replace("sum", "product")
    assert set(humaneval) == {chat_request(stub), chat_request(Task("mul", mul, "mul", "", "",
                                                                      True))}
    join = Task("join_words", "Write a function join_words() that: Join the words with the "
                "separator between each pair of them, in order.", "join_words", "", "", False,
                examples=("assert join_words([\"a\", \"b\"], \"-\") == 'a-b'",))
    assert chat_request(join) in mbpp


def test_answers_are_the_greedy_continuations_and_a_rerun_resumes(setup, capsys):
    """Each line is a request's greedy answer; requests start shortest first, two decoding at
    once (the third joins as one ends); a rerun answers the requests the file lacks, whatever
    --requests it had before."""
    tmp, src, model, tok = setup
    out = tmp / "d.jsonl"
    args = ["distill", "--model", str(tmp / "m.ckpt"), "--out", str(out), "--source", str(src),
            "--max-new-tokens", "12", "--batch-size", "2"]
    assert main([*args, "--requests", "3"]) == 0
    first = out.read_text().splitlines()
    assert len(first) == 3
    assert "GFLOP/s" in capsys.readouterr().err
    with open(out, "a") as f:
        f.write('{"text": "torn')  # a write killed half-way
    assert main([*args, "--requests", "4"]) == 0
    lines = out.read_text().splitlines()
    assert lines[:3] == first and len(lines) == 4
    chat = ChatTemplate(TEMPLATE, eos_token="<|im_end|>")
    eot = tok.token_to_id("<|im_end|>")
    rows = [json.loads(line) for line in lines]
    assert sorted(r["request"] for r in rows) == sorted(requests(src, 4, seed=0))
    prompts = {}
    for row in rows:
        prompt = chat.render([{"role": "user", "content": row["request"]}])
        prompts[row["request"]] = tok.encode(prompt).ids
        (ids,), _ = generate(model, [prompts[row["request"]]], 12, decoder="greedy", eot_id=eot)
        finished = ids[-1] == eot
        answer = tok.decode(ids[:-1] if finished else ids, skip_special_tokens=False)
        assert row == {"text": prompt + answer, "request": row["request"], "finished": finished}
    lengths = [len(prompts[r["request"]]) for r in rows[:3]]
    assert lengths == sorted(lengths) and len(set(lengths)) > 1  # the first run's, shortest first
    assert main([*args, "--requests", "4"]) == 0  # nothing left to answer
    assert out.read_text().splitlines() == lines


def test_a_model_without_a_chat_template_is_refused(setup, capsys):
    tmp, src, model, tok = setup
    plain = MTPTransformer(ModelConfig.from_name("debug", vocab_size=400, n_future=2,
                                                 eot_token="<|im_end|>"))
    save_checkpoint(tmp / "plain.ckpt", plain, tok)
    with pytest.raises(SystemExit):
        main(["distill", "--model", str(tmp / "plain.ckpt"), "--out", str(tmp / "x.jsonl"),
              "--source", str(src)])
    assert "has no chat template" in capsys.readouterr().err
    assert not (tmp / "x.jsonl").exists()


def test_an_unreadable_model_a_folder_as_out_and_an_out_in_use_are_refused(setup, capsys):
    """Each refusal names the flag and the file, and none writes anything."""
    import fcntl

    tmp, src, _, _ = setup
    (tmp / "notes.txt").write_text("not a model\n")
    cut = tmp / "cut.gguf"
    cut.write_bytes(b"GGUF" + bytes(100))
    out = tmp / "d.jsonl"
    base = ["distill", "--source", str(src), "--max-new-tokens", "4"]
    for model, message in ((tmp / "notes.txt", f"--model {tmp / 'notes.txt'}: no config.json"),
                           (cut, f"--model {cut} is truncated or corrupt")):
        with pytest.raises(SystemExit):
            main([*base, "--model", str(model), "--out", str(out)])
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*base, "--model", str(tmp / "m.ckpt"), "--out", str(tmp)])
    assert f"--out {tmp} is a directory" in capsys.readouterr().err
    with open(out, "a") as held:  # another `mtp distill` writing it
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(SystemExit):
            main([*base, "--model", str(tmp / "m.ckpt"), "--out", str(out)])
    assert "is being written by another mtp distill" in capsys.readouterr().err
    assert out.read_text() == ""


def test_continue_style_writes_the_greedy_continuations_of_code(setup):
    """`--style continue`: no chat template, no request; each line is a window of the source's
    code and the model's greedy continuation of it, every window of the same length."""
    from mtp.interop.distill import prefixes

    tmp, src, model, tok = setup
    (src / "long.py").write_text(SOURCE * 8)
    windows = prefixes(src, 5, 0, lambda t: tok.encode(t).ids, 16)
    assert windows and all(len(w) == 16 for w in windows)
    assert windows == prefixes(src, 5, 0, lambda t: tok.encode(t).ids, 16)
    out = tmp / "c.jsonl"
    assert main(["distill", "--model", str(tmp / "m.ckpt"), "--out", str(out), "--source",
                 str(src), "--style", "continue", "--prefix-tokens", "16", "--requests", "5",
                 "--max-new-tokens", "6", "--batch-size", "2"]) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == len(windows)
    eot = tok.token_to_id("<|im_end|>")
    for row, ids in zip(lines, windows):
        (new,), _ = generate(model, [ids], 6, decoder="greedy", eot_id=eot)
        finished = new[-1] == eot
        text = tok.decode(ids, skip_special_tokens=False) + tok.decode(
            new[:-1] if finished else new, skip_special_tokens=False)
        assert row == {"text": text, "request": None, "finished": finished}


def test_bf16_continuations_are_greedy_in_bf16_or_refused_naming_the_cpu(setup, capsys):
    """`--dtype bf16`: each line the greedy continuation of the model in bf16 where the CPU
    multiplies bf16 natively; elsewhere refused, naming the flag and the CPU."""
    from mtp.decoding.arithmetic import decode_dtype, to_decode_dtype

    tmp, src, model, tok = setup
    (src / "long.py").write_text(SOURCE * 8)
    out = tmp / "b.jsonl"
    args = ["distill", "--model", str(tmp / "m.ckpt"), "--out", str(out), "--source", str(src),
            "--style", "continue", "--prefix-tokens", "16", "--requests", "2",
            "--max-new-tokens", "6", "--dtype", "bf16"]
    try:
        decode_dtype("bf16")
    except ValueError as refused:
        with pytest.raises(SystemExit) as exit_:
            main(args)
        assert exit_.value.code == 2 and str(refused) in capsys.readouterr().err
        assert not out.exists()
        return
    assert main(args) == 0
    from mtp.interop.distill import prefixes

    windows = prefixes(src, 2, 0, lambda t: tok.encode(t).ids, 16)
    bf16 = to_decode_dtype(model, torch.bfloat16)
    eot = tok.token_to_id("<|im_end|>")
    for line, ids in zip(out.read_text().splitlines(), windows, strict=True):
        (new,), _ = generate(bf16, [ids], 6, decoder="greedy", eot_id=eot)
        body = new[:-1] if new[-1] == eot else new
        assert json.loads(line)["text"] == tok.decode(ids, skip_special_tokens=False) + \
            tok.decode(body, skip_special_tokens=False)


def test_an_out_that_cannot_be_written_is_named_and_keeps_its_lines(setup, monkeypatch, capsys):
    """Issue 41, case 6: `--out` in a read-only folder is one line naming the file, exit 2; a
    disk that fills mid-run keeps every line written before, and the same command goes on."""
    from disk_helpers import failing_writes, read_only_folder

    tmp, src, _, _ = setup
    base = ["distill", "--model", str(tmp / "m.ckpt"), "--source", str(src),
            "--max-new-tokens", "4", "--batch-size", "1"]
    with read_only_folder(tmp / "ro") as ro:
        with pytest.raises(SystemExit) as exit_:
            main([*base, "--out", str(ro / "d.jsonl")])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert f"--out: cannot write the distilled corpus {ro / 'd.jsonl'}: " in err
        assert "Traceback" not in err and not (ro / "d.jsonl").exists()
    out = tmp / "d.jsonl"
    assert main([*base, "--out", str(out), "--requests", "2"]) == 0
    before = out.read_text()
    failing_writes(monkeypatch, "d.jsonl")
    with pytest.raises(SystemExit):
        main([*base, "--out", str(out), "--requests", "4"])
    err = capsys.readouterr().err
    assert f"--out: cannot write the distilled corpus {out}: No space left on device; the 2 " \
           "answers before are kept" in err
    assert out.read_text() == before
    monkeypatch.undo()
    assert main([*base, "--out", str(out), "--requests", "4"]) == 0
    lines = out.read_text().splitlines()
    assert len(lines) == 4 and "\n".join(lines[:2]) + "\n" == before
    assert sorted(json.loads(line)["request"] for line in lines) == \
        sorted(requests(src, 4, seed=0))


def test_each_answer_is_written_as_it_ends(setup, monkeypatch, capsys):
    """Four requests decoding at once: the answers that ended before the disk filled are on it,
    each its own line (not a batch written whole at its end), and the rerun goes on."""
    from disk_helpers import failing_writes

    tmp, src, _, _ = setup
    base = ["distill", "--model", str(tmp / "m.ckpt"), "--source", str(src),
            "--max-new-tokens", "12", "--batch-size", "4", "--requests", "4"]
    assert main([*base, "--out", str(tmp / "whole.jsonl")]) == 0
    whole = (tmp / "whole.jsonl").read_text().splitlines(keepends=True)
    assert len(whole) == 4
    out = tmp / "d.jsonl"
    failing_writes(monkeypatch, "d.jsonl", after=len("".join(whole[:2]).encode()))
    with pytest.raises(SystemExit):
        main([*base, "--out", str(out)])
    assert "the 2 answers before are kept" in capsys.readouterr().err
    assert out.read_text().splitlines(keepends=True) == whole[:2]
    monkeypatch.undo()
    assert main([*base, "--out", str(out)]) == 0
    lines = out.read_text().splitlines(keepends=True)
    assert lines[:2] == whole[:2] and sorted(lines) == sorted(whole)


def test_mbpp_train_style_asks_the_training_split_in_the_chat_wording(setup, capsys):
    """`--style mbpp-train`: the requests are MBPP's training-split tasks (ids 601-974) worded
    as `mtp eval --prompt-format chat` words a task; no test-split task is among them."""
    from mtp.eval.data import load_benchmark, mbpp_train_tasks
    from mtp.eval.prompts import chat_request

    tmp, src, _, _ = setup
    from eval_helpers import DATA

    mbpp = DATA / "mbpp" / "mbpp.jsonl"
    train = mbpp_train_tasks(mbpp)
    assert 300 < len(train) < 374 and {int(t.task_id.split("/")[1]) for t in train} <= set(
        range(601, 975))
    test = {t.prompt.lower() for t in load_benchmark("mbpp", mbpp).tasks}
    assert not test & {t.prompt.lower() for t in train}
    out = tmp / "train.jsonl"
    args = ["distill", "--model", str(tmp / "m.ckpt"), "--out", str(out), "--source", str(src),
            "--max-new-tokens", "3", "--requests", "2"]
    assert main([*args, "--style", "mbpp-train", "--tasks", str(mbpp)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 and all(r["request"] in {chat_request(t) for t in train} for r in rows)
    for bad, message in ((["--style", "mbpp-train"], "needs --tasks"),
                         (["--tasks", str(mbpp)], "--tasks goes with --style mbpp-train"),
                         (["--style", "mbpp-train", "--tasks", str(tmp / "no.jsonl")],
                          "--tasks: MBPP data file not found")):
        with pytest.raises(SystemExit):
            main([*args, "--out", str(tmp / "x.jsonl"), *bad])
        assert message in capsys.readouterr().err
        assert not (tmp / "x.jsonl").exists()

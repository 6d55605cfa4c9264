"""`mtp bench decode --transformers`: transformers' greedy and prompt-lookup `generate` on the
weights of head 1 emit mtp greedy's tokens, in rows of the same table and CSV."""

from __future__ import annotations

import csv
import json
import sys

import pytest
import torch
from eval_helpers import DATA

import mtp.bench
from mtp.config import ModelConfig
from mtp.data.bpe import train_tokenizer
from mtp.model.checkpoint import save_checkpoint
from mtp.model.transformer import MTPTransformer

TEXTS = ["def fib(n):\n    return n\n", "for i in range(10):\n    print(i)\n"]
# Prompts that repeat themselves, so prompt lookup finds n-grams to propose.
PROMPTS = [t * 2 for t in TEXTS] + ["def fib(n):\n    for i in range(n):\n        print(i)\n"]


def bench(argv: list[str]) -> int:
    return mtp.bench.main(["decode", *argv])


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """Tiny random checkpoints (K = 2; untied, tied, linear heads) and a prompt file."""
    d = tmp_path_factory.mktemp("bench_transformers")
    tok = train_tokenizer(TEXTS * 20, 300, 1 << 20)
    out = {}
    for name, kw in (("untied", {}), ("tied", {"tie_embeddings": True}),
                     ("linear", {"head_type": "linear"})):
        torch.manual_seed(1)  # untied: its greedy output repeats in part, so lookup pays some
        cfg = ModelConfig.from_name("debug", vocab_size=320, n_future=2, max_seq_len=64, **kw)
        out[name] = str(d / f"{name}.ckpt")
        save_checkpoint(out[name], MTPTransformer(cfg), tok)
    out["prompts"] = str(d / "prompts.jsonl")
    (d / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return out


SMALL = ["--max-new-tokens", "24", "--repeat", "1", "--warmup", "1", "--auto-tree", "0",
         "--threads", "1"]


# The tied model's greedy output is newlines: a stop string of 9 of them ends each row inside a
# round of prompt lookup, whose tokens past it are cut as mtp's stopper cuts them.
@pytest.mark.parametrize("ckpt, extra", [("untied", []), ("tied", ["--stop", "\n" * 9])],
                         ids=["untied", "tied-stop-string"])
def test_transformers_rows_emit_mtp_greedy_tokens(files, tmp_path, capsys, ckpt, extra):
    out = tmp_path / "bench.csv"
    assert bench(["--ckpt", files[ckpt], "--prompts", files["prompts"], "--decoders",
                  "greedy,self-spec", "--transformers", "greedy,prompt-lookup", "--csv",
                  str(out), *SMALL, *extra]) == 0
    rows = {r["decoder"]: r for r in csv.DictReader(out.open())}
    assert list(rows) == ["greedy", "self-spec h=2", "transformers greedy",
                          "transformers prompt-lookup"]
    n = len(PROMPTS)
    for name in ("transformers greedy", "transformers prompt-lookup"):
        row = rows[name]
        # the same weights, the same stops: token for token mtp greedy's output
        assert row["equal_to_greedy"] == f"{n}/{n}", name
        assert float(row["ms_per_token"]) > 0 and float(row["speedup"]) > 0
        # what transformers does not expose stays empty
        assert row["round_ms"] == row["bare_ms"] == row["drafts_chosen"] == ""
        assert row["transformers"] and row["prompt_lookup_tokens"] == "10"
    # L counts the model's forwards: one token each for greedy, more for prompt lookup, whose
    # drafts the model accepted (its greedy output repeats itself).
    assert float(rows["transformers greedy"]["L"]) == 1.0
    assert float(rows["transformers prompt-lookup"]["L"]) > 1.0
    if extra:
        assert {r["tokens"] for r in rows.values()} == {str(9 * n)}
    assert "transformers prompt-lookup" in capsys.readouterr().out


def test_transformers_is_refused_where_it_cannot_apply(files, capsys, monkeypatch):
    with pytest.raises(SystemExit) as e:
        bench(["--ckpt", files["linear"], "--prompts", files["prompts"], "--transformers",
               "greedy", *SMALL])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--transformers: head 1 of --ckpt" in err
    assert "--model.head_type linear" in err
    with pytest.raises(SystemExit) as e:
        bench(["--ckpt", files["untied"], "--transformers", "greedy,beam", "--batch-size", "2",
               "--temperature", "0.5", "--lookup-ngram", "0"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "4 problems:" in err
    for problem in ("--transformers: unknown decoder 'beam'", "drop --batch-size 2",
                    "drop --temperature", "--lookup-ngram must be >= 1 (got 0)"):
        assert problem in err, problem
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    with pytest.raises(SystemExit) as e:
        bench(["--ckpt", files["untied"], "--transformers", "prompt-lookup"])
    assert "--transformers needs the transformers package" in capsys.readouterr().err


def test_benchmark_prompts_are_those_mtp_eval_builds(capsys):
    """`--prompts humaneval,mbpp=FILE`: the first N of each benchmark, raw or in the chat
    template, as `mtp eval` builds them; a chat format without a template names the flag."""
    import argparse

    from mtp.eval.chat import ChatTemplate
    from mtp.eval.data import load_benchmark
    from mtp.eval.prompts import build_prompt

    from mtp.bench.decode import read_prompts

    mbpp_file = DATA / "mbpp" / "mbpp.jsonl"
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                "{% endif %}")
    cfg = ModelConfig(chat_template=template, eot_token="<|im_end|>")
    p = argparse.ArgumentParser()
    he, mbpp = load_benchmark("humaneval"), load_benchmark("mbpp", mbpp_file)
    spec = f"humaneval,mbpp={mbpp_file}"
    raw = read_prompts(p, spec, "raw", 2, cfg)
    assert raw == [t.prompt for t in he.tasks[:2]] + [
        build_prompt(t, "mbpp-3shot", mbpp.shots) for t in mbpp.tasks[:2]]
    chat = read_prompts(p, spec, "chat", 2, cfg)
    want = ChatTemplate(template, eos_token="<|im_end|>")
    assert chat == [build_prompt(t, "humaneval-chat", chat=want) for t in he.tasks[:2]] + [
        build_prompt(t, "mbpp-chat", chat=want) for t in mbpp.tasks[:2]]
    assert all(c.startswith("<|im_start|>user\n") for c in chat)
    with pytest.raises(SystemExit):
        read_prompts(p, "humaneval", "chat", 1, ModelConfig())
    assert "--prompt-format chat needs the model's chat template" in capsys.readouterr().err

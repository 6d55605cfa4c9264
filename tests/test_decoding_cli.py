"""`mtp generate`, `mtp bench decode` and the evaluation `Completer`, on tiny checkpoints."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mtp.checkpoint import EOT_TOKEN, save_checkpoint
from mtp.config import ModelConfig
from mtp.decode_cli import bench_main, generate_main
from mtp.decoding import load_completer
from mtp.model import MTPTransformer

torch.set_num_threads(1)

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for i in range(10):\n    print(i)\n",
]


def _tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[EOT_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS * 10, trainer)
    return tok


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    """A K = 4 checkpoint, a K = 1 one (the draft model) and their tokenizer."""
    d = tmp_path_factory.mktemp("ckpt")
    tok = _tokenizer()
    paths = {}
    for name, k in (("k4", 4), ("k1", 1)):
        torch.manual_seed(k)
        cfg = ModelConfig.from_name("debug", vocab_size=320, n_future=k, max_seq_len=64)
        paths[name] = str(d / f"{name}.ckpt")
        save_checkpoint(paths[name], MTPTransformer(cfg), tok)
    return paths


def test_generate_streams_and_compares(ckpts, capsys) -> None:
    code = generate_main(["--ckpt", ckpts["k4"], "--prompt", "def fib(n):", "--decoder",
                          "self-spec", "--max-new-tokens", "12", "--compare", "greedy"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith("def fib(n):")
    assert "[self-spec] tokens 12  forwards" in out and "ms/token" in out
    assert "outputs equal: yes" in out and "speedup" in out


@pytest.mark.parametrize("decoder", ["tree", "draft", "sample"])
def test_generate_other_decoders(ckpts, capsys, decoder) -> None:
    args = ["--ckpt", ckpts["k4"], "--prompt", "for i in", "--decoder", decoder,
            "--max-new-tokens", "8", "--draft-ckpt", ckpts["k1"], "--temperature",
            "0.8" if decoder == "sample" else "0"]
    assert generate_main(args) == 0
    assert f"[{decoder}] tokens 8" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ckpt", "K1", "--decoder", "self-spec"], "--decoder self-spec drafts with heads 2..K"),
        (["--ckpt", "K1", "--decoder", "tree"], "single head"),
        (["--ckpt", "K4", "--n-heads", "5", "--decoder", "self-spec"], "--n-heads must be in"),
        (["--ckpt", "K4", "--decoder", "beam"], "--decoder: invalid choice: 'beam'"),
        (["--ckpt", "K4", "--decoder", "draft"], "--decoder draft needs --draft-ckpt"),
        (["--ckpt", "missing.ckpt"], "--ckpt: checkpoint missing.ckpt does not exist"),
        (["--ckpt", "K4", "--tree", "3,0"], "--tree must be"),
        (["--ckpt", "K4", "--prompt", "x = 1\n" * 40], "--prompt has"),
    ],
)
def test_generate_bad_input_exits_2_naming_the_flag(ckpts, capsys, args, message) -> None:
    args = [{"K1": ckpts["k1"], "K4": ckpts["k4"]}.get(a, a) for a in args]
    if "--prompt" not in args:
        args += ["--prompt", "def f():"]
    with pytest.raises(SystemExit) as e:
        generate_main(args)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_bench_decode_writes_table_and_csv(ckpts, tmp_path, capsys) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t[:12]}) + "\n" for t in TEXTS))
    out_csv = tmp_path / "bench.csv"
    code = bench_main(["--ckpt", ckpts["k4"], "--draft-ckpt", ckpts["k1"], "--prompts",
                       str(prompts), "--max-new-tokens", "10", "--n-heads", "1,4",
                       "--auto-tree", "5", "--calib-prompts", "2", "--csv", str(out_csv)])
    assert code == 0
    table = capsys.readouterr().out
    assert "speedup" in table and "verify_pct" in table
    rows = list(csv.DictReader(out_csv.open()))
    names = [r["decoder"] for r in rows]
    assert names[0] == "greedy" and names[1:3] == ["self-spec h=1", "self-spec h=4"]
    assert any(n.startswith("tree h=4") for n in names) and any("auto" in n for n in names)
    assert "draft gamma=4" in names
    for r in rows:
        assert r["equal_to_greedy"] == "3/3", r["decoder"]
        assert float(r["L"]) >= 1 and r["torch"] == torch.__version__
        assert r["git_rev"] and r["hardware"]
    assert float(rows[0]["speedup"]) == 1.0


def test_bench_decode_bad_input(ckpts, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        bench_main(["--ckpt", ckpts["k4"], "--decoders", "greedy,beam"])
    assert e.value.code == 2 and "--decoders: unknown decoder 'beam'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        bench_main(["--ckpt", ckpts["k4"], "--n-heads", "1,7"])
    assert e.value.code == 2 and "--n-heads must lie in [1, 4]" in capsys.readouterr().err


def test_completer(ckpts) -> None:
    prompts = ["def add(a, b):\n", "for i in"]
    kw = dict(max_new_tokens=16, temperature=0.0, top_p=1.0, stop=["\n"], seed=0)
    greedy = load_completer(ckpts["k4"], decoder="greedy", device="cpu").complete(prompts, **kw)
    spec = load_completer(ckpts["k4"], decoder="self-spec", device="cpu")
    assert spec.complete(prompts, **kw) == greedy
    assert all("\n" not in c for c in greedy)
    kw.update(temperature=0.8, top_p=0.9, seed=3)
    sample = load_completer(ckpts["k4"], decoder="tree", device="cpu")
    assert sample.complete(prompts * 2, **kw) == sample.complete(prompts * 2, **kw)
    with pytest.raises(ValueError, match="extra heads"):
        load_completer(ckpts["k1"], decoder="self-spec", device="cpu")
    with pytest.raises(ValueError, match="unknown decoder"):
        load_completer(ckpts["k4"], decoder="beam", device="cpu")

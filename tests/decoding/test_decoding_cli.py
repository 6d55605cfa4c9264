"""`mtp generate`, `mtp bench decode` and the evaluation `Completer`, on tiny checkpoints."""

from __future__ import annotations

import argparse
import csv
import json
import re
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import bpe_tokenizer, debug_checkpoint
from mtp.eval.completer import load_completer
from tokenizers import Tokenizer

import mtp.bench
from mtp.cli import main
from mtp.config import ModelConfig
from mtp.decoding.cli import dtype_problems, generate_main
from mtp.model.checkpoint import save_checkpoint
from mtp.model.transformer import MTPTransformer

torch.set_num_threads(1)

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for i in range(10):\n    print(i)\n",
]


def bench_main(argv: list[str]) -> int:
    return mtp.bench.main(["decode", *argv])


def _tokenizer() -> Tokenizer:
    return bpe_tokenizer(TEXTS * 10)


#: Whether this CPU decodes in bf16 (`--dtype bf16`).
BF16 = not dtype_problems(argparse.Namespace(dtype="bf16", device="cpu"))


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


@pytest.fixture(scope="module")
def trained_ckpt(tmp_path_factory) -> str:
    """A K = 4 checkpoint trained for a few seconds on the texts: its heads' drafts are often
    accepted, so a demo shows drafted tokens."""
    tok = _tokenizer()
    stream = torch.tensor(tok.encode("".join(TEXTS) * 4).ids)
    torch.manual_seed(0)
    cfg = ModelConfig.from_name("debug", vocab_size=320, n_future=4, max_seq_len=64)
    model = MTPTransformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(120):
        start = torch.randint(0, len(stream) - 40, (16, 1), generator=g)
        seq = stream[start + torch.arange(36)]  # (16, 36)
        logits = model(seq[:, :32])
        loss = sum(torch.nn.functional.cross_entropy(logits[i].flatten(0, 1),
                                                     seq[:, i + 1 : i + 33].flatten())
                   for i in range(4))
        opt.zero_grad()
        loss.backward()
        opt.step()
    path = str(tmp_path_factory.mktemp("trained") / "k4.ckpt")
    save_checkpoint(path, model.eval(), tok)
    return path


def test_generate_shows_which_tokens_were_drafts(trained_ckpt, capsys) -> None:
    code = generate_main(["--ckpt", trained_ckpt, "--prompt", "def fib(n):", "--decoder", "tree",
                          "--max-new-tokens", "24", "--compare", "greedy"])
    out = capsys.readouterr().out
    assert code == 0
    # Not a terminal: accepted drafts are marked; without the markers the text is greedy's.
    assert "[[" in out and "]]" in out and "[[...]]: tokens from accepted drafts" in out
    assert "outputs equal: yes" in out and "speedup" in out
    # The tokens counted by origin, as the streaming hook heard them: head 1 gave one token per
    # forward (the prefill's and each round's own), the heads the rest.
    by_origin = dict(part.rsplit(" ", 1) for part in
                     out.split("tokens by origin: ")[1].split("\n")[0].split(", "))
    forwards = int(out.split("[tree] tokens 24  forwards ")[1].split()[0])
    assert int(by_origin["head 1"]) == forwards and "head 2" in by_origin
    assert sum(map(int, by_origin.values())) == 24
    text = out.split("\n[[...]]")[0]
    code = generate_main(["--ckpt", trained_ckpt, "--prompt", "def fib(n):", "--decoder",
                          "greedy", "--max-new-tokens", "24"])
    plain = capsys.readouterr().out.split("\n[greedy]")[0]
    assert text.replace("[[", "").replace("]]", "") == plain
    generate_main(["--ckpt", trained_ckpt, "--prompt", "def fib(n):", "--decoder", "tree",
                   "--max-new-tokens", "24", "--show-drafts", "color"])
    assert "\033[36m" in capsys.readouterr().out


def test_generate_streams_and_compares(ckpts, capsys) -> None:
    code = generate_main(["--ckpt", ckpts["k4"], "--prompt", "def fib(n):", "--decoder",
                          "self-spec", "--max-new-tokens", "12", "--compare", "greedy"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith("def fib(n):")
    assert "[self-spec] tokens 12  forwards" in out and "ms/token" in out
    assert "outputs equal: yes" in out and "speedup" in out


@pytest.mark.parametrize("decoder", ["tree", "draft", "sample", "lookup"])
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
        (["--ckpt", "K4", "--heads", "5", "--decoder", "self-spec"], "--heads must lie in"),
        (["--ckpt", "K4", "--heads", "0", "--decoder", "tree"], "--heads must lie in"),
        (["--ckpt", "K4", "--decoder", "sample", "--temperature", "-1"],
         "--temperature must be finite and >= 0 (got -1.0)"),
        (["--ckpt", "K4", "--decoder", "sample", "--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--ckpt", "K4", "--decoder", "sample", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
        (["--ckpt", "K4", "--decoder", "sample", "--top-k", "0"], "--top-k must be >= 1"),
        (["--ckpt", "K4", "--decoder", "greedy", "--temperature", "0.5"], "--decoder sample"),
        (["--ckpt", "K4", "--decoder", "sample", "--temperature", "0"], "--temperature > 0"),
        (["--ckpt", "K4", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--ckpt", "K4", "--gamma", "0"], "--gamma must be >= 1"),
        (["--ckpt", "K4", "--lookup", "-1"], "--lookup must be >= 0"),
        (["--ckpt", "K4", "--lookup-ngram", "0"], "--lookup-ngram must be >= 1"),
        (["--ckpt", "K4", "--threads", "0"], "--threads must be in [1, "),
        (["--ckpt", "K4", "--device", "gpu7"], "--device 'gpu7'"),
        (["--ckpt", "K4", "--tree", "3,x"], "--tree must be"),
        (["--ckpt", "K4", "--tree", ""], "--tree must be"),
        (["--ckpt", "K4", "--decoder", "beam"], "--decoder: invalid choice: 'beam'"),
        (["--ckpt", "K4", "--decoder", "draft"], "--decoder draft needs --draft-ckpt"),
        (["--ckpt", "missing.ckpt"], "--ckpt: checkpoint missing.ckpt does not exist"),
        (["--ckpt", "K4", "--tree", "3,0"], "--tree must be"),
        (["--ckpt", "K4", "--tree", "1000,1000,1000"],
         "the tree 1000,1000,1000 has 1001001000 nodes; one forward verifies at most 4096"),
        (["--ckpt", "K4", "--decoder", "tree", "--tree", "4000"], "is wider than the vocabulary"),
        (["--ckpt", "K4", "--decoder", "sample", "--temperature", "nan"],
         "--temperature must be finite and >= 0 (got nan)"),
        (["--ckpt", "TEXT"], "notes.txt is not a checkpoint torch can read"),
        (["--ckpt", "K4", "--prompt", "x = 1\n" * 40], "--prompt has"),
        (["--ckpt", "K4", "--prompt", "caf\udce9"],  # b"caf\xe9" from a Latin-1 terminal
         "--prompt is not UTF-8 text (character 4 is the byte 0xe9)"),
        (["--ckpt", "K4", "--dtype", "fp16"], "--dtype must be one of fp32, bf16 (got 'fp16')"),
        (["--ckpt", "K4", "--dtype", "fp32,bf16"], "--dtype 'fp32,bf16': give one of"),
        (["--ckpt", "K4", "--linear-path", "fast"], "--linear-path: invalid choice: 'fast'"),
    ],
)
def test_generate_bad_input_exits_2_naming_the_flag(ckpts, capsys, args, message) -> None:
    text = Path(ckpts["k4"]).with_name("notes.txt")
    text.write_text("e" * 100)
    args = [{"K1": ckpts["k1"], "K4": ckpts["k4"], "TEXT": str(text)}.get(a, a) for a in args]
    if "--prompt" not in args:
        args += ["--prompt", "def f():"]
    with pytest.raises(SystemExit) as e:
        generate_main(args)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_bf16_is_refused_naming_the_cpu_without_bf16_products(ckpts, capsys, monkeypatch):
    from mtp.util import environment

    monkeypatch.setattr(environment, "cpu_flags", lambda: frozenset({"avx2"}))
    monkeypatch.setattr(environment, "cpu_model", lambda: "Old CPU")
    with pytest.raises(SystemExit) as e:
        generate_main(["--ckpt", ckpts["k4"], "--prompt", "x", "--dtype", "bf16"])
    assert e.value.code == 2
    assert "--dtype bf16: this CPU (Old CPU) has no native bf16 products" in \
        capsys.readouterr().err


def test_generate_in_bf16_is_greedy_and_refuses_speculation(trained_ckpt, capsys) -> None:
    """Greedy in bf16 where the CPU multiplies bf16 natively (elsewhere refused, naming the
    CPU); speculative decoders refused in bf16 either way."""
    args = ["--ckpt", trained_ckpt, "--prompt", "def fib(n):", "--max-new-tokens", "24",
            "--dtype", "bf16"]
    if BF16:
        assert generate_main(args) == 0
        assert "bf16, linear paths: " in capsys.readouterr().out
    else:
        with pytest.raises(SystemExit) as e:
            generate_main(args)
        assert e.value.code == 2 and "has no native bf16 products" in capsys.readouterr().err
        return
    with pytest.raises(SystemExit) as e:
        generate_main(["--ckpt", trained_ckpt, "--prompt", "def fib(n):", "--decoder", "tree",
                       "--dtype", "bf16"])
    assert e.value.code == 2
    assert "--decoder tree verifies a round of drafts in one forward" in capsys.readouterr().err


def test_bench_decode_puts_fp32_and_bf16_rows_side_by_side(trained_ckpt, tmp_path,
                                                           capsys) -> None:
    """Where the CPU multiplies bf16 natively; elsewhere the bf16 rows are refused before
    anything runs, naming the CPU."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t[:12]}) + "\n" for t in TEXTS))
    out_csv = tmp_path / "bench.csv"
    args = ["--ckpt", trained_ckpt, "--prompts", str(prompts), "--max-new-tokens", "10",
            "--decoders", "greedy,self-spec", "--heads", "4", "--repeat", "1",
            "--dtype", "bf16,fp32", "--linear-path", "onednn", "--csv", str(out_csv)]
    if not BF16:
        with pytest.raises(SystemExit) as e:
            bench_main(args)
        assert e.value.code == 2 and "has no native bf16 products" in capsys.readouterr().err
        assert not out_csv.exists()
        return
    assert bench_main(args) == 0
    rows = {r["decoder"]: r for r in csv.DictReader(out_csv.open())}
    # fp32 first whatever the order given: its greedy is every row's baseline; bf16 decodes
    # greedily only (speculation keeps greedy's output in fp32)
    assert list(rows) == ["greedy fp32", "self-spec h=4 fp32", "greedy bf16"]
    assert float(rows["greedy fp32"]["speedup"]) == 1.0
    for r in rows.values():
        assert r["dtype"] in r["decoder"] and r["linear_path"] == "onednn"
        assert r["equal_to_greedy"] == "3/3"  # against greedy in its own dtype


def test_generate_reports_every_bad_flag_together(ckpts, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        generate_main(["--ckpt", ckpts["k4"], "--prompt", "x", "--top-k", "0", "--gamma", "0",
                       "--tree", "3,x", "--max-new-tokens", "-2"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "4 problems:" in err
    for flag in ("--top-k must be >= 1 (got 0)", "--gamma must be >= 1 (got 0)", "--tree must be",
                 "--max-new-tokens must be >= 1 (got -2)"):
        assert flag in err, flag


def test_bench_decode_writes_table_and_csv(ckpts, tmp_path, capsys) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t[:12]}) + "\n" for t in TEXTS))
    out_csv = tmp_path / "bench.csv"
    code = bench_main(["--ckpt", ckpts["k4"], "--draft-ckpt", ckpts["k1"], "--prompts",
                       str(prompts), "--max-new-tokens", "10", "--heads", "2,4",
                       "--auto-tree", "5", "--calib-prompts", "2", "--csv", str(out_csv),
                       "--oracle", "--adaptive", "--repeat", "2", "--decoders",
                       "greedy,self-spec,tree,draft,lookup", "--lookup", "3"])
    assert code == 0
    table = capsys.readouterr().out
    assert "speedup" in table and "verify_pct" in table and "round_over_bare" in table
    rows = list(csv.DictReader(out_csv.open()))
    names = [r["decoder"] for r in rows]
    assert names[0] == "greedy" and names[1:3] == ["self-spec h=2", "self-spec h=4"]
    assert any(n.startswith("tree h=4") for n in names) and any("auto" in n for n in names)
    assert "draft gamma=4" in names and "self-spec h=4 adaptive" in names
    assert "lookup n=3" in names and "self-spec h=4 + lookup 3" in names
    assert any(n.startswith("tree auto(5)") and n.endswith("+ lookup 3") for n in names)
    for r in rows:
        assert r["equal_to_greedy"] == "3/3", r["decoder"]
        assert float(r["L"]) >= 1 and r["torch"] == torch.__version__
        assert r["git_rev"] and r["hardware"]
        assert float(r["round_ms"]) > 0 and float(r["bare_ms"]) > 0
    assert float(rows[0]["speedup"]) == 1.0
    oracle = {r["decoder"]: r for r in rows}["oracle n=3 (upper bound)"]
    # Drafting greedy's own tokens: every draft accepted. 10 tokens: the prefill's, two rounds
    # of 3 drafts + 1, and a last round with no room for drafts.
    assert oracle["acceptance"] == "1.00/1.00/1.00" and float(oracle["L"]) == 10 / 4


def test_bench_decode_lookup_ablations_add_their_rows(ckpts, tmp_path, capsys) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t[:12] * 2}) + "\n" for t in TEXTS))
    out_csv = tmp_path / "bench.csv"
    code = bench_main(["--ckpt", ckpts["k4"], "--prompts", str(prompts), "--limit", "2",
                       "--max-new-tokens", "10", "--heads", "4",
                       "--repeat", "1", "--auto-tree", "0", "--decoders", "greedy,tree",
                       "--tree", "dynamic:6", "--lookup", "3", "--lookup-whole",
                       "--lookup-pooled", "--csv", str(out_csv)])
    assert code == 0
    rows = {r["decoder"]: r for r in csv.DictReader(out_csv.open())}
    assert list(rows) == ["greedy", "tree dynamic(6) h=4", "tree dynamic(6) h=4 + lookup 3",
                          "tree dynamic(6) h=4 + lookup 3 whole",
                          "tree dynamic(6) h=4 + lookup 3 pooled"]
    assert all(r["equal_to_greedy"] == "2/2" for r in rows.values())
    # what each lookup row learnt its branch to add, by kind of match (repeated text: some)
    out = capsys.readouterr().out
    for name in list(rows)[2:]:
        assert re.search(rf"^{re.escape(name)}: \d-gram match, first token !?= the heads' first "
                         r"draft: \d+ rounds; tokens added by position [\d. ]+$", out, re.M), name


@pytest.fixture(scope="module")
def eagle_ckpt(tmp_path_factory) -> str:
    """A K = 4 checkpoint of eagle's layer."""
    torch.manual_seed(4)
    cfg = ModelConfig.from_name("debug", vocab_size=320, n_future=4, max_seq_len=64,
                                head_type="eagle")
    path = str(tmp_path_factory.mktemp("eagle") / "eagle.ckpt")
    save_checkpoint(path, MTPTransformer(cfg), _tokenizer())
    return path


def test_draft_int8_from_generate_and_the_bench(eagle_ckpt, ckpts, tmp_path, capsys) -> None:
    """`mtp generate --draft-int8` keeps greedy's output; `mtp bench decode --draft-int8` adds
    each row of the heads (eagle's layer, block heads) again drafting in int8, beside it; both
    refuse it where no head drafts, naming the flag."""
    assert main(["generate", "--ckpt", eagle_ckpt, "--prompt", TEXTS[1][:20], "--decoder",
                 "tree", "--tree", "dynamic:6", "--lookup", "3", "--draft-int8",
                 "--max-new-tokens", "12"]) == 0
    assert "outputs equal: yes" in capsys.readouterr().out
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t[:12] * 2}) + "\n" for t in TEXTS))
    out_csv = tmp_path / "bench.csv"
    assert bench_main(["--ckpt", eagle_ckpt, "--prompts", str(prompts), "--limit", "2",
                       "--max-new-tokens", "10", "--heads", "3", "--repeat", "1",
                       "--auto-tree", "0", "--decoders", "greedy,self-spec,tree",
                       "--tree", "dynamic:6", "--lookup", "3", "--draft-int8",
                       "--csv", str(out_csv)]) == 0
    rows = {r["decoder"]: r for r in csv.DictReader(out_csv.open())}
    heads = ["self-spec h=3", "tree dynamic(6) h=3", "self-spec h=3 + lookup 3",
             "tree dynamic(6) h=3 + lookup 3"]
    assert list(rows) == ["greedy", *heads, *[f"{name} int8 drafts" for name in heads]]
    assert all(r["equal_to_greedy"] == "2/2" for r in rows.values())
    # block heads too
    assert bench_main(["--ckpt", ckpts["k4"], "--prompts", str(prompts), "--limit", "2",
                       "--max-new-tokens", "10", "--heads", "3", "--repeat", "1",
                       "--auto-tree", "0", "--decoders", "greedy,tree", "--draft-int8",
                       "--csv", str(block_csv := tmp_path / "block.csv")]) == 0
    rows = {r["decoder"]: r for r in csv.DictReader(block_csv.open())}
    assert list(rows) == ["greedy", "tree h=3 [3,2]", "tree h=3 [3,2] int8 drafts"]
    assert all(r["equal_to_greedy"] == "2/2" for r in rows.values())
    with pytest.raises(SystemExit) as e:
        bench_main(["--ckpt", eagle_ckpt, "--decoders", "greedy,lookup", "--draft-int8"])
    assert e.value.code == 2 and "--draft-int8 adds rows of the heads drafting with 8-bit " \
        "integer products: it needs self-spec or tree in --decoders" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["generate", "--ckpt", eagle_ckpt, "--prompt", "x", "--draft-int8"])
    assert e.value.code == 2 and "--draft-int8 is how the heads draft with --decoder " \
        "self-spec and tree: --decoder greedy drafts with no head" in capsys.readouterr().err


def test_bench_decode_bad_input(ckpts, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        bench_main(["--ckpt", ckpts["k4"], "--decoders", "greedy,beam"])
    assert e.value.code == 2 and "--decoders: unknown decoder 'beam'" in capsys.readouterr().err
    for args, message in [
        (["--heads", "1,7"], "--heads must lie in [1, 4]"),
        (["--heads", "2,x"], "--heads: expected comma-separated integers"),
        (["--temperature", "-0.5"], "--temperature must be finite and >= 0"),
        (["--top-p", "2"], "--top-p must be in (0, 1]"),
        (["--repeat", "0"], "--repeat must be >= 1"),
        (["--batch-size", "0"], "--batch-size must be >= 1"),
        (["--limit", "0"], "--limit must be >= 1"),
        (["--tree", "2,-1"], "--tree must be"),
        (["--prompts", "nowhere.jsonl"], "--prompts: nowhere.jsonl is neither"),
        (["--lookup", "3", "--lookup-whole"], "--lookup-whole is an ablation of lookup's branch"),
        (["--tree", "dynamic", "--lookup-pooled"], "it needs --lookup N and --tree dynamic"),
    ]:
        with pytest.raises(SystemExit) as e:
            bench_main(["--ckpt", ckpts["k4"], *args])
        assert e.value.code == 2 and message in capsys.readouterr().err, args


def test_bench_decode_refuses_a_folder_as_csv_and_binary_prompts_before_running(
        ckpts, tmp_path, capsys) -> None:
    blob = tmp_path / "blob.py"
    blob.write_bytes(b"\x00\xcd\xff binary")
    for args, message in [(["--csv", str(tmp_path)], f"--csv {tmp_path} is a directory"),
                          (["--prompts", str(blob)], f"--prompts {blob}: not UTF-8 text")]:
        with pytest.raises(SystemExit) as e:
            bench_main(["--ckpt", ckpts["k4"], *args])
        assert e.value.code == 2 and message in capsys.readouterr().err, args


def test_bench_decode_names_a_bad_prompt_line(ckpts, tmp_path, capsys) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "def f():"}\n{"text": "x"}\n')
    with pytest.raises(SystemExit):
        bench_main(["--ckpt", ckpts["k4"], "--prompts", str(bad)])
    assert "line 2: not a JSON object with a 'prompt'" in capsys.readouterr().err


def test_bench_decode_batched(ckpts, tmp_path, capsys) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t[:12]}) + "\n" for t in TEXTS * 2))
    out_csv = tmp_path / "bench.csv"
    assert bench_main(["--ckpt", ckpts["k4"], "--prompts", str(prompts), "--max-new-tokens",
                       "8", "--decoders", "self-spec", "--heads", "3", "--batch-size", "4",
                       "--adaptive", "--repeat", "1", "--csv", str(out_csv)]) == 0
    rows = {r["decoder"]: r for r in csv.DictReader(out_csv.open())}
    assert rows["self-spec h=3 adaptive"]["equal_to_greedy"] == "6/6"
    assert rows["self-spec h=3"]["batch_size"] == "4"


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
    with pytest.raises(ValueError, match="single head"):
        load_completer(ckpts["k1"], decoder="self-spec", device="cpu")
    with pytest.raises(ValueError, match="unknown decoder"):
        load_completer(ckpts["k4"], decoder="beam", device="cpu")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """An untrained debug checkpoint with a 32-token context length."""
    return debug_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny.ckpt")


def test_generate_says_when_the_context_window_stopped_it(ckpt, capsys):
    assert main(["generate", "--ckpt", str(ckpt), "--prompt", "def add(a, b):",
                 "--max-new-tokens", "100", "--compare", "none"]) == 0
    err = capsys.readouterr().err
    assert "note: stopped at the context length (--model.max_seq_len 32): " in err
    assert "of --max-new-tokens 100 new tokens" in err

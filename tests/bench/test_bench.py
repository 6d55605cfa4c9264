"""`mtp bench loss --fsdp`, `mtp bench tokenize` and `mtp bench decode --prompts validation` end
to end at tiny sizes (the README's other benchmark commands run in `tests/test_readme.py`)."""

import csv
from pathlib import Path

import pytest
import torch
import yaml
from checkpoint_helpers import debug_checkpoint
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mtp.bench import main, parser
from mtp.bench.validation import validation_windows
from mtp.config import DataConfig, ModelConfig
from mtp.data import MTPDataModule
from mtp.model.checkpoint import EOT_TOKEN, load_checkpoint, save_checkpoint
from mtp.model.transformer import MTPTransformer


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_bench_loss_under_fsdp_on_two_processes(tmp_path, capsys):
    out = tmp_path / "loss.csv"
    assert main(["loss", "--fsdp", "2", "--n", "128", "--d", "32", "--vocab", "256",
                 "--seq-len", "64", "--ks", "2", "--methods", "sequential+fused",
                 "--reps", "1", "--warmup", "0", "--device", "cpu", "--dtype", "fp32",
                 "--csv", str(out)]) == 0
    rows = _rows(out)
    assert [r["status"] for r in rows] == ["ok"], rows
    assert all(r["fsdp_ranks"] == "2" and float(r["peak_mib"]) > 0 for r in rows)


def test_bench_tokenize_small_corpus(tmp_path, capsys):
    out = tmp_path / "tokenize.csv"
    assert main(["tokenize", "--size-mb", "1", "--dir", str(tmp_path), "--workers", "1,2",
                 "--vocab", "300", "--tokenizer-train-mb", "0.2", "--csv", str(out)]) == 0
    assert "bytes_per_s" in capsys.readouterr().out
    rows = list(csv.DictReader(out.open()))
    assert [r["workers"] for r in rows] == ["1", "2"]
    assert all(r["identical"] == "1" and int(r["tokens"]) > 0 for r in rows)
    assert abs(int(rows[0]["bytes"]) - 2**20) < 100
    assert not list(tmp_path.glob("shards-*")), "shards are removed after each run"


# -- `mtp bench decode --prompts validation` ---------------------------------------------------


def _run_folder(folder: Path, model: MTPTransformer, tok: Tokenizer, data: dict) -> str:
    """A checkpoint where `mtp fit` leaves it, beside the config.yaml that names its data."""
    (folder / "checkpoints").mkdir(parents=True)
    save_checkpoint(folder / "checkpoints" / "last.ckpt", model, tok)
    (folder / "config.yaml").write_text(yaml.safe_dump({"trainer": {"max_steps": 1},
                                                        "data": data}))
    return str(folder / "checkpoints" / "last.ckpt")


@pytest.fixture(scope="module")
def run(tiny_corpus, tmp_path_factory):
    """The run folder of a K = 4 model whose data is the tiny corpus, and that data."""
    root = tmp_path_factory.mktemp("run")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [p.read_text() for p in sorted(tiny_corpus.glob("*.py"))[:10]]
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=300, special_tokens=[EOT_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(root / "tokenizer.json"))
    data = {"source": str(tiny_corpus), "val_fraction": 0.1,
            "tokenizer": str(root / "tokenizer.json"), "cache_dir": str(root / "cache"),
            "seq_len": 16, "batch_size": 2, "tokenize_workers": 1}
    torch.manual_seed(0)
    model = MTPTransformer(ModelConfig.from_name("debug", vocab_size=320, n_future=4,
                                                 max_seq_len=64))
    return {"ckpt": _run_folder(root / "run", model, tok, data), "data": data, "tok": tok,
            "root": root}


def _args(argv: list[str]):
    _, subs = parser()
    return subs["decode"], subs["decode"].parse_args(argv)


def test_validation_prompts_are_windows_of_the_validation_split(run):
    """Each prompt and the text after it is a window of the validation tokens the DataModule
    builds (its shards, tokenised by its worker pool); the windows are the same on every call,
    spread from the split's start to its end, or without --limit end to end."""
    dm = MTPDataModule(DataConfig(**run["data"]), vocab_size=320, n_future=4)
    dm.prepare_data()
    dm.setup()
    val = dm.val_tokens.tolist()
    model, tok = load_checkpoint(run["ckpt"])
    p, args = _args(["--ckpt", run["ckpt"], "--prompts", "validation", "--prompt-tokens", "20",
                     "--max-new-tokens", "12", "--limit", "5"])
    windows = validation_windows(p, args, model, tok, "")
    assert windows == validation_windows(p, args, model, tok, "")
    assert len(windows) == 5 and all(len(w) == 32 for w in windows)
    assert windows[0] == val[:32] and windows[-1] == val[-32:]
    at = {tuple(val[i:i + 32]) for i in range(len(val) - 31)}
    assert all(tuple(w) in at for w in windows) and len(set(map(tuple, windows))) == 5
    _, args = _args(["--ckpt", run["ckpt"], "--prompts", "validation", "--prompt-tokens", "20",
                     "--max-new-tokens", "12"])
    assert validation_windows(p, args, model, tok, "") == [
        val[i:i + 32] for i in range(0, len(val) - 31, 32)]


def test_bench_decode_validation_prompts_print_the_simulated_L(run, tmp_path, capsys):
    out = tmp_path / "decode.csv"
    assert main(["decode", "--ckpt", run["ckpt"], "--prompts", "validation", "--prompt-tokens",
                 "16", "--limit", "3", "--max-new-tokens", "9", "--decoders", "self-spec",
                 "--heads", "2,4", "--repeat", "1", "--auto-tree", "0", "--warmup", "0",
                 "--csv", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "sim_L_greedy" in printed and "validation text after each prompt" in printed
    rows = {r["decoder"]: r for r in _rows(out)}
    assert rows["greedy"]["sim_L_text"] == rows["greedy"]["sim_L_greedy"] == ""
    for h in (2, 4):
        row = rows[f"self-spec h={h}"]
        assert row["equal_to_greedy"] == "3/3"
        assert 1 <= float(row["sim_L_text"]) <= h and 1 <= float(row["sim_L_greedy"]) <= h
    assert rows["greedy"]["prompts"] == "validation (3, validation windows of 16 tokens)"


def _every_draft_accepted(model: MTPTransformer, token: int) -> MTPTransformer:
    """`model` with every block's and head's projections zeroed (each adds nothing to the
    residual stream), every embedding equal and only `token`'s unembedding row left: every
    head predicts `token` after any text, so greedy repeats it and every draft is accepted."""
    with torch.no_grad():
        for param in [*model.blocks.parameters(), *model.heads.parameters()]:
            if param.dim() > 1:
                param.zero_()
        e = torch.randn(model.cfg.d_model)
        model.embed.weight.copy_(e.expand_as(model.embed.weight))
        model.unembed.weight.zero_()
        model.unembed.weight[token] = e
    return model


def test_simulated_L_is_the_decoded_L_where_every_draft_is_accepted(run, tmp_path):
    """Heads that predict what greedy emits by construction: simulated and decoded L agree
    exactly, per round (the prefill's forward adds one token): h for h heads."""
    torch.manual_seed(0)
    model = MTPTransformer(ModelConfig.from_name("debug", vocab_size=320, n_future=4,
                                                 max_seq_len=64))
    ckpt = _run_folder(tmp_path / "run", _every_draft_accepted(model, 7), run["tok"],
                       run["data"])
    out = tmp_path / "decode.csv"
    # 9 new tokens: the prefill's, then 8 in rounds of h
    assert main(["decode", "--ckpt", ckpt, "--prompts", "validation", "--prompt-tokens", "10",
                 "--limit", "2", "--max-new-tokens", "9", "--decoders", "self-spec", "--heads",
                 "2,4", "--repeat", "1", "--auto-tree", "0", "--warmup", "0",
                 "--csv", str(out)]) == 0
    rows = {r["decoder"]: r for r in _rows(out)}
    for h in (2, 4):
        row = rows[f"self-spec h={h}"]
        per_round = (int(row["tokens"]) - 2) / (int(row["forwards"]) - 2)
        assert float(row["sim_L_greedy"]) == float(row["sim_L_text"]) == per_round == h
        assert float(row["L"]) == 9 / (1 + 8 / h)


def test_bench_decode_refuses_bad_validation_prompts(run, tmp_path, capsys):
    bare = tmp_path / "bare.ckpt"  # no run folder around it
    save_checkpoint(bare, MTPTransformer(ModelConfig.from_name(
        "debug", vocab_size=320, n_future=4, max_seq_len=64)), run["tok"])
    ckpt, validation = ["--ckpt", run["ckpt"]], ["--prompts", "validation"]
    small = ["--prompt-tokens", "8", "--max-new-tokens", "8"]
    for args, messages in [
        ([*ckpt, *validation, "--prompt-tokens", "0"], ["--prompt-tokens must be >= 1 (got 0)"]),
        ([*ckpt, "--prompt-tokens", "8"], ["--prompt-tokens is the length of a validation "
                                           "prompt: it needs --prompts validation"]),
        ([*ckpt, *validation, "--prompt-tokens", "60", "--max-new-tokens", "8"],
         ["--prompt-tokens 60 + --max-new-tokens 8 exceed the context length",
          "--model.max_seq_len 64"]),
        ([*ckpt, *validation, "--max-new-tokens", "8"],
         ["--prompt-tokens 128 (the default) + --max-new-tokens 8 exceed the context length"]),
        ([*ckpt, *validation, *small, "--limit", "1000000"],
         ["--limit 1000000: the validation text of", "windows of --prompt-tokens 8"]),
        (["--ckpt", str(bare), *validation, *small],
         ["has no config.yaml of `mtp fit`", "--prompts validation=CONFIG.yaml",
          "validation=SOURCE"]),
        ([*ckpt, "--prompts", f"validation={tmp_path / 'nowhere'}", *small],
         ["the validation text of", "nowhere", "cannot be read here",
          "--prompts validation=SOURCE"]),
        ([*ckpt, "--prompts", f"validation={tmp_path / 'missing.yaml'}", *small],
         [f"--prompts validation={tmp_path / 'missing.yaml'}: cannot read"]),
    ]:
        with pytest.raises(SystemExit) as e:
            main(["decode", *args, "--csv", str(tmp_path / "x.csv")])
        err = capsys.readouterr().err
        assert e.value.code == 2 and all(m in err for m in messages), (args, err)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """An untrained debug checkpoint with a 32-token context length."""
    return debug_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny.ckpt")


def test_bench_decode_records_the_batch_size_it_ran(ckpt, tmp_path):
    import csv
    import json

    import mtp.bench

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n"
                               for p in ["def add(a, b):", "x = 1", "y = 2", "z = 3"]))
    out = tmp_path / "bench.csv"
    assert mtp.bench.main(["decode", "--ckpt", str(ckpt), "--prompts", str(prompts), "--limit",
                           "2", "--batch-size", "8", "--max-new-tokens", "4", "--decoders",
                           "greedy", "--repeat", "1", "--csv", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert rows and all(r["batch_size"] == "2" for r in rows)


@pytest.mark.parametrize("args, message", [
    (["train", "--batch-size", "100000000"], "lower --batch-size 100000000"),
    (["loss", "--n", "1000000000000", "--seq-len", "1000"], "lower --n 1000000000000"),
    (["loss", "--d", "1000000", "--vocab", "1000000"], "lower --d 1000000"),
], ids=["train-batch", "loss-tokens", "loss-width"])
def test_bench_sizes_beyond_the_memory_are_refused_before_any_tensor(args, message, tmp_path,
                                                                      capsys):
    from mtp.cli import main as mtp_main

    assert mtp_main(["bench", *args, "--csv", str(tmp_path / "x.csv")]) == 2
    err = capsys.readouterr().err
    assert message in err and "needs about" in err and "of memory available on " in err

"""mtp.model.memory: the memory a config needs, counted before anything is built, and a config
that needs more than the machine has refused with the estimate and the flags that drive it;
a checkpoint's or an export's stored config is checked the same way, naming the file."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from checkpoint_helpers import debug_checkpoint

from mtp.cli import main
from mtp.config import ModelConfig
from mtp.model import memory
from mtp.model.checkpoint import load_checkpoint
from mtp.model.transformer import MTPTransformer
from mtp.util.errors import ConfigError, InputError

GiB = 1 << 30


@pytest.mark.parametrize("head_type, tie, bias, kv_heads, matched", [
    (h, t, b, kv, m) for h, t, b, kv, m in itertools.product(
        ("block", "linear", "medusa", "medusa1", "deepseek", "eagle"), (False, True), (False, True),
        (None, 1), (False, True)) if not m or h in ("block", "deepseek")])
def test_the_parameter_count_is_the_built_models(head_type, tie, bias, kv_heads, matched):
    cfg = ModelConfig(vocab_size=300, d_model=32, n_layers=4, n_attn_heads=2,
                      n_attn_kv_heads=kv_heads, n_future=3, head_type=head_type,
                      tie_embeddings=tie, attn_bias=bias, matched_params=matched,
                      draft_vocab=50, max_seq_len=40, ffn_hidden=None if bias else 48)
    assert memory.parameter_count(cfg) == MTPTransformer(cfg).num_params()


def test_the_parameter_count_holds_eagles_fusing_map():
    cfg = ModelConfig(vocab_size=300, d_model=32, n_layers=4, n_attn_heads=2, n_future=3,
                      head_type="eagle", feature_layers=[1, 3], max_seq_len=40)
    assert memory.parameter_count(cfg) == MTPTransformer(cfg).num_params()


def test_the_training_estimate_counts_weights_gradients_adamw_and_a_step():
    cfg = ModelConfig()
    need = memory.training_need(cfg, batch_size=16, seq_len=128)
    weights = memory.parameter_count(cfg) * 4
    assert need.parts["gradients"] == weights and need.parts["AdamW state"] == 2 * weights
    assert need.parts["weights"] > weights  # and the rotary tables
    bigger = memory.training_need(cfg, batch_size=32, seq_len=128)
    assert bigger.parts["one step"] > 1.9 * need.parts["one step"]
    naive = memory.training_need(cfg, batch_size=16, seq_len=128, naive=True)
    # the naive loss holds K heads' logits and their gradients: K x N x V x 4 bytes, twice
    assert naive.parts["one step"] - need.parts["one step"] >= 2 * 4 * 16 * 128 * 4096 * 4
    sharded = memory.training_need(cfg, batch_size=16, seq_len=128, shards=4)
    assert sharded.parts["AdamW state"] == -(-need.parts["AdamW state"] // 4)


def _fit_need(cfg, sizes):
    return memory.training_need(cfg, batch_size=sizes["--data.batch_size"],
                                seq_len=sizes["--data.seq_len"])


@pytest.mark.parametrize("change, sizes, blamed", [
    ({"n_future": 100_000}, {"--data.batch_size": 8, "--data.seq_len": 32},
     "--model.n_future 100000"),
    ({}, {"--data.batch_size": 100_000_000, "--data.seq_len": 32},
     "lower --data.batch_size 100000000"),
])
def test_a_config_larger_than_the_memory_is_refused_with_the_estimate(change, sizes, blamed):
    cfg = ModelConfig.from_name("debug", vocab_size=512, **change)
    with pytest.raises(ConfigError) as err:
        memory.check_memory(_fit_need, cfg, sizes, 16 * GiB, doing="training",
                            where="on the CPU")
    text = str(err.value)
    estimate = memory.format_bytes(_fit_need(cfg, sizes).total)
    assert text.startswith(f"training needs about {estimate} (weights ") and blamed in text
    assert "more than the 16.0 GiB of memory available on the CPU" in text
    memory.check_memory(_fit_need, ModelConfig.from_name("debug", vocab_size=512),
                        {"--data.batch_size": 8, "--data.seq_len": 32}, 16 * GiB,
                        doing="training", where="on the CPU")  # what fits passes


def test_a_checkpoint_whose_stored_config_is_too_large_is_refused_naming_it(tmp_path, capsys):
    """Issue 41, case 9: a stored vocab_size of 4e9 is refused before the model is allocated,
    naming the file and the value, whatever the machine (the weights alone are ~1 TB)."""
    path = debug_checkpoint(tmp_path / "tiny.ckpt")
    ckpt = torch.load(path, weights_only=True)
    ckpt["mtp"]["model_config"]["vocab_size"] = 4_000_000_000
    torch.save(ckpt, path)
    with pytest.raises(InputError) as err:
        load_checkpoint(path)
    assert f"checkpoint {path} describes a model (--model.vocab_size 4000000000) that " \
           "needs about" in str(err.value) and "for loading the model" in str(err.value)
    with pytest.raises(SystemExit) as exit_:  # argparse's error: exit status 2
        main(["generate", "--ckpt", str(path), "--prompt", "x"])
    assert exit_.value.code == 2
    out = capsys.readouterr().err
    assert f"--ckpt: checkpoint {path} describes a model (--model.vocab_size 4000000000)" in out
    assert "Traceback" not in out and "alloc_cpu" not in out


def test_an_exports_stored_config_is_checked_the_same_way(tmp_path):
    path = debug_checkpoint(tmp_path / "tiny.ckpt")
    assert main(["export", "hf", "--ckpt", str(path), "--output", str(tmp_path / "hf")]) == 0
    meta_path = tmp_path / "hf" / "mtp_config.json"
    meta = json.loads(meta_path.read_text())
    meta["model_config"]["max_seq_len"] = 10**13  # rotary tables of petabytes
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(InputError, match=f"{meta_path} describes a model "
                                         r"\(--model.max_seq_len 10000000000000\)"):
        load_checkpoint(tmp_path / "hf")
    meta["model_config"]["max_seq_len"] = 0
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(InputError, match=f"{meta_path} stores an invalid model config: "
                                         "invalid configuration:\n  --model.max_seq_len must"):
        load_checkpoint(tmp_path / "hf")


def test_a_decode_estimate_counts_one_rounds_logits_not_the_whole_contexts():
    """SmolLM2-135M's shape at 2048 positions: 64 rows decoded at once (the recipes' `mtp
    distill --batch-size 64`) fit a 24 GiB machine; logits over every position of every row
    (24 GiB alone) would not."""
    cfg = ModelConfig(vocab_size=49152, d_model=576, n_layers=29, n_attn_heads=9,
                      n_attn_kv_heads=3, ffn_hidden=1536, n_future=1, max_seq_len=2048,
                      tie_embeddings=True)
    need = memory.inference_need(cfg, batch_size=64)
    assert need.parts["logits"] < 64 * 2048 * 49152 * 4 // 16
    assert sum(need.parts.values()) < 16 * GiB


def test_a_decode_estimate_counts_the_positions_a_row_fills():
    """The cache of a decode holds the longest prompt and the new tokens, not the context:
    `mtp distill --batch-size 128` of 191-token prompts and 192 new tokens fits 20 GiB, which
    a cache over all 2048 positions would not."""
    cfg = ModelConfig(vocab_size=49152, d_model=576, n_layers=29, n_attn_heads=9,
                      n_attn_kv_heads=3, ffn_hidden=1536, n_future=1, max_seq_len=2048,
                      tie_embeddings=True)
    whole = memory.inference_need(cfg, batch_size=128)
    need = memory.inference_need(cfg, batch_size=128, prompt_len=191, seq_len=191 + 192 + 1)
    layers = cfg.n_trunk_layers + 1  # the trunk's blocks and head 1's
    assert need.parts["KV cache"] == 2 * layers * 128 * 3 * 384 * 64 * 4
    assert whole.parts["KV cache"] == need.parts["KV cache"] * 2048 // 384
    assert need.parts["prefill"] * 2048 == whole.parts["prefill"] * 191
    assert need.total < 20 * GiB < whole.total

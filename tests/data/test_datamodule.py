"""Windows with K targets, samplers, mixtures of sources, and the DataModule."""

import json

import numpy as np
import pytest
import torch
from data_helpers import datamodule

from mtp.config import DataConfig
from mtp.data import (
    MixtureSampler,
    MTPDataModule,
    ResumableSampler,
    TokenWindows,
    unigram_entropy,
)
from mtp.data.corpus import SourceSpec
from mtp.util.errors import ConfigError


def test_bad_data_configs_name_the_flag():
    with pytest.raises(ConfigError, match="--data.val_fraction"):
        DataConfig(val_fraction=1.5)
    with pytest.raises(ConfigError, match="--data.seq_len"):
        DataConfig(seq_len=0)


def test_windows_hold_seq_len_plus_k_tokens():
    tokens = np.arange(100, dtype=np.uint16)
    ds = TokenWindows(tokens, seq_len=10, n_future=4)
    assert len(ds) == (100 - 14) // 10 + 1
    assert ds[2].tolist() == list(range(20, 34))
    assert ds[len(ds) - 1][-1] < 100
    with pytest.raises(ValueError, match="--data.seq_len"):
        TokenWindows(tokens[:10], seq_len=10, n_future=4)


def test_sampler_is_seeded_resumable_and_sharded():
    def take(sampler, n):
        it = iter(sampler)
        return [next(it) for _ in range(n)]

    full = take(ResumableSampler(7, seed=3), 30)
    assert sorted(full[:7]) == list(range(7)) and sorted(full[7:14]) == list(range(7))
    assert full[:7] != full[7:14], "each epoch is reshuffled"
    assert take(ResumableSampler(7, seed=3, start=11), 19) == full[11:]
    assert take(ResumableSampler(7, seed=4), 7) != full[:7]
    ranks = [take(ResumableSampler(7, seed=3, start=4, rank=r, world_size=2), 8) for r in (0, 1)]
    assert [x for pair in zip(*ranks) for x in pair] == full[4:20]


def test_unigram_entropy():
    assert unigram_entropy(np.array([0, 1, 2, 3]), 8) == pytest.approx(np.log(4))
    assert unigram_entropy(np.array([5, 5, 5]), 8) == 0.0


def test_datamodule_batches(tiny_corpus, tmp_path):
    dm = datamodule(tiny_corpus, tmp_path)
    batch = next(iter(dm.train_dataloader()))
    assert batch.shape == (4, 16 + 3) and batch.dtype == torch.long
    assert next(iter(dm.val_dataloader())).shape[1] == 19


# -- mixtures -----------------------------------------------------------------------------------


def _take(sampler, n):
    it = iter(sampler)
    return [next(it) for _ in range(n)]


def test_mixture_sampler_is_seeded_resumable_and_sharded():
    sizes, weights = [7, 30], [2.0, 1.0]
    full = _take(MixtureSampler(sizes, weights, seed=3), 9000)  # crosses two chunks
    assert _take(MixtureSampler(sizes, weights, seed=3, start=4100), 200) == full[4100:4300]
    assert _take(MixtureSampler(sizes, weights, seed=4), 50) != full[:50]
    ranks = [_take(MixtureSampler(sizes, weights, seed=3, start=5, rank=r, world_size=2), 40)
             for r in (0, 1)]
    assert [x for pair in zip(*ranks) for x in pair] == full[5:85]
    # each source's windows come in shuffled epochs: its first n draws are a permutation
    first = [i for i in full if i < 7][:7]
    assert sorted(first) == list(range(7))
    second = [i - 7 for i in full if i >= 7][:30]
    assert sorted(second) == list(range(30))


def _jsonl(path, n, word):
    path.write_text("".join(json.dumps({"content": f"{word} {i} " * 40}) + "\n"
                            for i in range(n)))
    return path


def test_mixture_draws_windows_in_proportion_to_weights(tiny_corpus, tmp_path):
    prose = _jsonl(tmp_path / "prose.jsonl", 80, "lorem ipsum dolor")
    sources = [{"source": str(tiny_corpus), "weight": 1},
               {"source": str(prose), "weight": 3, "text_field": "content"}]
    dm = datamodule("stdlib", tmp_path, sources=sources)
    assert [m["weight"] for m in dm.stats["mixture"]] == [1, 3]
    assert dm.stats["train_tokens"] == sum(len(t) for t in dm.train_shards)
    assert len(dm.val_tokens) == sum(len(v) for v in dm.val_shards)
    assert len(list((tmp_path / "cache" / "tokens").iterdir())) == 2, "one shard per source"
    n0 = len(dm.train_parts[0])
    draws = _take(dm.train_dataloader().sampler, 4000)
    from_code = sum(i < n0 for i in draws)
    # binomial(4000, 1/4): a 4-sigma bound
    assert abs(from_code - 1000) <= 4 * (4000 * 0.25 * 0.75) ** 0.5, from_code
    window = dm.train_set[draws[0]]
    part, offset = (0, draws[0]) if draws[0] < n0 else (1, draws[0] - n0)
    assert torch.equal(window, dm.train_parts[part][offset])
    batch = next(iter(dm.train_dataloader()))
    assert batch.shape == (4, 16 + 3)
    assert next(iter(dm.val_dataloader())).shape[1] == 19


def test_bad_mixtures_name_the_entry(tiny_corpus, tmp_path):
    ok = {"source": str(tiny_corpus)}
    with pytest.raises(ConfigError, match=r"--data\.sources\[1\]\.weight must be > 0"):
        DataConfig(sources=[ok, {"source": "x", "weight": 0}])
    with pytest.raises(ConfigError, match=r"--data\.sources\[0\] has unknown keys \['wieght'\]"):
        DataConfig(sources=[{"source": "x", "wieght": 2}])
    with pytest.raises(ConfigError, match=r"--data\.source .* and --data\.sources are both set"):
        DataConfig(source=str(tiny_corpus), sources=[ok])
    with pytest.raises(ConfigError, match=r"--data\.sources\[0\]\.max_tokens has the wrong type"):
        DataConfig(sources=[{"source": "x", "max_tokens": "many"}])
    missing = str(tmp_path / "nowhere" / "*.py")
    cfg = DataConfig(sources=[ok, {"source": missing}], cache_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"--data\.sources\[1\]\.source .*nowhere"):
        MTPDataModule(cfg, vocab_size=300, n_future=2).prepare_data()


def test_mixture_flag_parses_from_the_command_line_and_yaml(tmp_path):
    from lightning.pytorch.cli import LightningArgumentParser

    from mtp.train.cli import add_run_arguments, run_config

    parser = LightningArgumentParser(allow_abbrev=False)
    add_run_arguments(parser)
    ns = parser.parse_args(["--data.sources", "[{source: a/*.py, weight: 2}, {source: b.jsonl, "
                            "text_field: content, max_tokens: 1000}]", "--data.max_tokens", "5",
                            "--data.tokenize_workers", "2"])
    data_cfg = run_config(ns).data
    assert data_cfg.sources[1] == {"source": "b.jsonl", "text_field": "content",
                                   "max_tokens": 1000}
    assert data_cfg.max_tokens == 5 and data_cfg.tokenize_workers == 2
    specs = [SourceSpec(**{**s, "index": i}) for i, s in enumerate(data_cfg.sources)]
    assert specs[0].flag("weight") == "--data.sources[0].weight"
    yaml_ns = parser.parse_object({"data": {"sources": [{"source": "a", "weight": 0.5}]}})
    assert run_config(yaml_ns).data.sources == [{"source": "a", "weight": 0.5}]

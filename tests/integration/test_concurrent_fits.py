"""Two real `mtp fit` runs started at once in one directory: separate ``version_N`` folders,
one token cache (locked, released on exit), each run's weights those of a run alone."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from fit_helpers import ckpt_step, fit_args, prepare_cache, start, unlocked

from mtp.cli import main


@pytest.fixture(scope="module")
def cache(tiny_corpus, tmp_path_factory) -> Path:
    """The tokenizer and token shards of the debug config over the tiny corpus, built once."""
    return prepare_cache(tiny_corpus, tmp_path_factory.mktemp("cache"))


def test_two_runs_started_at_once_in_one_directory_keep_apart_and_share_one_cache(
        tiny_corpus, cache, tmp_path, monkeypatch):
    fresh = tmp_path / "cache"
    shutil.copytree(cache / "tokenizers", fresh / "tokenizers")  # both tokenise one shard at once
    args = fit_args(tiny_corpus, fresh, "--trainer.max_steps", "3")
    both = [start(args, tmp_path) for _ in range(2)]
    for proc in both:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
    runs = sorted((tmp_path / "runs" / "mtp").iterdir())
    assert [r.name for r in runs] == ["version_0", "version_1"]
    for run in runs:  # each its own config, event file and checkpoints
        assert len(list(run.glob("events.out.tfevents.*"))) == 1 and (run / "config.yaml").is_file()
        assert ckpt_step(run / "checkpoints" / "last.ckpt") == 3
    [shard] = (fresh / "tokens").iterdir()
    assert (shard / "meta.json").is_file() and unlocked(shard / "lock")
    alone = tmp_path / "alone"
    alone.mkdir()
    monkeypatch.chdir(alone)
    assert main(args) == 0
    weights = [torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
               for run in [*runs, alone / "runs" / "mtp" / "version_0"]]
    for other in weights[1:]:
        assert other.keys() == weights[0].keys()
        assert all(torch.equal(other[k], weights[0][k]) for k in weights[0])

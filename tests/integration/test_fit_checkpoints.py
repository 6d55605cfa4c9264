"""The checkpoints of a real `mtp fit`: ``last.ckpt`` is the latest state after every save,
whether the validation loss improved or not, and at the final step; never a ``last-v1.ckpt``."""

from __future__ import annotations

from pathlib import Path

import pytest
from fit_helpers import callbacks, ckpt_step, fit_args, prepare_cache, records

from mtp.cli import main


@pytest.fixture(scope="module")
def cache(tiny_corpus, tmp_path_factory) -> Path:
    """The tokenizer and token shards of the debug config over the tiny corpus, built once."""
    return prepare_cache(tiny_corpus, tmp_path_factory.mktemp("cache"))


def test_last_ckpt_is_the_latest_state_after_every_save_though_the_loss_rises(
        tiny_corpus, cache, tmp_path, monkeypatch, capsys):
    from mtp.train.module import MTPModule

    def rising(module, batch, batch_idx):  # the monitored loss: 2, 4, 6 at steps 2, 4, 6
        module.log("val/next_token_loss", float(module.global_step))

    monkeypatch.setattr(MTPModule, "validation_step", rising)
    monkeypatch.chdir(tmp_path)
    record = tmp_path / "seen.jsonl"
    assert main(fit_args(tiny_corpus, cache, "--trainer.max_steps", "7",
                      *callbacks(("Record", {"path": str(record)})))) == 0
    folder = tmp_path / "runs" / "mtp" / "version_0" / "checkpoints"
    # validations at steps 2, 4 and 6: last.ckpt holds each before the next step starts
    after_validation = [r["last"] for r in records(record) if r["event"] == "step"
                        and r["step"] in (2, 4, 6)]
    assert after_validation == [2, 4, 6]
    assert ckpt_step(folder / "last.ckpt") == 7  # the final step, between validations
    assert sorted(p.name for p in folder.iterdir()) == ["best-step=2.ckpt", "last.ckpt"]
    assert f"{folder.relative_to(tmp_path)}/last.ckpt (last), " \
           f"{folder.relative_to(tmp_path)}/best-step=2.ckpt (best)" in capsys.readouterr().out
    # a run that ends before its first validation: one last.ckpt, no last-v1.ckpt, no "(best)"
    assert main(fit_args(tiny_corpus, cache, "--trainer.max_steps", "1")) == 0
    folder = tmp_path / "runs" / "mtp" / "version_1" / "checkpoints"
    assert [p.name for p in folder.iterdir()] == ["last.ckpt"] and \
        ckpt_step(folder / "last.ckpt") == 1
    assert "(best)" not in capsys.readouterr().out


def test_with_the_heads_alone_training_the_best_checkpoint_has_the_most_tokens_per_forward(
        tiny_corpus, cache, tmp_path, monkeypatch):
    """`--optim.train heads` leaves head 1 and its loss as they were: the best checkpoint is the
    validation of most simulated tokens per forward, not the first one."""
    from mtp.train.module import MTPModule

    def heads_improve(module, batch, batch_idx):  # head 1 unchanged; the heads best at step 4
        module.log("val/next_token_loss", 3.0)
        module.log("val/sim_tokens_per_forward", {2: 1.2, 4: 1.5, 6: 1.4}[module.global_step])

    monkeypatch.setattr(MTPModule, "validation_step", heads_improve)
    monkeypatch.chdir(tmp_path)
    assert main(fit_args(tiny_corpus, cache, "--trainer.max_steps", "6",
                         "--optim.train", "heads")) == 0
    folder = tmp_path / "runs" / "mtp" / "version_0" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["best-step=4.ckpt", "last.ckpt"]

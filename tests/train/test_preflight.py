"""What `mtp fit` checks before it builds anything (`mtp.train.preflight`): where the run goes
(`--trainer.default_root_dir`), each `--trainer.*` flag honoured or refused with the reason, the
memory a run needs against the machine's, the room its checkpoints need; and a disk that fills
during the run named in one line."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import REPO
from fit_helpers import callbacks

from mtp.cli import main
from mtp.model.checkpoint import load_checkpoint

DEBUG = str(REPO / "configs" / "debug.yaml")
GiB = 1 << 30
#: The error comes before any data is read: this cache folder cannot be made, not even by root.
NO_DATA = ["--data.cache_dir", "/dev/null/cache"]


def _short(corpus, cache, *extra: str) -> list[str]:
    """`mtp fit` of the debug config for two steps."""
    return ["fit", "--config", DEBUG, "--data.source", str(corpus), "--data.cache_dir",
            str(cache), "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
            "--trainer.limit_val_batches", "1", "--trainer.enable_progress_bar", "false", *extra]


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """The working directory of the run under test: a folder of its own."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


def test_default_root_dir_decides_where_the_run_goes(tiny_corpus, tmp_path, in_tmp, capsys):
    """Issue 41, case 4: the logs, config and checkpoints go under --trainer.default_root_dir,
    nothing into the working directory; without a logger, the checkpoints go to
    DIR/checkpoints, as Lightning documents."""
    root = tmp_path / "DIR"
    assert main(_short(tiny_corpus, tmp_path / "cache", "--trainer.default_root_dir",
                       str(root))) == 0
    run = root / "runs" / "mtp" / "version_0"
    assert (run / "checkpoints" / "last.ckpt").is_file() and (run / "config.yaml").is_file()
    assert list(run.glob("events.out.tfevents.*"))
    assert list(in_tmp.iterdir()) == []
    out = capsys.readouterr().out
    assert f"checkpoints: {run / 'checkpoints' / 'last.ckpt'} (last)" in out
    assert f"tensorboard --logdir {root / 'runs' / 'mtp'}" in out
    assert load_checkpoint(run / "checkpoints" / "last.ckpt")[0].cfg.n_future == 2

    assert main(_short(tiny_corpus, tmp_path / "cache", "--trainer.default_root_dir",
                       str(root), "--trainer.logger", "false")) == 0
    assert (root / "checkpoints" / "last.ckpt").is_file() and list(in_tmp.iterdir()) == []


def test_a_read_only_or_too_small_default_root_dir_is_refused_before_the_data(
        tmp_path, in_tmp, monkeypatch, capsys):
    from disk_helpers import read_only_folder

    with read_only_folder(tmp_path / "ro") as ro:
        assert main(["fit", "--config", DEBUG, "--trainer.default_root_dir", str(ro),
                     *NO_DATA]) == 2
        err = capsys.readouterr().err
        assert f"cannot write the folder of the run's logs and checkpoints {ro}/runs/mtp: " in err
    monkeypatch.setattr("mtp.train.preflight.free_disk", lambda path: 100_000)
    assert main(["fit", "--config", DEBUG, "--trainer.default_root_dir", str(tmp_path / "small"),
                 *NO_DATA]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'small'}/runs/mtp/version_0: 97.7 KiB free on its disk, but a " \
           "checkpoint of this model takes about" in err and "Traceback" not in err


@pytest.mark.parametrize("args, message", [
    (["--model.n_future", "100000"], "lower --model.n_future 100000"),
    (["--data.batch_size", "100000000"], "lower --data.batch_size 100000000"),
    (["--trainer.devices", "1000"], "training in 1000 processes needs about"),
], ids=["n_future", "batch_size", "devices"])
def test_sizes_beyond_the_memory_are_refused_with_the_estimate(args, message, in_tmp,
                                                                monkeypatch, capsys):
    """Issue 41, case 1, as written, on a machine of 16 GiB available (the estimate of n_future
    100000 is 24.7 GiB): refused before the model is built, the estimate in the message."""
    monkeypatch.setattr("mtp.train.preflight.available_memory", lambda kind: 16 * GiB)
    assert main(["fit", "--config", DEBUG, *args, *NO_DATA]) == 2
    err = capsys.readouterr().err
    assert message in err and "more than the 16.0 GiB of memory available on the CPU" in err
    assert "training" in err and "needs about" in err


def test_a_size_beyond_any_machine_is_refused_with_the_real_memory(in_tmp, capsys):
    assert main(["fit", "--config", DEBUG, "--model.n_future", "10000000", *NO_DATA]) == 2
    err = capsys.readouterr().err
    assert "training needs about 2.4 TiB" in err and "lower --model.n_future 10000000" in err


@pytest.mark.parametrize("args, message", [
    (["--trainer.precision", "16-true"],
     "--trainer.precision 16-true: float16 weights train to NaN"),
    (["--trainer.use_distributed_sampler", "true"],
     "--trainer.use_distributed_sampler true: mtp's DataModule gives each rank"),
    (["--trainer.plugins", "lightning.pytorch.plugins.io.TorchCheckpointIO"],
     "--trainer.plugins lightning.pytorch.plugins.io.TorchCheckpointIO: mtp writes checkpoints"),
    (["--seed_everything", "99999999999"],
     "--seed_everything must be a whole number in [0, 4294967295]"),
    (["--trainer.devices", "0"],
     "Lightning's Trainer refuses the --trainer.* settings (--trainer.devices 0): "),
    (["--trainer.barebones", "true"],
     "(--trainer.barebones true): `Trainer(barebones=True, logger=TensorBoardLogger)`"),
], ids=["16-true", "distributed-sampler", "checkpoint-plugin", "seed", "devices-0", "barebones"])
def test_trainer_flags_mtp_cannot_honour_are_refused_with_the_reason(args, message, in_tmp,
                                                                     capsys):
    assert main(["fit", "--config", DEBUG, *args, *NO_DATA]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_settings_lightning_refuses_once_training_starts_are_named(tiny_corpus, tmp_path,
                                                                    in_tmp, capsys):
    assert main(_short(tiny_corpus, tmp_path / "cache", "--trainer.logger", "false",
                       "--trainer.callbacks", "lightning.pytorch.callbacks.LearningRateMonitor")
                ) == 2
    err = capsys.readouterr().err
    assert "Lightning's Trainer refuses the --trainer.* settings (" in err
    assert "--trainer.logger false, --trainer.callbacks lightning.pytorch.callbacks." \
           "LearningRateMonitor): Cannot use `LearningRateMonitor` callback with `Trainer` that " \
           "has no logger" in err and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is there to accelerate")
def test_an_accelerator_that_is_not_there_is_refused(in_tmp, capsys):
    assert main(["fit", "--config", DEBUG, "--trainer.accelerator", "gpu", *NO_DATA]) == 2
    assert "Lightning's Trainer refuses the --trainer.* settings (--trainer.accelerator gpu): " \
           "No supported gpu backend found!" in capsys.readouterr().err


def test_trainer_flags_that_mtp_honours(tiny_corpus, tmp_path, in_tmp, capsys):
    """`--trainer.precision` bf16-true and 64-true train with weights of that type;
    `--trainer.fast_dev_run` runs a step and writes nothing; a callback of the user's runs
    beside mtp's own."""
    for precision, dtype in (("bf16-true", torch.bfloat16), ("64-true", torch.float64)):
        root = tmp_path / precision
        assert main(_short(tiny_corpus, tmp_path / "cache", "--trainer.precision", precision,
                           "--trainer.default_root_dir", str(root))) == 0
        ckpt = torch.load(root / "runs/mtp/version_0/checkpoints/last.ckpt", weights_only=True)
        weights = ckpt["state_dict"]["model.embed.weight"]
        assert weights.dtype == dtype and torch.isfinite(weights).all()
    capsys.readouterr()
    assert main(_short(tiny_corpus, tmp_path / "cache", "--trainer.fast_dev_run", "true")) == 0
    assert "unigram entropy" in capsys.readouterr().out and list(in_tmp.iterdir()) == []
    record = tmp_path / "record.jsonl"
    assert main(_short(tiny_corpus, tmp_path / "cache", "--trainer.default_root_dir",
                       str(tmp_path / "cb"), *callbacks(("Record", {"path": str(record)})))) == 0
    rows = [json.loads(line) for line in record.read_text().splitlines()]
    assert rows[0] == {"event": "start", "step": 0} and rows[-1]["event"] == "end"
    assert (tmp_path / "cb/runs/mtp/version_0/checkpoints/last.ckpt").is_file()


def test_a_disk_that_fills_during_training_is_named(tiny_corpus, tmp_path, in_tmp, monkeypatch,
                                                    capsys):
    """A checkpoint write that fails names the checkpoint, and the one before stays whole; an
    error a logger meets (no file name) names the run's folder; exit 2 either way."""
    import os

    root = tmp_path / "DIR"
    real_fsync, saves = os.fsync, []

    def fsync(fd):  # the second checkpoint written (a temporary ``.<name>.ckpt.*.tmp``) fails
        name = os.readlink(f"/proc/self/fd/{fd}")
        if ".ckpt." in name and name.endswith(".tmp"):
            saves.append(name)
            if len(saves) > 2:
                raise OSError(28, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    args = _short(tiny_corpus, tmp_path / "cache", "--trainer.default_root_dir", str(root),
                  "--trainer.max_steps", "6")
    assert main(args) == 2
    err = capsys.readouterr().err
    folder = root / "runs" / "mtp" / "version_0" / "checkpoints"
    assert f"cannot write the checkpoint {folder}/" in err and "No space left on device" in err
    assert torch.load(folder / "last.ckpt", weights_only=True)["global_step"] == 2
    monkeypatch.undo()

    assert main(_short(tiny_corpus, tmp_path / "cache", "--trainer.default_root_dir", str(root),
                       *callbacks(("FillDisk", {"step": 1})))) == 2
    err = capsys.readouterr().err
    assert f"cannot write the run's logs or checkpoints {root}/runs/mtp/version_1: No space " \
           "left on device" in err and "Traceback" not in err


def test_init_from_without_safetensors_and_a_tokenizer_that_is_a_device(tmp_path, in_tmp,
                                                                         capsys):
    """Issue 41, cases 7 and 8: a transformers folder holding only pytorch_model.bin is named
    for what it holds before any data is read; `--data.tokenizer /dev/zero` is a device."""
    folder = tmp_path / "binonly"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 320, "hidden_size": 32, "num_attention_heads": 2,
        "num_hidden_layers": 2, "intermediate_size": 64, "max_position_embeddings": 64}))
    (folder / "pytorch_model.bin").write_bytes(b"a pickle")
    assert main(["fit", "--config", DEBUG, "--model.init_from", str(folder), *NO_DATA]) == 2
    err = capsys.readouterr().err
    assert f"--model.init_from {folder}: no model.safetensors (nor an index of shards) (it " \
           "holds pytorch_model.bin: pickled weights, which mtp does not load)" in err
    assert main(["fit", "--config", DEBUG, "--data.tokenizer", "/dev/zero", "--data.cache_dir",
                 str(tmp_path / "cache")]) == 2
    assert "--data.tokenizer /dev/zero is a character device, not a tokenizer file" in \
        capsys.readouterr().err

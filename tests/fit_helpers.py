"""What the tests of a real `mtp fit` run share: the callbacks that pause or watch the run under
test (the run imports them from this module by name, so this folder is on its PYTHONPATH), and
the test side: the run's arguments, starting it, signalling it at a stage, reading what it left.

Each run pauses at a chosen stage (a callback, or a hook into tokenisation) until the test has
sent its signal, so every signal lands where the test says.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import torch
import yaml

# Not conftest's REPO: the run under test imports this module, and conftest only belongs in pytest.
DEBUG = Path(__file__).resolve().parents[1] / "configs" / "debug.yaml"
MTP = str(Path(sys.executable).parent / "mtp")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
       "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent),
                                      os.environ.get("PYTHONPATH", "")])}


# -- what runs inside the `mtp fit` under test --------------------------------------------------


def _pause(folder: Path, stage: str) -> None:
    """Say where the run is, then wait until the test has sent its signal and says go."""
    (folder / f"at-{stage}").touch()
    deadline = time.monotonic() + 120
    while not (folder / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.02)


class _StallPickle:
    """Pickled inside a checkpoint: the write is in flight until the process is killed."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def __reduce__(self):
        _pause(Path(self.folder), "save")
        return (int, ())


class PauseAt(L.Callback):
    """Pause once, at the first `stage` ("step", "validation" or "save") from `step` on."""

    def __init__(self, stage: str, folder: str, step: int = 0) -> None:
        self.stage, self.folder, self.step, self.done = stage, Path(folder), step, False

    def _now(self, trainer, stage: str) -> bool:
        if self.done or stage != self.stage or trainer.global_step < self.step:
            return False
        self.done = True
        return True

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._now(trainer, "step"):
            _pause(self.folder, "step")

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx,
                                  dataloader_idx=0) -> None:
        if self._now(trainer, "validation"):
            _pause(self.folder, "validation")

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        if self._now(trainer, "save"):
            checkpoint["stall"] = _StallPickle(str(self.folder))


class Record(L.Callback):
    """Writes to `path`, one JSON line each: the step training starts at, and the step that
    ``last.ckpt`` holds before each step and at the end."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def _write(self, **row) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    def _last_step(self, trainer) -> int | None:
        last = Path(trainer.checkpoint_callback.dirpath) / "last.ckpt"
        return torch.load(last, weights_only=True)["global_step"] if last.is_file() else None

    def on_train_start(self, trainer, pl_module) -> None:
        self._write(event="start", step=trainer.global_step)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._write(event="step", step=trainer.global_step, last=self._last_step(trainer))

    def on_fit_end(self, trainer, pl_module) -> None:
        self._write(event="end", step=trainer.global_step, last=self._last_step(trainer))


class FillDisk(L.Callback):
    """Raise, at the end of training step `step`, the error a logger meets on a full disk: an
    OSError without a file name (a write of an open file)."""

    def __init__(self, step: int = 1) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step >= self.step:
            raise OSError(28, "No space left on device")


def pause_tokenising(folder: str) -> None:
    """Pause `mtp.data.shards` at its first batch of documents (no callback runs that early)."""
    import mtp.data.shards

    batches = mtp.data.shards.document_batches

    def paused(reader):
        for i, batch in enumerate(batches(reader)):
            if i == 0:  # the shard files are open, the encoding workers started
                _pause(Path(folder), "tokenising")
            yield batch

    mtp.data.shards.document_batches = paused


# -- the test side ------------------------------------------------------------------------------


def callbacks(*specs: tuple[str, dict]) -> list[str]:
    """`--trainer.callbacks` of the named callbacks of this module, each with its arguments."""
    return [f"--trainer.callbacks={json.dumps([{'class_path': f'fit_helpers.{name}', 'init_args': args} for name, args in specs])}"]  # noqa: E501


def prepare_cache(corpus: Path, root: Path) -> Path:
    """The tokenizer and token shards of the debug config over `corpus`, built under `root`."""
    from mtp.config import DataConfig
    from mtp.data import MTPDataModule

    cfg = yaml.safe_load(DEBUG.read_text())
    MTPDataModule(DataConfig(**{**cfg["data"], "source": str(corpus), "cache_dir": str(root)}),
                  vocab_size=cfg["model"]["vocab_size"],
                  n_future=cfg["model"]["n_future"]).prepare_data()
    return root


def fit_args(corpus: Path, cache: Path, *extra: str) -> list[str]:
    """`mtp fit` of the debug config: validation every 2 steps, up to 1000 steps."""
    return ["fit", "--config", str(DEBUG), "--data.source", str(corpus), "--data.cache_dir",
            str(cache), "--trainer.enable_progress_bar", "false", "--trainer.val_check_interval",
            "2", "--trainer.limit_val_batches", "1", "--trainer.max_steps", "1000", *extra]


def start(argv: list[str], cwd: Path, *, python: str | None = None) -> subprocess.Popen:
    """`mtp argv` in a process of its own (or `python -c python argv`), its output piped."""
    command = [MTP, *argv] if python is None else [sys.executable, "-c", python, *argv]
    return subprocess.Popen(command, cwd=cwd, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def signal_at(proc: subprocess.Popen, folder: Path, stage: str,
              signum: int = signal.SIGTERM) -> tuple[str, str]:
    """Wait until the run pauses at `stage`, send `signum`, let it go on; its output."""
    deadline = time.monotonic() + 180
    while not (folder / f"at-{stage}").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signum)
    (folder / "go").touch()
    return proc.communicate(timeout=120)


def ckpt_step(path: Path) -> int:
    """The global step a checkpoint holds."""
    return torch.load(path, weights_only=True)["global_step"]


def records(path: Path) -> list[dict]:
    """The rows `Record` wrote."""
    return [json.loads(line) for line in path.read_text().splitlines()]


def unlocked(lock: Path) -> bool:
    """Whether no process holds the flock of `lock`."""
    with open(lock, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

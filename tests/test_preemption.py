"""Preemption of a real `mtp fit` at every stage (what SLURM does at the time limit): SIGTERM
during tokenisation, a training step or validation exits 143 with what it can keep and the
command that goes on from there; a kill -9 in the middle of a checkpoint write loses nothing
and leaves no temporary file once the next run starts; ``last.ckpt`` is the latest state after
every save; two runs started at once in one directory keep apart and share one token cache.

Each run pauses at a chosen stage (a callback, or a hook into tokenisation) until the test has
sent its signal, so every signal lands where the test says.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml

from mtp.cli import main
from mtp.train.fault import resume_command

REPO = Path(__file__).resolve().parents[1]
DEBUG = REPO / "configs" / "debug.yaml"
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


def _callbacks(*specs: tuple[str, dict]) -> list[str]:
    return [f"--trainer.callbacks={json.dumps([{'class_path': f'test_preemption.{name}', 'init_args': args} for name, args in specs])}"]  # noqa: E501


@pytest.fixture(scope="module")
def cache(tiny_corpus, tmp_path_factory) -> Path:
    """The tokenizer and token shards of the debug config over the tiny corpus, built once."""
    from mtp.config import DataConfig
    from mtp.data import MTPDataModule

    cfg = yaml.safe_load(DEBUG.read_text())
    root = tmp_path_factory.mktemp("cache")
    MTPDataModule(DataConfig(**{**cfg["data"], "source": str(tiny_corpus),
                                "cache_dir": str(root)}),
                  vocab_size=cfg["model"]["vocab_size"],
                  n_future=cfg["model"]["n_future"]).prepare_data()
    return root


def _args(corpus: Path, cache: Path, *extra: str) -> list[str]:
    return ["fit", "--config", str(DEBUG), "--data.source", str(corpus), "--data.cache_dir",
            str(cache), "--trainer.enable_progress_bar", "false", "--trainer.val_check_interval",
            "2", "--trainer.limit_val_batches", "1", "--trainer.max_steps", "1000", *extra]


def _start(argv: list[str], cwd: Path, *, python: str | None = None) -> subprocess.Popen:
    command = [MTP, *argv] if python is None else [sys.executable, "-c", python, *argv]
    return subprocess.Popen(command, cwd=cwd, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _signal_at(proc: subprocess.Popen, folder: Path, stage: str,
               signum: int = signal.SIGTERM) -> tuple[str, str]:
    """Wait until the run pauses at `stage`, send `signum`, let it go on; its output."""
    deadline = time.monotonic() + 180
    while not (folder / f"at-{stage}").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signum)
    (folder / "go").touch()
    return proc.communicate(timeout=120)


def _step(path: Path) -> int:
    return torch.load(path, weights_only=True)["global_step"]


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _unlocked(lock: Path) -> bool:
    with open(lock, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True


def _resumed(out: str, args: list[str], step: int, tmp_path: Path, monkeypatch,
             end: int) -> list[dict]:
    """Check the printed checkpoint and command, run the command in-process up to `end` (its
    callbacks replaced by `Record`); what `Record` saw of the resumed run."""
    saved = re.search(r"checkpoint of step (\d+) in (\S+)\nresume with:\n  (.+)\n", out)
    assert saved, out
    assert int(saved[1]) == step and _step(tmp_path / saved[2]) == step
    assert _step(Path(tmp_path / saved[2]).parent / "last.ckpt") == step  # last is the latest
    assert saved[3] == resume_command(args, saved[2])
    record = tmp_path / "resumed.jsonl"
    monkeypatch.chdir(tmp_path)
    assert main(shlex.split(saved[3])[1:] + ["--trainer.max_steps", str(end),
                                             *_callbacks(("Record", {"path": str(record)}))]) == 0
    return _records(record)


def test_sigterm_during_tokenisation_exits_143_and_the_same_command_continues(
        tiny_corpus, cache, tmp_path, monkeypatch):
    fresh = tmp_path / "cache"
    shutil.copytree(cache / "tokenizers", fresh / "tokenizers")  # only the shards to build
    args = _args(tiny_corpus, fresh, "--trainer.max_steps", "1")
    wrapper = ("import sys; from test_preemption import pause_tokenising; "
               f"pause_tokenising({str(tmp_path)!r}); from mtp.cli import main; "
               "sys.exit(main(sys.argv[1:]))")
    out, err = _signal_at(_start(args, tmp_path, python=wrapper), tmp_path, "tokenising")
    assert "stopped by SIGTERM during data preparation" in out, (out, err[-3000:])
    assert out.rstrip().endswith(shlex.join(["mtp", *args])), out
    assert "Traceback" not in err, err[-3000:]
    [shard] = (fresh / "tokens").iterdir()
    assert not (shard / "meta.json").exists() and _unlocked(shard / "lock")
    assert not (tmp_path / "runs" / "mtp" / "version_0" / "checkpoints").exists()
    monkeypatch.chdir(tmp_path)
    assert main(args) == 0  # the printed command, as is
    assert (shard / "meta.json").is_file() and [p.name for p in (fresh / "tokens").iterdir()] \
        == [shard.name]


def test_a_sigterm_as_the_tokenising_workers_start_stops_the_run_once_they_have(
        tiny_corpus, tmp_path):
    """A SIGTERM handled while `os.fork` starts a worker (taken by another thread, as the kernel
    may deliver it) waits until the workers have started, then stops data preparation where the
    pool closes; raised in a callback of the fork, Python would print and ignore it, or it would
    leave workers that nothing stops."""
    from mtp.config import DataConfig
    from mtp.data import MTPDataModule
    from mtp.train.fault import Interruptible, Stopped

    release = threading.Event()
    other = threading.Thread(target=release.wait)
    other.start()
    armed = [True]

    def after_fork() -> None:  # in the parent, after each fork
        if armed[0]:
            armed[0] = False
            signal.pthread_kill(other.ident, signal.SIGTERM)
            time.sleep(0.05)  # Python code of the callback: where the handler runs

    os.register_at_fork(after_in_parent=after_fork)
    cfg = yaml.safe_load(DEBUG.read_text())
    data = MTPDataModule(DataConfig(**{**cfg["data"], "source": str(tiny_corpus),
                                       "cache_dir": str(tmp_path), "tokenize_workers": 2}),
                         vocab_size=cfg["model"]["vocab_size"], n_future=cfg["model"]["n_future"])
    stop = Interruptible(["fit"])
    stop.install()
    try:
        with pytest.raises(Stopped):
            data.prepare_data()
    finally:
        armed[0] = False
        stop.uninstall()
        release.set()
        other.join()
    assert stop.requested == signal.SIGTERM and not armed[0]
    [shard] = (tmp_path / "tokens").iterdir()
    assert not (shard / "meta.json").exists() and _unlocked(shard / "lock")


@pytest.mark.parametrize("stage, step", [("step", 3), ("validation", 4)])
def test_sigterm_during_a_step_or_validation_exits_143_and_the_command_resumes_there(
        stage, step, tiny_corpus, cache, tmp_path, monkeypatch):
    """During a step, the step in flight (the 4th) ends before the checkpoint; during the
    step-4 validation, it stops within it and keeps step 4. Either way the printed command
    resumes at step 4."""
    args = _args(tiny_corpus, cache, *_callbacks(("PauseAt", {"stage": stage, "step": step,
                                                              "folder": str(tmp_path)})))
    proc = _start(args, tmp_path)
    out, err = _signal_at(proc, tmp_path, stage)
    assert proc.returncode == 128 + signal.SIGTERM, (out, err[-3000:])
    if stage == "validation":
        assert "validation at step 4" not in out  # stopped within it, not after it
    seen = _resumed(out, args, 4, tmp_path, monkeypatch, end=6)
    assert seen[0] == {"event": "start", "step": 4} and seen[-1]["last"] == 6
    assert [r["step"] for r in seen if r["event"] == "step"] == [4, 5]


def test_under_slurm_sigusr1_requeues_and_the_requeued_job_resumes_at_the_sigterm_step(
        tiny_corpus, cache, tmp_path):
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'scontrol.txt'}\n")
    (bin_ / "scontrol").chmod(0o755)
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "1", "SLURM_JOB_NAME": "mtp-fit",
             "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
             "PATH": f"{bin_}{os.pathsep}{os.environ['PATH']}"}
    requeue = {"class_path": "lightning.fabric.plugins.environments.SLURMEnvironment",
               "init_args": {"auto_requeue": True}}
    args = _args(tiny_corpus, cache, f"--trainer.plugins={json.dumps(requeue)}",
                 *_callbacks(("PauseAt", {"stage": "step", "step": 3, "folder": str(tmp_path)})))
    proc = subprocess.Popen([MTP, *args], cwd=tmp_path, env={**ENV, **slurm},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while not (tmp_path / "at-step").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)  # SLURM's warning before the time limit (--signal=USR1@90)
    while not (tmp_path / "scontrol.txt").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # then the requeue stops the job
    (tmp_path / "go").touch()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, (out, err[-3000:])
    assert (tmp_path / "scontrol.txt").read_text() == "requeue 4242\n"
    assert _step(tmp_path / "hpc_ckpt_1.ckpt") == 3  # Lightning's, at the warning
    assert _step(tmp_path / "hpc_ckpt_2.ckpt") == 4  # the newest, which the requeued job takes
    assert "checkpoint of step 4" in out


def test_kill_9_during_a_checkpoint_write_keeps_the_previous_one_and_the_next_run_cleans_up(
        tiny_corpus, cache, tmp_path, monkeypatch):
    args = _args(tiny_corpus, cache)
    proc = _start(args + _callbacks(("PauseAt", {"stage": "save", "folder": str(tmp_path),
                                                 "step": 4})), tmp_path)
    out, err = _signal_at(proc, tmp_path, "save", signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    folder = tmp_path / "runs" / "mtp" / "version_0" / "checkpoints"
    assert len(list(folder.glob(".*.tmp"))) == 1  # the write that was killed
    assert _step(folder / "last.ckpt") == 2 and _step(folder / "best-step=2.ckpt") == 2
    record = tmp_path / "resumed.jsonl"
    monkeypatch.chdir(tmp_path)
    assert main(args + ["--trainer.max_steps", "4", "--ckpt_path", str(folder / "last.ckpt"),
                        *_callbacks(("Record", {"path": str(record)}))]) == 0
    assert not list((tmp_path / "runs").rglob("*.tmp"))
    seen = _records(record)
    assert seen[0] == {"event": "start", "step": 2} and seen[-1]["last"] == 4


def test_last_ckpt_is_the_latest_state_after_every_save_though_the_loss_rises(
        tiny_corpus, cache, tmp_path, monkeypatch, capsys):
    from mtp.train.module import MTPModule

    def rising(module, batch, batch_idx):  # the monitored loss: 2, 4, 6 at steps 2, 4, 6
        module.log("val/next_token_loss", float(module.global_step))

    monkeypatch.setattr(MTPModule, "validation_step", rising)
    monkeypatch.chdir(tmp_path)
    record = tmp_path / "seen.jsonl"
    assert main(_args(tiny_corpus, cache, "--trainer.max_steps", "7",
                      *_callbacks(("Record", {"path": str(record)})))) == 0
    folder = tmp_path / "runs" / "mtp" / "version_0" / "checkpoints"
    # validations at steps 2, 4 and 6: last.ckpt holds each before the next step starts
    after_validation = [r["last"] for r in _records(record) if r["event"] == "step"
                        and r["step"] in (2, 4, 6)]
    assert after_validation == [2, 4, 6]
    assert _step(folder / "last.ckpt") == 7  # the final step, between validations
    assert sorted(p.name for p in folder.iterdir()) == ["best-step=2.ckpt", "last.ckpt"]
    assert f"{folder.relative_to(tmp_path)}/last.ckpt (last), " \
           f"{folder.relative_to(tmp_path)}/best-step=2.ckpt (best)" in capsys.readouterr().out
    # a run that ends before its first validation: one last.ckpt, no last-v1.ckpt, no "(best)"
    assert main(_args(tiny_corpus, cache, "--trainer.max_steps", "1")) == 0
    folder = tmp_path / "runs" / "mtp" / "version_1" / "checkpoints"
    assert [p.name for p in folder.iterdir()] == ["last.ckpt"] and _step(folder / "last.ckpt") == 1
    assert "(best)" not in capsys.readouterr().out


def test_two_runs_started_at_once_in_one_directory_keep_apart_and_share_one_cache(
        tiny_corpus, cache, tmp_path, monkeypatch):
    fresh = tmp_path / "cache"
    shutil.copytree(cache / "tokenizers", fresh / "tokenizers")  # both tokenise one shard at once
    args = _args(tiny_corpus, fresh, "--trainer.max_steps", "3")
    both = [_start(args, tmp_path) for _ in range(2)]
    for proc in both:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
    runs = sorted((tmp_path / "runs" / "mtp").iterdir())
    assert [r.name for r in runs] == ["version_0", "version_1"]
    for run in runs:  # each its own config, event file and checkpoints
        assert len(list(run.glob("events.out.tfevents.*"))) == 1 and (run / "config.yaml").is_file()
        assert _step(run / "checkpoints" / "last.ckpt") == 3
    [shard] = (fresh / "tokens").iterdir()
    assert (shard / "meta.json").is_file() and _unlocked(shard / "lock")
    alone = tmp_path / "alone"
    alone.mkdir()
    monkeypatch.chdir(alone)
    assert main(args) == 0
    weights = [torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
               for run in [*runs, alone / "runs" / "mtp" / "version_0"]]
    for other in weights[1:]:
        assert other.keys() == weights[0].keys()
        assert all(torch.equal(other[k], weights[0][k]) for k in weights[0])


"""`mtp fit` loses nothing when stopped: SIGINT saves the interrupted step and prints the command
that resumes there; a failed checkpoint write leaves the previous checkpoint whole."""

from __future__ import annotations

import errno
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mtp.cli import main
from mtp.train.fault import AtomicCheckpointIO, resume_command

MTP = str(Path(sys.executable).parent / "mtp")


def test_sigint_saves_the_interrupted_step_and_the_printed_command_resumes_there(
        tiny_corpus, tmp_path, monkeypatch):
    args = ["fit", "--config", str(REPO / "configs" / "debug.yaml"), "--data.source",
            str(tiny_corpus), "--data.cache_dir", str(tmp_path / "cache"),
            "--trainer.max_steps", "1000000", "--trainer.enable_progress_bar", "false"]
    proc = subprocess.Popen([MTP, *args], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    ckpts = tmp_path / "runs" / "mtp" / "version_0" / "checkpoints"
    deadline = time.monotonic() + 300
    while not list(ckpts.glob("best-*.ckpt")):  # training is under way
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, err[-3000:]
    saved = re.search(r"checkpoint of step (\d+) in (\S+)", out)
    assert saved, out
    step, path = int(saved[1]), Path(saved[2])
    assert not list(path.parent.glob(".*.tmp"))  # no temporary file left
    assert torch.load(tmp_path / path, weights_only=True)["global_step"] == step > 0
    command = out.split("resume with:\n", 1)[1].strip()
    assert command == resume_command(args, path)
    # last.ckpt is written at validation, every 10 steps in the debug config
    end = (step // 10 + 2) * 10
    monkeypatch.chdir(tmp_path)
    assert main(shlex.split(command)[1:] + ["--trainer.max_steps", str(end)]) == 0
    last = tmp_path / "runs" / "mtp" / "version_1" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == end
    events = EventAccumulator(str(last.parents[1]))
    events.Reload()
    first = min(e.step for e in events.Scalars("train/loss"))
    assert step <= first < step + 10  # went on from the interrupted step, not from 0


def test_a_failed_checkpoint_write_leaves_the_previous_one(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"global_step": 1, "w": torch.ones(3)}, path)
    real_save = torch.save

    def disk_full(obj, f, *a, **kw):
        real_save(obj, f, *a, **kw)  # the bytes went out, then the disk filled up
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        io.save_checkpoint({"global_step": 2, "w": torch.zeros(3)}, path)
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]
    assert torch.load(path, weights_only=True)["global_step"] == 1


def test_resume_command_replaces_the_checkpoint():
    assert resume_command(["fit", "--ckpt_path", "old.ckpt", "--x", "1"], "new.ckpt") == \
        "mtp fit --x 1 --ckpt_path new.ckpt"
    assert resume_command(["fit", "--ckpt_path=old.ckpt"], "a b.ckpt") == \
        "mtp fit --ckpt_path 'a b.ckpt'"


def test_a_run_ending_between_validations_keeps_its_last_steps(tiny_corpus, tmp_path,
                                                               monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["fit", "--config", str(REPO / "configs" / "debug.yaml"), "--data.source",
                 str(tiny_corpus), "--trainer.max_steps", "13",
                 "--trainer.enable_progress_bar", "false"]) == 0  # validation every 10 steps
    last = tmp_path / "runs" / "mtp" / "version_0" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 13

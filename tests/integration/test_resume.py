"""A real `mtp fit` stopped at every stage and resumed (what SLURM does at the time limit):
SIGTERM during tokenisation, a training step or validation exits 143 with what it can keep and
the command that goes on from there; under SLURM, SIGUSR1 requeues the job, which resumes at the
SIGTERM's step; a kill -9 in the middle of a checkpoint write loses nothing and leaves no
temporary file once the next run starts.

Each run pauses at a chosen stage (`fit_helpers`) until the test has sent its signal, so every
signal lands where the test says.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from fit_helpers import (
    ENV,
    MTP,
    callbacks,
    ckpt_step,
    fit_args,
    prepare_cache,
    records,
    signal_at,
    start,
    unlocked,
)

from mtp.cli import main
from mtp.train.fault import resume_command


@pytest.fixture(scope="module")
def cache(tiny_corpus, tmp_path_factory) -> Path:
    """The tokenizer and token shards of the debug config over the tiny corpus, built once."""
    return prepare_cache(tiny_corpus, tmp_path_factory.mktemp("cache"))


def _resumed(out: str, args: list[str], step: int, tmp_path: Path, monkeypatch,
             end: int) -> list[dict]:
    """Check the printed checkpoint and command, run the command in-process up to `end` (its
    callbacks replaced by `Record`); what `Record` saw of the resumed run."""
    saved = re.search(r"checkpoint of step (\d+) in (\S+)\nresume with:\n  (.+)\n", out)
    assert saved, out
    assert int(saved[1]) == step and ckpt_step(tmp_path / saved[2]) == step
    assert ckpt_step(Path(tmp_path / saved[2]).parent / "last.ckpt") == step  # last is the latest
    assert saved[3] == resume_command(args, saved[2])
    record = tmp_path / "resumed.jsonl"
    monkeypatch.chdir(tmp_path)
    assert main(shlex.split(saved[3])[1:] + ["--trainer.max_steps", str(end),
                                             *callbacks(("Record", {"path": str(record)}))]) == 0
    return records(record)


def test_sigterm_during_tokenisation_exits_143_and_the_same_command_continues(
        tiny_corpus, cache, tmp_path, monkeypatch):
    fresh = tmp_path / "cache"
    shutil.copytree(cache / "tokenizers", fresh / "tokenizers")  # only the shards to build
    args = fit_args(tiny_corpus, fresh, "--trainer.max_steps", "1")
    wrapper = ("import sys; from fit_helpers import pause_tokenising; "
               f"pause_tokenising({str(tmp_path)!r}); from mtp.cli import main; "
               "sys.exit(main(sys.argv[1:]))")
    out, err = signal_at(start(args, tmp_path, python=wrapper), tmp_path, "tokenising")
    assert "stopped by SIGTERM during data preparation" in out, (out, err[-3000:])
    assert out.rstrip().endswith(shlex.join(["mtp", *args])), out
    assert "Traceback" not in err, err[-3000:]
    [shard] = (fresh / "tokens").iterdir()
    assert not (shard / "meta.json").exists() and unlocked(shard / "lock")
    assert not (tmp_path / "runs" / "mtp" / "version_0" / "checkpoints").exists()
    monkeypatch.chdir(tmp_path)
    assert main(args) == 0  # the printed command, as is
    assert (shard / "meta.json").is_file() and [p.name for p in (fresh / "tokens").iterdir()] \
        == [shard.name]


@pytest.mark.parametrize("stage, step", [("step", 3), ("validation", 4)])
def test_sigterm_during_a_step_or_validation_exits_143_and_the_command_resumes_there(
        stage, step, tiny_corpus, cache, tmp_path, monkeypatch):
    """During a step, the step in flight (the 4th) ends before the checkpoint; during the
    step-4 validation, it stops within it and keeps step 4. Either way the printed command
    resumes at step 4."""
    args = fit_args(tiny_corpus, cache, *callbacks(("PauseAt", {"stage": stage, "step": step,
                                                              "folder": str(tmp_path)})))
    proc = start(args, tmp_path)
    out, err = signal_at(proc, tmp_path, stage)
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
    args = fit_args(tiny_corpus, cache, f"--trainer.plugins={json.dumps(requeue)}",
                 *callbacks(("PauseAt", {"stage": "step", "step": 3, "folder": str(tmp_path)})))
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
    assert ckpt_step(tmp_path / "hpc_ckpt_1.ckpt") == 3  # Lightning's, at the warning
    assert ckpt_step(tmp_path / "hpc_ckpt_2.ckpt") == 4  # the newest, which the requeued job takes
    assert "checkpoint of step 4" in out


def test_kill_9_during_a_checkpoint_write_keeps_the_previous_one_and_the_next_run_cleans_up(
        tiny_corpus, cache, tmp_path, monkeypatch):
    args = fit_args(tiny_corpus, cache)
    proc = start(args + callbacks(("PauseAt", {"stage": "save", "folder": str(tmp_path),
                                                 "step": 4})), tmp_path)
    out, err = signal_at(proc, tmp_path, "save", signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    folder = tmp_path / "runs" / "mtp" / "version_0" / "checkpoints"
    assert len(list(folder.glob(".*.tmp"))) == 1  # the write that was killed
    assert ckpt_step(folder / "last.ckpt") == 2 and ckpt_step(folder / "best-step=2.ckpt") == 2
    record = tmp_path / "resumed.jsonl"
    monkeypatch.chdir(tmp_path)
    assert main(args + ["--trainer.max_steps", "4", "--ckpt_path", str(folder / "last.ckpt"),
                        *callbacks(("Record", {"path": str(record)}))]) == 0
    assert not list((tmp_path / "runs").rglob("*.tmp"))
    seen = records(record)
    assert seen[0] == {"event": "start", "step": 2} and seen[-1]["last"] == 4

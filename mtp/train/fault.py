"""Nothing lost when `mtp fit` is stopped: checkpoints are never half-written
(`AtomicCheckpointIO`: temporary file, fsync, rename), ``last.ckpt`` is always the latest state,
and one SIGINT / SIGTERM handler (`Interruptible`) lets the step, write or validation batch in
flight finish, keeps what it can, prints the command that goes on from there and exits 128 + the
signal. What a signal does at each stage of a run: docs/faults.md, "Stopping `mtp fit`".
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import threading
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from mtp.util.atomic import atomic_file, atomic_write, lock

__all__ = ["AtomicCheckpointIO", "Interruptible", "Stopped", "remove_stale_temporaries",
           "resume_command"]

log = logging.getLogger(__name__)

LAST = "last.ckpt"


def _tmp_prefix(name: str) -> str:
    return f".{name}."


class AtomicCheckpointIO(TorchCheckpointIO):
    """`TorchCheckpointIO` whose local saves are atomic (temporary file, fsync, rename)."""

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        if "://" in str(path):  # remote storage: fsspec's own transaction
            return super().save_checkpoint(checkpoint, path, storage_options)
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO takes no storage_options")
        # The lock tells `remove_stale_temporaries` the file is being written; it is held
        # until the rename, so it covers the temporary file's whole life.
        with atomic_file(path, "wb", prefix=_tmp_prefix(Path(path).name),
                         what="the checkpoint") as f:
            lock(f, blocking=True)
            torch.save(checkpoint, f)


def remove_stale_temporaries(folder: str | os.PathLike) -> list[Path]:
    """Delete the temporary files of `AtomicCheckpointIO` in `folder` that no live process is
    writing (a ``kill -9`` mid-write leaves one behind); returns the deleted paths.

    A writer holds an exclusive lock on its temporary file until it is renamed, so a file whose
    lock can be taken belongs to a process that has ended.
    """
    removed = []
    for tmp in sorted(Path(folder).glob(".*.ckpt.*.tmp")):
        try:
            with open(tmp, "rb") as f:
                if not lock(f, blocking=False):
                    continue  # being written right now
                tmp.unlink()
        except OSError:  # gone meanwhile, or not ours to delete
            continue
        removed.append(tmp)
    if removed:
        log.warning("removed %d temporary checkpoint file(s) of a write that was killed: %s",
                    len(removed), ", ".join(p.name for p in removed))
    return removed


def link_last(path: Path) -> Path:
    """Make ``last.ckpt`` beside `path` the same file as `path`."""
    return _link(path, path.parent / LAST)


def _link(path: Path, target: Path) -> Path:
    """`target` becomes the same file as `path`: a hard link renamed into place, so it costs no
    copy and is never half there; a copy where links are not supported."""
    if path.resolve() == target.resolve():
        return target

    def link(tmp: Path) -> None:
        os.unlink(tmp)
        try:
            os.link(path, tmp)
        except OSError:
            import shutil

            shutil.copyfile(path, tmp)

    atomic_write(target, link, prefix=_tmp_prefix(target.name), what="the checkpoint")
    return target


def _requeue_checkpoint(trainer) -> Path | None:
    """Under SLURM with ``auto_requeue``, the path of the next ``hpc_ckpt_N.ckpt``: a requeued
    job that is given no ``--ckpt_path`` resumes from the highest N (Lightning's rule)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    env = trainer._accelerator_connector.cluster_environment
    if not isinstance(env, SLURMEnvironment) or not env.auto_requeue:
        return None
    return Path(trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir))


def resume_command(argv: list[str], ckpt: str | os.PathLike) -> str:
    """`mtp <argv>` with its ``--ckpt_path`` (if any) replaced by `ckpt`."""
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--ckpt_path":
            skip = True
        elif not a.startswith("--ckpt_path="):
            kept.append(a)
    return shlex.join(["mtp", *kept, "--ckpt_path", str(ckpt)])


class Stopped(BaseException):
    """A SIGINT / SIGTERM honoured where no training step is in flight. A BaseException, like
    KeyboardInterrupt, so that no ``except Exception`` on the way swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def _held(signum: int) -> bool:
    """Whether the code running now holds `signum` back: blocked in this thread, as while the
    tokenising workers start (`mtp.data.encoder_pool`), where a raise would be lost."""
    return hasattr(signal, "pthread_sigmask") and \
        signum in signal.pthread_sigmask(signal.SIG_BLOCK, ())


class Interruptible(L.Callback):
    """The SIGINT / SIGTERM handler of `mtp fit` at every stage (see the module docstring)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, argv: list[str]) -> None:
        self.argv = list(argv)
        self.requested: int | None = None
        self.checkpoint: Path | None = None  # the checkpoint that the resume command names
        self._checkpoint_step = -1
        self.stage = "data preparation"
        self._training = False  # a step may be in flight: defer the stop to its end
        self._saved_step = -1  # the step of the latest checkpoint saved
        self._previous: dict[int, object] = {}
        self._global_zero = True
        self.folder: Path | None = None  # the run's logs and checkpoints, once it is set up

    # -- the handler -----------------------------------------------------------------------------
    def install(self) -> None:
        """Take SIGINT and SIGTERM (before anything is prepared); `uninstall` gives them back."""
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous.setdefault(sig, signal.signal(sig, self._handle))

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        if _held(signum):  # another thread took it: pending here, it comes back when released
            signal.pthread_kill(threading.get_ident(), signum)
            return
        if self.requested is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: now
        if self.requested is None:
            self.requested = signum
        if not self._training:
            raise Stopped(signum)

    # -- stages ----------------------------------------------------------------------------------
    def setup(self, trainer, pl_module, stage) -> None:
        self._global_zero = trainer.is_global_zero
        self.folder = Path(trainer.log_dir or trainer.default_root_dir)

    def on_fit_start(self, trainer, pl_module) -> None:
        self.stage = "the start of training"
        folders = {Path(c.dirpath) for c in trainer.checkpoint_callbacks if c.dirpath}
        if trainer.ckpt_path and "://" not in str(trainer.ckpt_path):
            folders.add(Path(trainer.ckpt_path).parent)
        for folder in folders:
            if trainer.is_global_zero and folder.is_dir():
                remove_stale_temporaries(folder)

    def on_train_start(self, trainer, pl_module) -> None:
        # Lightning registered its own SIGTERM handler after on_fit_start: take it back (one
        # handler; Lightning's raises a SIGTERMException that exits 0 and saves nothing).
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                signal.signal(sig, self._handle)
        self.stage, self._training = "training", True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._stop_requested(trainer) and self.checkpoint is None:
            self._save_interrupted(trainer)
            trainer.should_stop = True

    def on_validation_start(self, trainer, pl_module) -> None:
        if self._training:
            self.stage = "validation"

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx,
                                dataloader_idx=0) -> None:
        if self._training and self._stop_requested(trainer):
            # the weights are those of the last step: keep them, skip the rest of validation
            if self.checkpoint is None:
                self._save_interrupted(trainer)
            raise Stopped(self.requested)

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._training:
            self.stage = "training"

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self._saved_step = trainer.global_step

    def on_train_end(self, trainer, pl_module) -> None:
        """A run that ends between validations keeps its last steps: ``last.ckpt`` is written
        at the final step too (Lightning writes it only after a validation)."""
        folder = None if trainer.fast_dev_run else self._folder(trainer)  # writes nothing
        if folder is not None:
            if self._saved_step != trainer.global_step:
                trainer.save_checkpoint(folder / LAST)
            if self.checkpoint is None:  # a signal from here on resumes (and ends) here
                self.checkpoint, self._checkpoint_step = folder / LAST, trainer.global_step
        self._training, self.stage = False, "the end of training"

    def _stop_requested(self, trainer) -> bool:
        stop = trainer.strategy.reduce_boolean_decision(self.requested is not None, all=False)
        if stop and self.requested is None:  # the signal reached another rank: all stop alike
            self.requested = signal.SIGTERM
        return stop

    def _folder(self, trainer) -> Path | None:
        callback = trainer.checkpoint_callback
        if callback is None:
            return None
        return Path(callback.dirpath) if callback.dirpath else \
            Path(trainer.default_root_dir) / "checkpoints"

    def _save_interrupted(self, trainer) -> None:
        folder = self._folder(trainer) or Path(trainer.default_root_dir) / "checkpoints"
        self.checkpoint = folder / f"interrupted-step={trainer.global_step}.ckpt"
        self._checkpoint_step = trainer.global_step
        trainer.save_checkpoint(self.checkpoint)
        if trainer.is_global_zero:
            link_last(self.checkpoint)
            requeue = _requeue_checkpoint(trainer)
            if requeue is not None:  # the requeued job resumes from here, not the older one
                _link(self.checkpoint, requeue)

    # -- the end ---------------------------------------------------------------------------------
    def report(self) -> int | None:
        """Print (on rank 0) where the interrupted run was saved and how to go on; the exit
        status of every rank (128 + the signal), or None if the run was not interrupted."""
        if self.requested is None:
            return None
        if not self._global_zero:
            return 128 + self.requested
        name = signal.Signals(self.requested).name
        if self.checkpoint is not None:
            print(f"\nstopped by {name}: checkpoint of step {self._checkpoint_step} in "
                  f"{self.checkpoint}\nresume with:\n  "
                  f"{resume_command(self.argv, self.checkpoint)}", flush=True)
        elif self.stage == "data preparation":
            print(f"\nstopped by {name} during data preparation: the token shards keep their "
                  f"last checkpoint, and the same command continues them:\n  "
                  f"{shlex.join(['mtp', *self.argv])}", flush=True)
        else:
            print(f"\nstopped by {name} during {self.stage}, before a training step of this "
                  f"run had ended: nothing to save; start again with:\n  "
                  f"{shlex.join(['mtp', *self.argv])}", flush=True)
        return 128 + self.requested

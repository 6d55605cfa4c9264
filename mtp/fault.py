"""Nothing lost when `mtp fit` is stopped: checkpoints are never half-written, and SIGINT or
SIGTERM ends the run at the end of the current step with a checkpoint of that step and the
command that resumes from it.

- `AtomicCheckpointIO` writes each checkpoint to a temporary file beside its final name, fsyncs
  it and renames it into place: a full disk or a kill mid-write leaves the previous checkpoint
  and no truncated file under the final name (the temporary file is removed).
- `Interruptible` writes ``last.ckpt`` at the final step of a run that ends between validations,
  and turns the first SIGINT (Ctrl-C) or SIGTERM into a request that the step in
  flight honours when it ends (a signal raised mid-step could leave the weights half updated);
  it then saves ``interrupted-step=N.ckpt`` and stops the trainer. A second Ctrl-C interrupts at
  once, as Lightning does.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import tempfile
import threading
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

__all__ = ["AtomicCheckpointIO", "Interruptible", "resume_command"]


class AtomicCheckpointIO(TorchCheckpointIO):
    """`TorchCheckpointIO` whose local saves are atomic (temporary file, fsync, rename)."""

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        if "://" in str(path):  # remote storage: fsspec's own transaction
            return super().save_checkpoint(checkpoint, path, storage_options)
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO takes no storage_options")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        with contextlib.suppress(OSError):  # the rename itself survives a power cut
            dir_fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)


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


class Interruptible(L.Callback):
    """SIGINT / SIGTERM: a checkpoint at the end of the current step, then a clean stop."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = list(argv)
        self.requested: int | None = None
        self.checkpoint: Path | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.requested is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: now
        self.requested = signum

    def on_fit_start(self, trainer, pl_module) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        stop = trainer.strategy.reduce_boolean_decision(self.requested is not None, all=False)
        if not stop or self.checkpoint is not None:
            return
        if self.requested is None:  # the signal reached another rank: every rank stops alike
            self.requested = signal.SIGTERM
        callback = trainer.checkpoint_callback
        folder = Path(callback.dirpath) if callback is not None and callback.dirpath else \
            Path(trainer.default_root_dir) / "checkpoints"
        self.checkpoint = folder / f"interrupted-step={trainer.global_step}.ckpt"
        trainer.save_checkpoint(self.checkpoint)
        trainer.should_stop = True

    def on_train_end(self, trainer, pl_module) -> None:
        """A run that ends between validations keeps its last steps: ``last.ckpt`` is written
        at the final step too (Lightning writes it only after a validation)."""
        callback = trainer.checkpoint_callback
        if self.requested is None and callback is not None and callback.dirpath \
                and getattr(callback, "save_last", False):
            trainer.save_checkpoint(Path(callback.dirpath) / f"{callback.CHECKPOINT_NAME_LAST}"
                                    f"{callback.FILE_EXTENSION}")

    def teardown(self, trainer, pl_module, stage) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def report(self) -> int | None:
        """After the fit: print where the interrupted run was saved and how to resume; the
        exit status (128 + the signal), or None if the run was not interrupted."""
        if self.requested is None:
            return None
        name = signal.Signals(self.requested).name
        if self.checkpoint is None:
            print(f"\nstopped by {name} before a step ended: no checkpoint written")
        else:
            print(f"\nstopped by {name}: checkpoint of step "
                  f"{self.checkpoint.stem.split('=')[-1]} in {self.checkpoint}\n"
                  f"resume with:\n  {resume_command(self.argv, self.checkpoint)}")
        return 128 + self.requested

"""Plain progress lines for `mtp fit` without a terminal: what a batch job's log file can show.

A progress bar redraws one line in place; in a file that is nothing, or carriage-return noise.
Where standard output is not a terminal (or the bar is off), :class:`StepLines` prints a line
every `--trainer.log_every_n_steps` steps and at least once a minute, and one after every
validation::

    step 40/288  loss 1.962  heads 1.58 2.36 2.87  lr 1.00e-03  1,032 tok/s  3.9 s/step  left 16m07s
    validation at step 96  next_token_loss 1.211  sim_tokens_per_forward 2.012  loss_head2 1.580 ...
"""

from __future__ import annotations

import re
import sys
import time

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_only

__all__ = ["StepLines"]

_HEAD = re.compile(r"^(train|val)/(loss|acc)_head(\d+)$")


def _duration(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def _rates(groups: list[dict]) -> str:
    """The learning rate, or the heads' and the pretrained part's where they differ (`--optim.
    pretrained_lr_scale`, `--optim.pretrained_delay_steps`)."""
    rates = {("heads" if g.get("new", True) else "trunk"): g["lr"] for g in groups}
    if len(set(rates.values())) == 1:
        return f"lr {next(iter(rates.values())):.2e}"
    return "lr " + " ".join(f"{k} {v:.2e}" for k, v in sorted(rates.items()))


class StepLines(Callback):
    """A line per `every_n_steps` steps or `every_s` seconds, whichever comes first, and one per
    validation, on rank 0, where no progress bar is drawn on a terminal.

    Args:
        every_s: the longest time between two step lines.
        stream: where lines go (default standard output, flushed per line).
    """

    def __init__(self, every_s: float = 60.0, stream=None) -> None:
        self.every_s, self.stream = every_s, stream
        self.active = False

    def _print(self, line: str) -> None:
        print(line, file=self.stream or sys.stdout, flush=True)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        stream = self.stream or sys.stdout
        self.active = trainer.progress_bar_callback is None or not stream.isatty()
        self.start = self.last = time.monotonic()
        self.first_step, self.last_step = trainer.global_step, trainer.global_step
        self.tokens = 0

    @rank_zero_only
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        if not self.active:
            return
        n_future = pl_module.model_cfg.n_future
        self.tokens += batch.shape[0] * (batch.shape[1] - n_future) * trainer.world_size
        step, now = trainer.global_step, time.monotonic()
        due = step % max(1, trainer.log_every_n_steps) == 0 or now - self.last >= self.every_s
        if step == self.last_step or not (due or step == trainer.max_steps):
            return
        metrics = trainer.callback_metrics
        parts = [f"step {step}/{trainer.max_steps}" if trainer.max_steps > 0 else f"step {step}"]
        if "train/loss" in metrics:
            parts.append(f"loss {float(metrics['train/loss']):.3f}")
        heads = sorted((int(m[3]), float(v)) for k, v in metrics.items()
                       if (m := _HEAD.match(k)) and m[1] == "train" and m[2] == "loss")
        if heads:
            parts.append("heads " + " ".join(f"{v:.2f}" for _, v in heads))
        if trainer.optimizers:
            parts.append(_rates(trainer.optimizers[0].param_groups))
        dt = now - self.last
        parts.append(f"{self.tokens / max(dt, 1e-9):,.0f} tok/s")
        per_step = (now - self.start) / max(1, step - self.first_step)
        parts.append(f"{per_step:.2f} s/step")
        if trainer.max_steps > 0:
            parts.append(f"left {_duration(per_step * (trainer.max_steps - step))}")
        self._print("  ".join(parts))
        self.last, self.last_step, self.tokens = now, step, 0

    @rank_zero_only
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.active or trainer.sanity_checking:
            return
        metrics = trainer.callback_metrics
        names = ["val/next_token_loss", "val/sim_tokens_per_forward"] + sorted(
            (k for k in metrics if (m := _HEAD.match(k)) and m[1] == "val"),
            key=lambda k: (int(_HEAD.match(k)[3]), k))
        parts = [f"validation at step {trainer.global_step}"]
        parts += [f"{k.removeprefix('val/')} {float(metrics[k]):.3f}" for k in names
                  if k in metrics]
        self._print("  ".join(parts))

"""What the data tests share: a small DataModule over a corpus, prepared and set up, and a short
Lightning fit over one that records the windows each step drew."""

from pathlib import Path

import lightning as L
import torch

from mtp.config import DataConfig, LossConfig, ModelConfig, OptimConfig
from mtp.data import MTPDataModule
from mtp.train.module import MTPModule, TokenizerInCheckpoint

#: The model of `fit_windows`.
TINY = ModelConfig(vocab_size=300, d_model=16, n_layers=1, n_attn_heads=2, n_future=2,
                   max_seq_len=16)


def datamodule(corpus, tmp_path, **kw) -> MTPDataModule:
    """A DataModule of seq_len 16 and K = 3 over `corpus`, caching under `tmp_path / "cache"`."""
    cfg = DataConfig(source=str(corpus), cache_dir=str(tmp_path / "cache"), seq_len=16,
                     batch_size=4, val_fraction=0.1, **kw)
    dm = MTPDataModule(cfg, vocab_size=300, n_future=3)
    dm.prepare_data()
    dm.setup()
    return dm


class _Windows(L.Callback):
    def __init__(self) -> None:
        self.batches = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.batches.append(batch.clone())


def fit_windows(corpus: Path, cache: Path, batch_size: int, max_steps: int, *, ckpt_path=None,
                save_to=None, accumulate: int = 1
                ) -> tuple[list[torch.Tensor], MTPDataModule]:
    """`max_steps` steps of `TINY` over `corpus` (resumed from `ckpt_path`, saved to `save_to`):
    the batches drawn, and the DataModule."""
    data = DataConfig(source=str(corpus), cache_dir=str(cache), seq_len=8, batch_size=batch_size,
                      val_fraction=0.1, tokenizer_train_bytes=20_000)
    dm = MTPDataModule(data, vocab_size=TINY.vocab_size, n_future=TINY.n_future)
    rec = _Windows()
    trainer = L.Trainer(max_steps=max_steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[rec, TokenizerInCheckpoint(dm)], use_distributed_sampler=False,
                        limit_val_batches=0, accumulate_grad_batches=accumulate)
    trainer.fit(MTPModule(TINY, OptimConfig(), LossConfig()), datamodule=dm, ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return rec.batches, dm

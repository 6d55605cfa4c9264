"""What the data tests share: a small DataModule over a corpus, prepared and set up."""

from mtp.config import DataConfig
from mtp.data import MTPDataModule


def datamodule(corpus, tmp_path, **kw) -> MTPDataModule:
    """A DataModule of seq_len 16 and K = 3 over `corpus`, caching under `tmp_path / "cache"`."""
    cfg = DataConfig(source=str(corpus), cache_dir=str(tmp_path / "cache"), seq_len=16,
                     batch_size=4, val_fraction=0.1, **kw)
    dm = MTPDataModule(cfg, vocab_size=300, n_future=3)
    dm.prepare_data()
    dm.setup()
    return dm

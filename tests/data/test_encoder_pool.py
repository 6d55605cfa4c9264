"""The tokenising workers (`mtp.data.encoder_pool`) and a SIGTERM: one that arrives while the
workers are being forked is held back until they have started, then data preparation stops
where the pool closes, the shard left without its ``meta.json`` and unlocked."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import yaml
from fit_helpers import DEBUG, unlocked


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
    assert not (shard / "meta.json").exists() and unlocked(shard / "lock")

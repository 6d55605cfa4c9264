"""The processes that tokenise a source: batches of documents out, token ids back in order.

The main process reads documents and sends batches of them to the workers (at most two batches
per worker in flight), then takes the results in document order, so what is written does not
depend on the number of workers.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
from tokenizers import Tokenizer

from mtp.data.corpus import DocumentReader, in_validation

# A batch is what one worker encodes at a time: large enough that pickling and the pipe cost
# little next to the encoding, small enough that the batches in flight hold a few MiB.
BATCH_DOCS = 256
BATCH_CHARS = 1 << 20


@dataclass
class _Batch:
    """Consecutive documents of a source, with the reader's state after each of them."""

    texts: list[str] = field(default_factory=list)
    val: list[bool] = field(default_factory=list)
    states: list[dict] = field(default_factory=list)
    chars: int = 0


def document_batches(reader: DocumentReader) -> Iterator[_Batch]:
    batch = _Batch()
    for name, text in reader:
        batch.texts.append(text)
        batch.val.append(in_validation(name, reader.spec.val_fraction))
        batch.states.append(reader.state())
        batch.chars += len(text)
        if len(batch.texts) >= BATCH_DOCS or batch.chars >= BATCH_CHARS:
            yield batch
            batch = _Batch()
    if batch.texts:
        yield batch


_WORKER: tuple[Tokenizer, int, np.dtype] | None = None  # this worker process's tokenizer


def _die_with_parent(parent: int) -> None:
    # A worker blocks on its task pipe forever if the main process is killed (kill -9 leaves no
    # time to stop the pool), so on Linux it asks to be killed along with its parent.
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def _init_worker(tokenizer_json: str, eot: int, dtype: str, parent: int) -> None:
    global _WORKER
    # One core per worker: the speed-up comes from the processes, and Rust's thread pool, if the
    # parent used it before fork(), does not exist in the child.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    if hasattr(signal, "pthread_sigmask"):  # forked inside `_signals_held`: a SIGTERM stops it
        signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT, signal.SIGTERM))
    _die_with_parent(parent)
    tok = Tokenizer.from_str(tokenizer_json)
    _WORKER = (tok, eot, np.dtype(dtype))


def _encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of a batch, each document followed by end-of-text, and each one's length."""
    tok, eot, dtype = _WORKER
    # encode_batch_fast skips the offsets, which are not needed; the ids are the same
    encoded = [e.ids for e in tok.encode_batch_fast(texts)]  # each `.ids` builds a new list
    lengths = np.fromiter((len(e) + 1 for e in encoded), np.int64, len(encoded))
    ids = np.empty(int(lengths.sum()), dtype)
    for e, stop in zip(encoded, np.cumsum(lengths)):
        ids[stop - len(e) - 1:stop - 1] = e
        ids[stop - 1] = eot
    return ids, lengths


@contextmanager
def _serial_tokenizers_env() -> Iterator[None]:
    # tokenizers warns in every forked child when the parent used its thread pool and the
    # variable is unset; the workers turn parallelism off themselves, so silence the warning.
    unset = "TOKENIZERS_PARALLELISM" not in os.environ
    if unset:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if unset:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)


@contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM wait until the block ends, blocked in this thread (a handler that
    finds them blocked, `mtp.train.fault`'s, leaves them pending here). The first submit starts the
    workers: a handler raising there would raise in a callback of `os.fork`, where Python prints
    and ignores the exception, or between the executor's steps of starting, leaving workers that
    nothing stops, so that the process never exits."""
    if not hasattr(signal, "pthread_sigmask"):  # Windows: no signal masks
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


class EncoderPool:
    """`workers` processes encoding batches; `map` returns results in input order, reading the
    input only as far as 2 x workers batches ahead of what the caller has taken."""

    def __init__(self, tokenizer: Tokenizer, eot: int, dtype: type, workers: int) -> None:
        # fork: a worker starts in milliseconds and imports nothing (spawn would re-import torch
        # and Lightning, seconds and ~400 MB per worker); spawn where fork does not exist.
        # NOTE: an executor, not multiprocessing.Pool: when a worker dies (the OOM killer), Pool
        # waits forever for its result, the executor raises BrokenProcessPool.
        method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        self.executor = ProcessPoolExecutor(
            workers, mp.get_context(method), initializer=_init_worker,
            initargs=(tokenizer.to_str(), eot, np.dtype(dtype).name, os.getpid()))
        self.depth = 2 * workers

    def map(self, batches: Iterable[_Batch]) -> Iterator[tuple[_Batch, np.ndarray, np.ndarray]]:
        pending: deque = deque()
        with _serial_tokenizers_env():  # the executor forks its workers on the first submits
            for batch in batches:
                with _signals_held():
                    future = self.executor.submit(_encode, batch.texts)
                pending.append((batch, future))
                if len(pending) >= self.depth:
                    done, future = pending.popleft()
                    yield done, *future.result()
        while pending:
            done, future = pending.popleft()
            yield done, *future.result()

    def close(self) -> None:
        # batches still queued (after a stop at max_tokens) are dropped; running ones finish
        self.executor.shutdown(wait=True, cancel_futures=True)

"""Token windows with K targets, their samplers, and the LightningDataModule that builds them
from a data config (sources -> tokenizer -> shards -> windows; see :mod:`mtp.data`)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import numpy as np
import torch
from tokenizers import Tokenizer
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Sampler

from mtp.config import DataConfig
from mtp.data.bpe import check_tokenizer, load_tokenizer, tokenizer_sample, train_tokenizer
from mtp.data.corpus import SourceSpec, source_specs, spec_key
from mtp.data.shards import SPLITS, build_shards, load_shards, locked, shard_root
from mtp.model.checkpoint import EOT_TOKEN
from mtp.util.atomic import atomic_write, writing
from mtp.util.errors import InputError

# -- windows and samplers -----------------------------------------------------------------------


class TokenWindows(Dataset):
    """Windows of `seq_len + n_future` tokens at stride `seq_len` over a token file.

    Window j holds tokens [j * seq_len, j * seq_len + seq_len + K); position t of the input
    predicts, at `heads[i]`, the token t + i + 1, so the last K tokens are targets only.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, n_future: int) -> None:
        self.tokens, self.seq_len, self.width = tokens, seq_len, seq_len + n_future
        self.n = max(0, (len(tokens) - self.width) // seq_len + 1)
        if self.n == 0:
            raise InputError(f"a split of {len(tokens)} tokens is shorter than one window of "
                             f"--data.seq_len + K = {self.width} tokens")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, j: int) -> torch.Tensor:
        start = j * self.seq_len
        return torch.from_numpy(self.tokens[start:start + self.width].astype(np.int64))


class ResumableSampler(Sampler[int]):
    """An endless, seeded stream of shuffled epochs that can start at any sample.

    Sample g of the global stream is window perm_e[g mod n] with e = g // n and perm_e seeded by
    (seed, e); rank r of w takes samples g = r, r + w, ... So the order depends on the seed alone,
    and resuming at `start` (samples consumed by all ranks) continues exactly where a run stopped.
    """

    def __init__(self, n: int, seed: int, start: int = 0, rank: int = 0,
                 world_size: int = 1) -> None:
        self.n, self.seed, self.start, self.rank, self.world = n, seed, start, rank, world_size

    def __iter__(self) -> Iterator[int]:
        g = self.start + self.rank
        epoch, perm = -1, None
        while True:
            if g // self.n != epoch:
                epoch = g // self.n
                perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(
                    self.seed * 100_003 + epoch))
            yield int(perm[g % self.n])
            g += self.world


class MixtureSampler(Sampler[int]):
    """An endless, seeded stream of windows from several sources, drawn by weight, resumable.

    Sample g of the global stream comes from source j with probability w_j / sum(w),
    independently of every other sample. The stream is cut into chunks of `CHUNK` samples; chunk c
    first draws how many of its samples each source gets (a multinomial seeded by (seed, c)), then
    their order (a seeded permutation): the same distribution as independent draws, but a resumed
    run finds how many samples each source gave before `start` from the chunk counts alone. The
    k-th sample of source j is window perm_{j,e}[k mod n_j] with e = k // n_j, shuffled epochs of
    that source as in `ResumableSampler`. Indices are into the concatenation of the sources'
    windows; rank r of w takes samples g = r, r + w, ...
    """

    CHUNK = 4096

    def __init__(self, sizes: list[int], weights: list[float], seed: int, start: int = 0,
                 rank: int = 0, world_size: int = 1) -> None:
        self.sizes, self.seed = list(sizes), seed & (2**63 - 1)  # numpy seeds are non-negative
        self.p = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        self.start, self.rank, self.world = start, rank, world_size

    def _counts(self, c: int) -> np.ndarray:
        return np.random.default_rng([self.seed, 0, c]).multinomial(self.CHUNK, self.p)

    def _labels(self, c: int, counts: np.ndarray) -> np.ndarray:
        labels = np.repeat(np.arange(len(self.sizes)), counts)
        return np.random.default_rng([self.seed, 1, c]).permutation(labels)

    def __iter__(self) -> Iterator[int]:
        g = self.start + self.rank
        c = g // self.CHUNK
        seen = np.zeros(len(self.sizes), np.int64)  # samples of each source before chunk c
        for earlier in range(c):
            seen += self._counts(earlier)
        perms: dict[int, tuple[int, np.ndarray]] = {}
        while True:
            counts = self._counts(c)
            labels = self._labels(c, counts)
            # k of each position: that source's samples before the chunk, plus before it in it
            order = np.argsort(labels, kind="stable")
            ranks = np.empty(self.CHUNK, np.int64)
            ranks[order] = np.arange(self.CHUNK) - np.repeat(np.cumsum(counts) - counts, counts)
            ks = seen[labels] + ranks
            while g < (c + 1) * self.CHUNK:
                i = g - c * self.CHUNK
                j, k = int(labels[i]), int(ks[i])
                epoch, n = k // self.sizes[j], self.sizes[j]
                if perms.get(j, (-1,))[0] != epoch:
                    perms[j] = (epoch, np.random.default_rng([self.seed, 2, j, epoch])
                                .permutation(n))
                yield int(self.offsets[j] + perms[j][1][k % n])
                g += self.world
            seen += counts
            c += 1


# -- the DataModule -----------------------------------------------------------------------------


def _windows(tokens: np.ndarray, spec: SourceSpec, split: str, seq_len: int,
             n_future: int) -> TokenWindows:
    try:
        return TokenWindows(tokens, seq_len, n_future)
    except ValueError as err:
        raise InputError(f"{spec.label}, {split} split: {err}") from err


def _available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))  # what this process may use, not the machine
    except AttributeError:
        return os.cpu_count() or 1


class MTPDataModule(L.LightningDataModule):
    """Token windows for training and validation, with a resumable position in the stream.

    With one source, `train_tokens` and `val_tokens` are its memory-mapped shards. With a
    mixture, `train_shards` / `val_shards` hold every source's; `train_tokens` is the first
    source's training shard (the whole training set would not fit in memory) and `val_tokens`
    the concatenation of every source's validation tokens, the set the validation loss covers.
    """

    def __init__(self, cfg: DataConfig, *, vocab_size: int, n_future: int,
                 eot_token: str = EOT_TOKEN) -> None:
        super().__init__()
        self.cfg, self.vocab_size, self.n_future = cfg, vocab_size, n_future
        self.eot_token = eot_token
        self.tokenizer: Tokenizer | None = None
        self.samples_consumed = 0
        self.stats: dict = {}

    # -- preparation (rank 0 only; results are found again by key in `setup`) -----------------
    def prepare_data(self) -> None:
        self._prepare()

    def _tokenizer(self, specs: list[SourceSpec], keys: list[dict]) -> Tokenizer:
        cfg = self.cfg
        if cfg.tokenizer is not None:
            tok = load_tokenizer(cfg.tokenizer)
            check_tokenizer(tok, self.vocab_size, cfg.tokenizer, self.eot_token)
            return tok
        mixture: list = [{"key": k, "weight": s.weight} for s, k in zip(specs, keys)]
        if self.eot_token != EOT_TOKEN:  # as in `shard_root`
            mixture.append({"eot_token": self.eot_token})
        h = hashlib.sha256(json.dumps(mixture, sort_keys=True).encode()).hexdigest()[:16]
        path = Path(cfg.cache_dir) / "tokenizers" / (
            f"{h}-v{self.vocab_size}-b{cfg.tokenizer_train_bytes}.json")
        if path.is_file():
            return Tokenizer.from_file(str(path))
        with writing(path.parent, "the folder of trained tokenizers (--data.cache_dir)"):
            path.parent.mkdir(parents=True, exist_ok=True)
        with locked(path.with_name(path.name + ".lock")):  # two runs at once train it once
            if path.is_file():
                return Tokenizer.from_file(str(path))
            tok = train_tokenizer(tokenizer_sample(specs, cfg.tokenizer_train_bytes),
                                  self.vocab_size, cfg.tokenizer_train_bytes, self.eot_token)
            atomic_write(path, lambda p: tok.save(str(p)), what="the tokenizer")
        return tok

    def _prepare(self) -> tuple[Tokenizer, list[SourceSpec], list[Path]]:
        cfg = self.cfg
        specs = source_specs(cfg)
        keys = [spec_key(s) for s in specs]
        tok = self._tokenizer(specs, keys)
        workers = cfg.tokenize_workers or _available_cpus()
        roots = []
        for spec, key in zip(specs, keys):
            roots.append(shard_root(cfg.cache_dir, key, tok, self.eot_token))
            build_shards(spec, tok, roots[-1], workers=workers, key=key,
                         eot_token=self.eot_token)
        return tok, specs, roots

    def setup(self, stage: str | None = None) -> None:
        if self.tokenizer is not None:
            return
        # Every rank re-derives the paths; only rank 0 wrote them in `prepare_data`.
        tok, specs, roots = self._prepare()
        self.tokenizer, self.specs = tok, specs
        metas, self.train_shards, self.val_shards = zip(*(load_shards(r) for r in roots))
        seq, K = self.cfg.seq_len, self.n_future
        train = [_windows(t, s, "training", seq, K) for t, s in zip(self.train_shards, specs)]
        val = [_windows(v, s, "validation", seq, K) for v, s in zip(self.val_shards, specs)]
        self.train_parts = train
        if len(specs) == 1:
            self.stats = metas[0]
            self.train_tokens, self.val_tokens = self.train_shards[0], self.val_shards[0]
            self.train_set, self.val_set = train[0], val[0]
            return
        self.stats = {"mixture": [{"weight": s.weight, **m} for s, m in zip(specs, metas)],
                      **{f"{split}_tokens": sum(m[f"{split}_tokens"] for m in metas)
                         for split in SPLITS}}
        self.train_tokens = self.train_shards[0]
        self.val_tokens = np.concatenate(self.val_shards)
        self.train_set, self.val_set = ConcatDataset(train), ConcatDataset(val)

    def most_frequent(self, n: int) -> np.ndarray:
        """The ids of the n most frequent tokens of the training split, most frequent first
        (ties by id): the draft vocabulary of `--model.draft_vocab`."""
        counts = sum(np.bincount(np.asarray(t), minlength=self.vocab_size)
                     for t in self.train_shards)
        return np.argsort(-counts, kind="stable")[:n]

    def train_dataloader(self) -> DataLoader:
        rank, world = (self.trainer.global_rank, self.trainer.world_size) if self.trainer \
            else (0, 1)
        if len(self.specs) == 1:
            sampler = ResumableSampler(len(self.train_set), self.cfg.seed, self.samples_consumed,
                                       rank, world)
        else:
            sampler = MixtureSampler([len(part) for part in self.train_parts],
                                     [s.weight for s in self.specs], self.cfg.seed,
                                     self.samples_consumed, rank, world)
        return DataLoader(self.train_set, batch_size=self.cfg.batch_size, sampler=sampler,
                          num_workers=self.cfg.num_workers, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        # NOTE: every rank sees the whole validation set (Lightning's sampler is off); the logged
        # metric is synced, so the value is the same as on one process.
        return DataLoader(self.val_set, batch_size=self.cfg.batch_size,
                          num_workers=self.cfg.num_workers)

    # -- resumable position --------------------------------------------------------------------
    def on_before_batch_transfer(self, batch, dataloader_idx: int):
        """Counts each training batch as the loop takes it: `samples_consumed` is the windows
        drawn by every rank so far, whatever batch size, device count or accumulation each
        stretch of the run had (not global_step x batch size x ranks, which a resume with
        another batch size would get wrong). The loader's prefetching draws ahead; this counts
        only what training took."""
        t = self.trainer
        if t is not None and t.training:
            self.samples_consumed += len(batch) * t.world_size
        return batch

    def state_dict(self) -> dict:
        return {"samples_consumed": self.samples_consumed}

    def load_state_dict(self, state: dict) -> None:
        self.samples_consumed = int(state["samples_consumed"])


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy in nats of the token frequencies: the loss of the best context-free model."""
    counts = np.bincount(tokens, minlength=vocab_size).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def build_datamodule(cfg: DataConfig, *, vocab_size: int, n_future: int,
                     eot_token: str = EOT_TOKEN) -> MTPDataModule:
    """The DataModule of a data config (the factory the CLI and experiments call)."""
    return MTPDataModule(cfg, vocab_size=vocab_size, n_future=n_future, eot_token=eot_token)

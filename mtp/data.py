"""Corpora, tokenizer, memory-mapped token shards and the LightningDataModule.

corpus (stdlib / Hugging Face / local files) -> documents split by a hash of their name ->
byte-level BPE (trained on the training split, or loaded) -> one token stream per split with an
end-of-text token after each document, kept as memory-mapped files keyed by a hash of corpus and
tokenizer -> windows of seq_len + K tokens, so head i finds its targets i positions ahead.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch.utils.data import DataLoader, Dataset, Sampler
from tqdm.auto import tqdm

from mtp.checkpoint import EOT_TOKEN
from mtp.config import DataConfig

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".py", ".txt")
TABLE_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
SHARD_FORMAT = 1  # bump when the layout of the token files changes


@dataclass
class Corpus:
    """Documents of one source, split into train and validation, with a content fingerprint."""

    train: list[str]
    val: list[str]
    fingerprint: str
    skipped: int = 0
    """Files that could not be read or were not UTF-8."""


def _is_val(name: str, val_fraction: float) -> bool:
    # A hash of the document's name, not its position, decides the split: adding a file to the
    # corpus never moves another file between train and validation.
    h = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big")
    return h / 2**64 < val_fraction


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [p for p in sorted(root.rglob("*.py")) if "site-packages" not in p.parts]


def _local_files(source: str) -> list[Path]:
    path = Path(source).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
    elif any(c in source for c in "*?["):
        files = sorted(Path(p) for p in glob.glob(os.path.expanduser(source), recursive=True))
    else:
        files = [path] if path.is_file() else []
    return [p for p in files if p.suffix in TEXT_SUFFIXES or p.suffix in TABLE_SUFFIXES]


def _looks_local(source: str) -> bool:
    return source.startswith((".", "/", "~")) or any(c in source for c in "*?[") or \
        Path(source).expanduser().exists() or Path(source).suffix in (*TEXT_SUFFIXES,
                                                                       *TABLE_SUFFIXES)


def _read_text_files(files: list[Path], root: Path) -> tuple[list[tuple[str, str]], int]:
    docs, skipped = [], 0
    for path in tqdm(files, desc="reading files", unit="file", leave=False):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            log.debug("skipping %s: %s", path, err)
            skipped += 1
            continue
        docs.append((str(path.relative_to(root)), text))
    return docs, skipped


def _read_table_files(files: list[Path], root: Path, text_field: str) -> list[tuple[str, str]]:
    import datasets

    docs = []
    for path in files:
        ds = datasets.load_dataset(TABLE_SUFFIXES[path.suffix], data_files=str(path),
                                   split="train")
        if text_field not in ds.column_names:
            raise ValueError(f"{path} has no field {text_field!r} (--data.text_field); "
                             f"fields: {ds.column_names}")
        docs += [(f"{path.relative_to(root)}:{i}", t) for i, t in enumerate(ds[text_field]) if t]
    return docs


def _read_hub(cfg: DataConfig) -> tuple[list[tuple[str, str]], str]:
    import datasets

    ds = datasets.load_dataset(cfg.source, cfg.hf_config, split=cfg.hf_split,
                               streaming=cfg.streaming)
    if cfg.max_documents is not None:
        ds = ds.take(cfg.max_documents) if cfg.streaming else ds.select(
            range(min(cfg.max_documents, len(ds))))
    columns = ds.column_names
    if columns is not None and cfg.text_field not in columns:
        raise ValueError(f"dataset {cfg.source} has no field {cfg.text_field!r} "
                         f"(--data.text_field); fields: {columns}")
    docs = [(str(i), row[cfg.text_field]) for i, row in enumerate(
        tqdm(ds, desc=f"reading {cfg.source}", unit="doc")) if row[cfg.text_field]]
    return docs, getattr(ds, "_fingerprint", None) or ""


def load_corpus(cfg: DataConfig) -> Corpus:
    """Read the documents of `cfg.source` and split them by a hash of their names."""
    skipped, extra = 0, ""
    if cfg.source == "stdlib":
        files = _stdlib_files()
        docs, skipped = _read_text_files(files, Path(sysconfig.get_paths()["stdlib"]))
    elif _looks_local(cfg.source):
        files = _local_files(cfg.source)
        if not files:
            raise FileNotFoundError(
                f"--data.source {cfg.source!r} matches no .py, .txt, .jsonl or .parquet files")
        # names relative to the files' common folder: the split does not depend on where the
        # corpus lives or on how it was named (directory or glob)
        root = Path(os.path.commonpath([f.parent for f in files]))
        docs, skipped = _read_text_files([f for f in files if f.suffix in TEXT_SUFFIXES], root)
        docs += _read_table_files([f for f in files if f.suffix in TABLE_SUFFIXES], root,
                                  cfg.text_field)
    else:
        docs, extra = _read_hub(cfg)
    if cfg.max_documents is not None:
        docs = docs[:cfg.max_documents]
    docs = [(n, t) for n, t in docs if t.strip()]
    if not docs:
        raise ValueError(f"--data.source {cfg.source!r} holds no non-empty documents "
                         f"({skipped} files skipped as unreadable or not UTF-8)")
    if skipped:
        log.warning("skipped %d unreadable or non-UTF-8 files of %s", skipped, cfg.source)
    h = hashlib.sha256(f"{cfg.val_fraction}\0{extra}\0".encode())
    train, val = [], []
    for name, text in docs:
        h.update(name.encode() + b"\0" + text.encode() + b"\0")
        (val if _is_val(name, cfg.val_fraction) else train).append(text)
    if not val:  # a tiny corpus: hold out one document rather than validate on nothing
        val.append(train.pop())
    if not train:
        raise ValueError(f"--data.source {cfg.source!r} has too few documents to split "
                         "into train and validation")
    return Corpus(train=train, val=val, fingerprint=h.hexdigest()[:16], skipped=skipped)


def train_tokenizer(texts: list[str], vocab_size: int, max_bytes: int) -> Tokenizer:
    """A byte-level BPE with an end-of-text token (id 0), trained on at most `max_bytes`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOT_TOKEN], show_progress=True,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )

    def sample() -> Iterator[str]:
        seen = 0
        for text in texts:
            if seen >= max_bytes:
                return
            seen += len(text)
            yield text

    tok.train_from_iterator(sample(), trainer=trainer)
    return tok


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """A `tokenizer.json`, with a message naming the file when it is missing or malformed."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--data.tokenizer {path} does not exist")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception on bad JSON
        raise ValueError(f"--data.tokenizer {path} is not a valid tokenizer.json: {err}") from err


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    write(tmp)
    os.replace(tmp, path)


def tokenize_to_file(texts: list[str], tokenizer: Tokenizer, path: Path, desc: str) -> int:
    """Encode documents (Rust threads, in batches) into one token file; returns its length."""
    eot = tokenizer.token_to_id(EOT_TOKEN)
    dtype = np.uint16 if tokenizer.get_vocab_size() <= 2**16 else np.uint32
    total = 0

    def write(tmp: Path) -> None:
        nonlocal total
        with open(tmp, "wb") as f:
            batch = 256
            for start in tqdm(range(0, len(texts), batch), desc=desc, unit="batch"):
                for enc in tokenizer.encode_batch(texts[start:start + batch]):
                    ids = np.asarray(enc.ids + [eot], dtype=dtype)
                    f.write(ids.tobytes())
                    total += len(ids)

    _atomic_write(path, write)
    return total


def _dtype_for(vocab_size: int) -> type:
    return np.uint16 if vocab_size <= 2**16 else np.uint32


class TokenWindows(Dataset):
    """Windows of `seq_len + n_future` tokens at stride `seq_len` over a token file.

    Window j holds tokens [j * seq_len, j * seq_len + seq_len + K); position t of the input
    predicts, at head i, the token t + i (1-based i), so the last K tokens are targets only.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, n_future: int) -> None:
        self.tokens, self.seq_len, self.width = tokens, seq_len, seq_len + n_future
        self.n = max(0, (len(tokens) - self.width) // seq_len + 1)
        if self.n == 0:
            raise ValueError(f"a split of {len(tokens)} tokens is shorter than one window of "
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


class MTPDataModule(L.LightningDataModule):
    """Token windows for training and validation, with a resumable position in the stream."""

    def __init__(self, cfg: DataConfig, *, vocab_size: int, n_future: int) -> None:
        super().__init__()
        self.cfg, self.vocab_size, self.n_future = cfg, vocab_size, n_future
        self.tokenizer: Tokenizer | None = None
        self.samples_consumed = 0
        self.stats: dict = {}

    # -- preparation (rank 0 only; results are found again by hash in `setup`) ---------------
    def _paths(self, corpus_key: str, tok: Tokenizer) -> dict[str, Path]:
        key = hashlib.sha256(f"{SHARD_FORMAT}\0{corpus_key}\0{tok.to_str()}".encode())
        root = Path(self.cfg.cache_dir) / "tokens" / key.hexdigest()[:16]
        return {"root": root, "train": root / "train.bin", "val": root / "val.bin",
                "meta": root / "meta.json"}

    def prepare_data(self) -> None:
        self._prepare()

    def _prepare(self) -> tuple[Tokenizer, dict[str, Path]]:
        cfg = self.cfg
        corpus = None
        if cfg.tokenizer is not None:
            tok = load_tokenizer(cfg.tokenizer)
            _check_tokenizer(tok, self.vocab_size, cfg.tokenizer)
        else:
            corpus = load_corpus(cfg)
            tok_path = Path(cfg.cache_dir) / "tokenizers" / (
                f"{corpus.fingerprint}-v{self.vocab_size}-b{cfg.tokenizer_train_bytes}.json")
            if tok_path.is_file():
                tok = Tokenizer.from_file(str(tok_path))
            else:
                tok = train_tokenizer(corpus.train, self.vocab_size, cfg.tokenizer_train_bytes)
                tok_path.parent.mkdir(parents=True, exist_ok=True)
                _atomic_write(tok_path, lambda p: tok.save(str(p)))
        if corpus is None:
            corpus = load_corpus(cfg)
        paths = self._paths(corpus.fingerprint, tok)
        if not paths["meta"].is_file():
            paths["root"].mkdir(parents=True, exist_ok=True)
            meta = {"source": cfg.source, "fingerprint": corpus.fingerprint,
                    "skipped_files": corpus.skipped, "documents": {
                        "train": len(corpus.train), "val": len(corpus.val)}}
            for split in ("train", "val"):
                meta[f"{split}_tokens"] = tokenize_to_file(
                    getattr(corpus, split), tok, paths[split], f"tokenising {split}")
            _atomic_write(paths["meta"], lambda p: p.write_text(json.dumps(meta, indent=1)))
        return tok, paths

    def setup(self, stage: str | None = None) -> None:
        if self.tokenizer is not None:
            return
        # Every rank re-derives the paths; only rank 0 wrote them in `prepare_data`.
        tok, paths = self._prepare()
        self.tokenizer = tok
        self.stats = json.loads(paths["meta"].read_text())
        dtype = _dtype_for(tok.get_vocab_size())
        self.train_tokens = np.memmap(paths["train"], dtype=dtype, mode="r")
        self.val_tokens = np.memmap(paths["val"], dtype=dtype, mode="r")
        self.train_set = TokenWindows(self.train_tokens, self.cfg.seq_len, self.n_future)
        self.val_set = TokenWindows(self.val_tokens, self.cfg.seq_len, self.n_future)

    def train_dataloader(self) -> DataLoader:
        rank, world = (self.trainer.global_rank, self.trainer.world_size) if self.trainer \
            else (0, 1)
        sampler = ResumableSampler(len(self.train_set), self.cfg.seed, self.samples_consumed,
                                   rank, world)
        return DataLoader(self.train_set, batch_size=self.cfg.batch_size, sampler=sampler,
                          num_workers=self.cfg.num_workers, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        # NOTE: every rank sees the whole validation set (Lightning's sampler is off); the logged
        # metric is synced, so the value is the same as on one process.
        return DataLoader(self.val_set, batch_size=self.cfg.batch_size,
                          num_workers=self.cfg.num_workers)

    # -- resumable position --------------------------------------------------------------------
    def state_dict(self) -> dict:
        t = self.trainer
        consumed = self.samples_consumed
        if t is not None:
            consumed = (t.global_step * t.accumulate_grad_batches * self.cfg.batch_size
                        * t.world_size)
        return {"samples_consumed": consumed}

    def load_state_dict(self, state: dict) -> None:
        self.samples_consumed = int(state["samples_consumed"])


def _check_tokenizer(tok: Tokenizer, vocab_size: int, source: str) -> None:
    if tok.token_to_id(EOT_TOKEN) is None:
        raise ValueError(f"--data.tokenizer {source} has no {EOT_TOKEN} token")
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"--data.tokenizer {source} has a vocabulary of {tok.get_vocab_size()} "
                         f"tokens but --model.vocab_size is {vocab_size}")


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy in nats of the token frequencies: the loss of the best context-free model."""
    counts = np.bincount(tokens, minlength=vocab_size).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def build_datamodule(cfg: DataConfig, *, vocab_size: int, n_future: int) -> MTPDataModule:
    """The DataModule of a data config (the factory the CLI and experiments call)."""
    return MTPDataModule(cfg, vocab_size=vocab_size, n_future=n_future)

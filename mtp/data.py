"""Corpora, tokenizer, streamed memory-mapped token shards and the LightningDataModule.

source(s) (stdlib / Hugging Face / local files, or a weighted mixture of them) -> documents
streamed one at a time, split by a hash of their name -> byte-level BPE (trained on a bounded
sample of the training split, or loaded) -> per source, one token file per split with an
end-of-text token after each document -> windows of seq_len + K tokens, so head i finds its
targets i positions ahead; a mixture draws each window's source by weight.

Tokenisation never holds the corpus: the main process reads documents and sends batches of them
to `--data.tokenize_workers` processes (at most two batches per worker in flight), then appends
the results in document order, so the shards are byte-identical for any worker count. A shard is
built as `{train,val}.bin.partial` plus `progress.json`, a checkpoint (bytes of each file,
records consumed, counters) written after an fsync every `CHECKPOINT_DOCS` documents or
`CHECKPOINT_CHARS` characters. A run that was killed resumes there: it truncates the files to the
recorded sizes and skips the consumed records. Only `meta.json`, written atomically after the
files are renamed to `{train,val}.bin`, marks a shard complete; it records the token counts and
a sha256 of each file, and loading checks each file's size against it.

A shard's directory is keyed by a hash of the source specification (what `spec_key` returns:
source, Hugging Face config, split and field, max_documents, max_tokens, val_fraction and, for
local sources, every file's path, size and mtime) and of the tokenizer. A Hugging Face dataset
is keyed by name only: a new revision published under the same name is not noticed (delete the
shard directory, or change any part of the specification).
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import multiprocessing as mp
import os
import signal
import sys
import sysconfig
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field, replace
from pathlib import Path

import lightning as L
import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Sampler
from tqdm.auto import tqdm

from mtp.checkpoint import EOT_TOKEN
from mtp.config import DataConfig, InputError, MissingInput

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".py", ".txt")
TABLE_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
SHARD_FORMAT = 2  # bump when the layout of the token files or the meaning of the key changes
SPLITS = ("train", "val")

# A batch is what one worker encodes at a time: large enough that pickling and the pipe cost
# little next to the encoding, small enough that the batches in flight hold a few MiB.
BATCH_DOCS = 256
BATCH_CHARS = 1 << 20
# A checkpoint costs two fsyncs; a killed run redoes at most this much work.
CHECKPOINT_DOCS = 20_000
CHECKPOINT_CHARS = 64 << 20


# -- sources and their documents ----------------------------------------------------------------


@dataclass(frozen=True)
class SourceSpec:
    """One source of documents: a DataConfig's `source`, or one entry of its `sources`."""

    source: str
    """As given: `stdlib`, a Hugging Face dataset name, or a path, directory or glob."""
    index: int | None = None
    """Position in `--data.sources` (None: the single `--data.source`), for error messages."""
    weight: float = 1.0
    """Mixture weight."""
    hf_config: str | None = None
    """Hugging Face dataset configuration name."""
    hf_split: str = "train"
    """Hugging Face split."""
    text_field: str = "text"
    """Field holding the text in Hugging Face, .jsonl and .parquet sources."""
    streaming: bool = False
    """Stream a Hugging Face dataset instead of downloading it whole."""
    max_documents: int | None = None
    """Read at most this many documents."""
    max_tokens: int | None = None
    """Stop once the training split holds this many tokens."""
    val_fraction: float = 0.02
    """Share of documents held out for validation."""
    files: tuple[Path, ...] = ()
    """Local sources: every file, in reading order (text files first, then tables)."""
    root: Path | None = None
    """Local sources: the folder that document names are relative to (None: Hugging Face)."""

    def flag(self, key: str = "source") -> str:
        """The command-line flag that sets `key` of this source."""
        return f"--data.{key}" if self.index is None else f"--data.sources[{self.index}].{key}"

    @property
    def label(self) -> str:
        """The source as a user wrote it, with the flag that holds it."""
        return f"{self.flag()} {self.source!r}"


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
    files = [p.absolute() for p in files if p.suffix in TEXT_SUFFIXES or p.suffix in TABLE_SUFFIXES]
    # text files first, then tables, each in path order: the reading order is part of the key
    return [p for p in files if p.suffix in TEXT_SUFFIXES] + \
        [p for p in files if p.suffix in TABLE_SUFFIXES]


def _looks_local(source: str) -> bool:
    return source.startswith((".", "/", "~")) or any(c in source for c in "*?[") or \
        Path(source).expanduser().exists() or Path(source).suffix in (*TEXT_SUFFIXES,
                                                                       *TABLE_SUFFIXES)


def source_specs(cfg: DataConfig) -> list[SourceSpec]:
    """The sources of a data config, local files listed (an error names a source without any).

    Each entry of `--data.sources` takes the top-level field of the same name for every key it
    does not set; `--data.source` alone is a one-entry mixture.
    """
    shared = {"hf_config": cfg.hf_config, "hf_split": cfg.hf_split, "text_field": cfg.text_field,
              "streaming": cfg.streaming, "max_documents": cfg.max_documents,
              "max_tokens": cfg.max_tokens}
    entries = [(None, {"source": cfg.source})] if cfg.sources is None else \
        list(enumerate(cfg.sources))
    specs = []
    for index, entry in entries:
        spec = SourceSpec(index=index, val_fraction=cfg.val_fraction, **{**shared, **entry})
        if spec.source == "stdlib":
            spec = _with_files(spec, _stdlib_files(), Path(sysconfig.get_paths()["stdlib"]))
        elif _looks_local(spec.source):
            files = _local_files(spec.source)
            if not files:
                raise MissingInput(
                    f"{spec.label} matches no .py, .txt, .jsonl or .parquet files")
            # names relative to the files' common folder: the split does not depend on where
            # the corpus lives or on how it was named (directory or glob)
            spec = _with_files(spec, files, Path(os.path.commonpath([f.parent for f in files])))
        specs.append(spec)
    return specs


def _with_files(spec: SourceSpec, files: list[Path], root: Path) -> SourceSpec:
    return replace(spec, files=tuple(files), root=root)


def spec_key(spec: SourceSpec) -> dict:
    """What identifies a source's documents, as keyed in the shard cache and kept in meta.json.

    Local sources add the number of files and a sha256 of every file's path, size and mtime, so
    an edited, added or removed file gives a new key without reading any file; `streaming` and
    `weight` are left out (neither changes the documents).
    """
    key = {k: getattr(spec, k) for k in ("source", "hf_config", "hf_split", "text_field",
                                         "max_documents", "max_tokens", "val_fraction")}
    if spec.root is not None:
        h = hashlib.sha256()
        for path in spec.files:
            try:
                st = path.stat()
                h.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
            except OSError:  # vanished since it was listed: reading it will count it skipped
                h.update(f"{path}\0missing\n".encode())
        key |= {"files": len(spec.files), "files_sha256": h.hexdigest()}
    return key


def _is_val(name: str, val_fraction: float) -> bool:
    # A hash of the document's name, not its position, decides the split: adding a file to the
    # corpus never moves another file between train and validation.
    h = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big")
    return h / 2**64 < val_fraction


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        log.debug("skipping %s: %s", path, err)
        return None


def _as_text(value: object) -> str:
    # a missing or null field is an empty document, not an unreadable file
    return value if isinstance(value, str) else "" if value is None else str(value)


def _check_field(row: dict, spec: SourceSpec, where: str) -> None:
    if spec.text_field not in row:
        raise InputError(f"{where} has no field {spec.text_field!r} ({spec.flag('text_field')}); "
                         f"fields: {list(row)}")


def _iter_table(path: Path, spec: SourceSpec) -> Iterator[str]:
    import datasets

    # streaming: the rows are read in chunks, never a whole column at once
    rows = datasets.load_dataset(TABLE_SUFFIXES[path.suffix], data_files=str(path),
                                 split="train", streaming=True)
    for i, row in enumerate(rows):
        if i == 0:
            _check_field(row, spec, str(path))
        yield _as_text(row[spec.text_field])


def _load_hub(spec: SourceSpec):
    import datasets

    try:
        return datasets.load_dataset(spec.source, spec.hf_config, split=spec.hf_split,
                                     streaming=spec.streaming)
    except Exception as err:  # datasets raises many types; keep it, add which source it was
        kind = MissingInput if isinstance(err, FileNotFoundError) else InputError
        raise kind(f"{spec.label} is no local file or directory, and as a Hugging Face dataset "
                   f"it could not be loaded: {err}") from err


def _records(spec: SourceSpec, start: int) -> Iterator[tuple[str, str | None]]:
    """(name, text) of each record (file or row) from record `start` on; None: unreadable."""
    if spec.root is None:
        ds = _load_hub(spec)
        columns = ds.column_names
        if columns is not None and spec.text_field not in columns:
            _check_field(dict.fromkeys(columns), spec, f"dataset {spec.source}")
        for i, row in enumerate(ds.skip(start) if start else ds, start):
            if i == start:
                _check_field(row, spec, f"dataset {spec.source}")
            yield str(i), _as_text(row[spec.text_field])
        return
    record = 0
    for path in spec.files:
        name = str(path.relative_to(spec.root))
        if path.suffix in TEXT_SUFFIXES:
            if record >= start:  # a text file is one record: skipping it needs no reading
                yield name, _read_text(path)
            record += 1
            continue
        for i, text in enumerate(_iter_table(path, spec)):
            if record >= start:
                yield f"{name}:{i}", text
            record += 1


class _Reader:
    """The non-empty documents of a source in reading order, resumable at any record.

    `record` (records consumed), `docs_read` (readable records, for max_documents) and `skipped`
    (unreadable or non-UTF-8 files) are up to date whenever a document is yielded.
    """

    def __init__(self, spec: SourceSpec, record: int = 0, docs_read: int = 0,
                 skipped: int = 0) -> None:
        self.spec, self.record, self.docs_read, self.skipped = spec, record, docs_read, skipped

    def state(self) -> dict:
        return {"record": self.record, "docs_read": self.docs_read, "skipped": self.skipped}

    def __iter__(self) -> Iterator[tuple[str, str]]:
        limit = self.spec.max_documents
        for name, text in _records(self.spec, self.record):
            if limit is not None and self.docs_read >= limit:
                return
            self.record += 1
            if text is None:
                self.skipped += 1
                continue
            self.docs_read += 1
            if text.strip():
                yield name, text


@dataclass
class Corpus:
    """Every document of one source in memory, split into train and validation."""

    train: list[str]
    val: list[str]
    skipped: int = 0
    """Files that could not be read or were not UTF-8."""


def _check_split_sizes(spec: SourceSpec, n_train: int, n_val: int, skipped: int) -> None:
    if n_train + n_val == 0:
        raise InputError(f"{spec.label} holds no non-empty documents "
                         f"({skipped} files skipped as unreadable or not UTF-8)")
    # a tiny corpus with nothing held out gives its last training document to validation
    if n_train - (n_val == 0) < 1:
        raise InputError(f"{spec.label} has too few documents to split into train and "
                         "validation")


def load_corpus(cfg: DataConfig) -> Corpus:
    """The documents of `cfg.source`, in memory, split by a hash of their names.

    For small corpora, tests and inspection only: `MTPDataModule` streams the documents into its
    shards and never holds a corpus. The split is the one the shards get.
    """
    spec = source_specs(cfg)[0]
    reader = _Reader(spec)
    train, val = [], []
    for name, text in reader:
        (val if _is_val(name, spec.val_fraction) else train).append(text)
    _check_split_sizes(spec, len(train), len(val), reader.skipped)
    if not val:
        val.append(train.pop())
    return Corpus(train=train, val=val, skipped=reader.skipped)


# -- tokenizer ----------------------------------------------------------------------------------


def train_tokenizer(texts: Iterable[str], vocab_size: int, max_bytes: int,
                    eot_token: str = EOT_TOKEN) -> Tokenizer:
    """A byte-level BPE with the end-of-text token `eot_token` (id 0), trained on at most
    `max_bytes`.

    `texts` may be a stream: it is read only up to `max_bytes`.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[eot_token], show_progress=True,
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


def tokenizer_sample(specs: list[SourceSpec], max_bytes: int) -> Iterator[str]:
    """Training documents for the tokenizer: source j's first max_bytes * w_j / sum(w)."""
    total = sum(spec.weight for spec in specs)
    for spec in specs:
        budget, seen = max_bytes * spec.weight / total, 0
        for name, text in _Reader(spec):
            if seen >= budget:
                break
            if not _is_val(name, spec.val_fraction):
                seen += len(text)
                yield text


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """A `tokenizer.json`, with a message naming the file when it is missing or malformed."""
    path = Path(path)
    if not path.is_file():
        raise MissingInput(f"--data.tokenizer {path} does not exist")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception on bad JSON
        raise InputError(f"--data.tokenizer {path} is not a valid tokenizer.json: {err}") from err


def _check_tokenizer(tok: Tokenizer, vocab_size: int, source: str, eot_token: str) -> None:
    if tok.token_to_id(eot_token) is None:
        raise InputError(f"--data.tokenizer {source} has no end-of-text token {eot_token!r} "
                         f"(--model.eot_token)")
    # fewer tokens than embedding rows is fine (pretrained models pad their embeddings)
    if tok.get_vocab_size() > vocab_size:
        raise InputError(f"--data.tokenizer {source} has a vocabulary of {tok.get_vocab_size()} "
                         f"tokens but --model.vocab_size is {vocab_size}")


def _dtype_for(vocab_size: int) -> type:
    return np.uint16 if vocab_size <= 2**16 else np.uint32


# -- files --------------------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    # a rename is durable only once its directory is synced (POSIX; Windows cannot open one)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    write(tmp)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _write_json(path: Path, obj: dict) -> None:
    _atomic_write(path, lambda p: p.write_text(json.dumps(obj, indent=1)))


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path`, so two runs never build the same shard at once."""
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks; runs must not race on one cache
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


class _ShardWriter:
    """The temporary token files of a shard being built, appended to in document order."""

    def __init__(self, root: Path, dtype: type, sizes: dict[str, int] | None) -> None:
        self.dtype = np.dtype(dtype)
        self.paths = {s: root / f"{s}.bin.partial" for s in SPLITS}
        self.files = {}
        for s, path in self.paths.items():
            if sizes is None:
                self.files[s] = open(path, "w+b")
            else:  # resume: drop whatever was written after the checkpoint
                self.files[s] = f = open(path, "r+b")
                f.truncate(sizes[s])
                f.seek(sizes[s])
        self.tokens = {s: self.files[s].tell() // self.dtype.itemsize for s in SPLITS}

    def write(self, split: str, ids: np.ndarray) -> None:
        self.files[split].write(memoryview(ids))
        self.tokens[split] += len(ids)

    def sizes(self) -> dict[str, int]:
        return {s: self.tokens[s] * self.dtype.itemsize for s in SPLITS}

    def sync(self) -> None:
        for f in self.files.values():
            f.flush()
            os.fsync(f.fileno())

    def truncate(self, split: str, n_tokens: int) -> None:
        f = self.files[split]
        f.flush()
        f.truncate(n_tokens * self.dtype.itemsize)
        f.seek(0, os.SEEK_END)
        self.tokens[split] = n_tokens

    def move_tail(self, src: str, start: int, dst: str) -> None:
        """Move tokens [start, end) of split `src` to the end of split `dst`."""
        f = self.files[src]
        f.flush()
        f.seek(start * self.dtype.itemsize)
        tail = np.frombuffer(f.read(), dtype=self.dtype)
        self.truncate(src, start)
        self.write(dst, tail)

    def close(self) -> None:
        for f in self.files.values():
            f.close()


# -- worker processes ---------------------------------------------------------------------------


@dataclass
class _Batch:
    """Consecutive documents of a source, with the reader's state after each of them."""

    texts: list[str] = field(default_factory=list)
    val: list[bool] = field(default_factory=list)
    states: list[dict] = field(default_factory=list)
    chars: int = 0


def _batches(reader: _Reader) -> Iterator[_Batch]:
    batch = _Batch()
    for name, text in reader:
        batch.texts.append(text)
        batch.val.append(_is_val(name, reader.spec.val_fraction))
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


class _EncoderPool:
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
                pending.append((batch, self.executor.submit(_encode, batch.texts)))
                if len(pending) >= self.depth:
                    done, future = pending.popleft()
                    yield done, *future.result()
        while pending:
            done, future = pending.popleft()
            yield done, *future.result()

    def close(self) -> None:
        # batches still queued (after a stop at max_tokens) are dropped; running ones finish
        self.executor.shutdown(wait=True, cancel_futures=True)


# -- building and loading shards ----------------------------------------------------------------


def shard_root(cache_dir: str | os.PathLike, key: dict, tokenizer: Tokenizer,
               eot_token: str = EOT_TOKEN) -> Path:
    """The cache directory of a source's shards under a tokenizer and end-of-text token."""
    what = {"format": SHARD_FORMAT, "source": key}
    if eot_token != EOT_TOKEN:  # the default is left out, so existing shards keep their place
        what["eot_token"] = eot_token
    h = hashlib.sha256(json.dumps(what, sort_keys=True)
                       .encode() + b"\0" + tokenizer.to_str().encode())
    return Path(cache_dir) / "tokens" / h.hexdigest()[:16]


def _resume_point(root: Path, key: dict) -> dict | None:
    """The last checkpoint of an interrupted build of this shard, if it can be resumed."""
    try:
        progress = json.loads((root / "progress.json").read_text())
    except (OSError, ValueError):
        return None
    if progress.get("format") != SHARD_FORMAT or progress.get("key") != key:
        return None
    for split in SPLITS:
        path = root / f"{split}.bin.partial"
        if not path.is_file() or path.stat().st_size < progress["bytes"][split]:
            log.warning("cannot resume %s: %s is shorter than its checkpoint", root, path)
            return None
    return progress


def build_shards(spec: SourceSpec, tokenizer: Tokenizer, root: Path, *, workers: int,
                 key: dict | None = None, eot_token: str = EOT_TOKEN) -> dict:
    """Tokenise one source into `root/{train,val}.bin`, each document followed by `eot_token`;
    returns its meta.json.

    Reuses a complete shard, resumes an interrupted one from its last checkpoint, and otherwise
    starts afresh. The output depends only on the source and the tokenizer, never on `workers`
    or on where an earlier run was interrupted.
    """
    meta = root / "meta.json"
    if meta.is_file():  # complete (and, being complete, never written again: no lock needed)
        return json.loads(meta.read_text())
    key = spec_key(spec) if key is None else key
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / "lock"):
        if meta.is_file():  # another run finished it while this one waited for the lock
            return json.loads(meta.read_text())
        return _build_locked(spec, tokenizer, root, workers, key, eot_token)


def _build_locked(spec: SourceSpec, tokenizer: Tokenizer, root: Path, workers: int,
                  key: dict, eot_token: str) -> dict:
    eot = tokenizer.token_to_id(eot_token)
    if eot is None:
        raise InputError(f"the tokenizer has no end-of-text token {eot_token!r} "
                         f"(--model.eot_token)")
    dtype = _dtype_for(tokenizer.get_vocab_size())
    progress = _resume_point(root, key)
    if progress is not None:
        log.info("resuming %s at record %d (%d documents tokenised)", spec.label,
                 progress["record"], sum(progress["documents"].values()))
        state = {k: progress[k] for k in ("record", "docs_read", "skipped", "documents",
                                          "train_last_doc")}
    else:
        state = {"record": 0, "docs_read": 0, "skipped": 0,
                 "documents": dict.fromkeys(SPLITS, 0), "train_last_doc": -1}
    writer = _ShardWriter(root, dtype, progress and progress["bytes"])
    reader = _Reader(spec, state["record"], state["docs_read"], state["skipped"])

    def checkpoint() -> None:
        writer.sync()  # the data first: the record must never claim bytes that are not on disk
        _write_json(root / "progress.json", {"format": SHARD_FORMAT, "key": key, **state,
                                             "bytes": writer.sizes()})

    bar = tqdm(desc=f"tokenising {spec.source}", unit="tok", unit_scale=True,
               initial=sum(writer.tokens.values()), smoothing=0.1)
    pool = _EncoderPool(tokenizer, eot, dtype, workers)
    stopped, since_docs, since_chars = False, 0, 0
    try:
        for batch, ids, lengths in pool.map(_batches(reader)):
            ends = np.cumsum(lengths)
            for i, end in enumerate(ends):
                split = "val" if batch.val[i] else "train"
                if split == "train":
                    state["train_last_doc"] = writer.tokens["train"]
                writer.write(split, ids[end - lengths[i]:end])
                state["documents"][split] += 1
                state |= batch.states[i]
                if spec.max_tokens is not None and writer.tokens["train"] >= spec.max_tokens:
                    stopped = True
                    break
            bar.update(int(ends[i]))
            if stopped:
                break
            since_docs, since_chars = since_docs + len(lengths), since_chars + batch.chars
            if since_docs >= CHECKPOINT_DOCS or since_chars >= CHECKPOINT_CHARS:
                checkpoint()
                since_docs = since_chars = 0
        if not stopped:  # the source ran out: its trailing unreadable files count too
            state |= reader.state()
    except BaseException:
        writer.close()  # the checkpoint stays: the next run resumes there
        raise
    finally:
        pool.close()
        bar.close()
    return _finish(spec, writer, root, key, state, stopped, tokenizer, eot_token)


def _finish(spec: SourceSpec, writer: _ShardWriter, root: Path, key: dict, state: dict,
            stopped: bool, tokenizer: Tokenizer, eot_token: str) -> dict:
    docs = state["documents"]
    try:
        _check_split_sizes(spec, docs["train"], docs["val"], state["skipped"])
        if stopped:
            writer.truncate("train", spec.max_tokens)
        if not docs["val"]:  # a tiny corpus: hold out one document rather than validate on none
            writer.move_tail("train", state["train_last_doc"], "val")
            docs["train"], docs["val"] = docs["train"] - 1, 1
        writer.sync()
    finally:
        writer.close()
    if state["skipped"]:
        log.warning("skipped %d unreadable or non-UTF-8 files of %s", state["skipped"],
                    spec.label)
    meta = {"format": SHARD_FORMAT, "source": spec.source, "key": key,
            "tokenizer_sha256": hashlib.sha256(tokenizer.to_str().encode()).hexdigest(),
            "eot_token": eot_token, "dtype": writer.dtype.name, "skipped_files": state["skipped"],
            "documents_read": state["docs_read"], "documents": docs,
            "stopped_at_max_tokens": stopped, "sha256": {}}
    for split in SPLITS:
        meta[f"{split}_tokens"] = writer.tokens[split]
        meta["sha256"][split] = _sha256(writer.paths[split])
        os.replace(writer.paths[split], root / f"{split}.bin")
    _fsync_dir(root)
    _write_json(root / "meta.json", meta)  # last: from here on the shard is trusted
    (root / "progress.json").unlink(missing_ok=True)
    return meta


def load_shards(root: Path) -> tuple[dict, np.memmap, np.memmap]:
    """A complete shard's meta and its two token files, each checked against meta's token
    count and sha256 before anything reads it.

    Hashing reads the whole file, so a file that passed is noted in ``verified.json`` with its
    size and modification time, and is hashed again only when either changes.
    """
    meta = json.loads((root / "meta.json").read_text())
    dtype = np.dtype(meta["dtype"])
    try:
        verified = json.loads((root / "verified.json").read_text())
    except (OSError, ValueError):
        verified = {}
    arrays, changed = [], False
    for split in SPLITS:
        path = root / f"{split}.bin"
        expected = meta[f"{split}_tokens"] * dtype.itemsize
        stat = path.stat() if path.is_file() else None
        actual = stat.st_size if stat else 0
        if actual != expected:
            raise InputError(
                f"token shard {path} holds {actual} bytes but {root / 'meta.json'} records "
                f"{meta[f'{split}_tokens']} tokens ({expected} bytes): the file was truncated or "
                f"overwritten; delete {root} to tokenise the source again")
        seen = [stat.st_size, stat.st_mtime_ns]
        want = meta.get("sha256", {}).get(split)
        if want is not None and verified.get(split) != [*seen, want]:
            if _sha256(path) != want:
                raise InputError(
                    f"token shard {path} does not match the sha256 that {root / 'meta.json'} "
                    f"records: the file was overwritten after it was tokenised; delete {root} "
                    f"to tokenise the source again")
            verified[split], changed = [*seen, want], True
        arrays.append(np.memmap(path, dtype=dtype, mode="r"))
    if changed:
        with suppress(OSError):  # a read-only cache is hashed on every load instead
            _write_json(root / "verified.json", verified)
    return meta, *arrays


# -- windows and samplers -----------------------------------------------------------------------


class TokenWindows(Dataset):
    """Windows of `seq_len + n_future` tokens at stride `seq_len` over a token file.

    Window j holds tokens [j * seq_len, j * seq_len + seq_len + K); position t of the input
    predicts, at head i, the token t + i (1-based i), so the last K tokens are targets only.
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
            _check_tokenizer(tok, self.vocab_size, cfg.tokenizer, self.eot_token)
            return tok
        mixture: list = [{"key": k, "weight": s.weight} for s, k in zip(specs, keys)]
        if self.eot_token != EOT_TOKEN:  # as in `shard_root`
            mixture.append({"eot_token": self.eot_token})
        h = hashlib.sha256(json.dumps(mixture, sort_keys=True).encode()).hexdigest()[:16]
        path = Path(cfg.cache_dir) / "tokenizers" / (
            f"{h}-v{self.vocab_size}-b{cfg.tokenizer_train_bytes}.json")
        if path.is_file():
            return Tokenizer.from_file(str(path))
        tok = train_tokenizer(tokenizer_sample(specs, cfg.tokenizer_train_bytes),
                              self.vocab_size, cfg.tokenizer_train_bytes, self.eot_token)
        path.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write(path, lambda p: tok.save(str(p)))
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
    def state_dict(self) -> dict:
        t = self.trainer
        consumed = self.samples_consumed
        if t is not None:
            consumed = (t.global_step * t.accumulate_grad_batches * self.cfg.batch_size
                        * t.world_size)
        return {"samples_consumed": consumed}

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

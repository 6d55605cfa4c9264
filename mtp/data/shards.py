"""Token shards: one memory-mapped token file per split of a source, built crash-safely and
verified on loading.

Tokenisation never holds the corpus: documents stream from the source's reader to
`--data.tokenize_workers` processes (`mtp.data.encoder_pool`) and their token ids are appended in
document order, each document followed by an end-of-text token, so the shards are
byte-identical for any worker count. A shard is built as `{train,val}.bin.partial` plus
`progress.json`, a checkpoint (bytes of each file, records consumed, counters) written after an
fsync every `CHECKPOINT_DOCS` documents or `CHECKPOINT_CHARS` characters. A run that was killed
resumes there: it truncates the files to the recorded sizes and skips the consumed records. Only
`meta.json`, written atomically after the files are renamed to `{train,val}.bin`, marks a shard
complete; it records the token counts and a sha256 of each file, and loading checks each file's
size against it.

A shard's directory is keyed by a hash of the source specification (what `spec_key` returns:
source, Hugging Face config, split and field, max_documents, max_tokens, val_fraction and, for
local sources, every file's path, size and mtime) and of the tokenizer. A Hugging Face dataset
is keyed by name only: a new revision published under the same name is not noticed (delete the
shard directory, or change any part of the specification).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer
from tqdm.auto import tqdm

from mtp.data.corpus import DocumentReader, SourceSpec, check_split_sizes, spec_key
from mtp.data.encoder_pool import EncoderPool, document_batches
from mtp.model.checkpoint import EOT_TOKEN
from mtp.util.atomic import rename, write_json, writing
from mtp.util.errors import InputError

log = logging.getLogger(__name__)

SHARD_FORMAT = 2  # bump when the layout of the token files or the meaning of the key changes
SPLITS = ("train", "val")

# A checkpoint costs two fsyncs; a killed run redoes at most this much work.
CHECKPOINT_DOCS = 20_000
CHECKPOINT_CHARS = 64 << 20


# -- files --------------------------------------------------------------------------------------


def _write_json(path: Path, obj: dict) -> None:
    write_json(path, obj, indent=1, what="the token shard's record")


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock on the file `path` (created if need be), so that two runs never build
    the same tokenizer or shard at once: the second waits, then finds the first one's result.
    An flock belongs to the open file, so the kernel releases it however the process ends
    (kill -9 included; the tokenising workers, which inherit it, die with their parent)."""
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks; runs must not race on one cache
        yield
        return
    with writing(path, "the lock file of the token cache"):
        f = open(path, "a")  # noqa: SIM115 - closed below
    with f:
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
        with writing(self.paths[split], "a token shard"):
            self.files[split].write(memoryview(ids))
        self.tokens[split] += len(ids)

    def sizes(self) -> dict[str, int]:
        return {s: self.tokens[s] * self.dtype.itemsize for s in SPLITS}

    def sync(self) -> None:
        for split, f in self.files.items():
            with writing(self.paths[split], "a token shard"):
                f.flush()
                os.fsync(f.fileno())

    def truncate(self, split: str, n_tokens: int) -> None:
        f = self.files[split]
        with writing(self.paths[split], "a token shard"):
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


# -- building and loading shards ----------------------------------------------------------------


def _dtype_for(vocab_size: int) -> type:
    return np.uint16 if vocab_size <= 2**16 else np.uint32


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
    with writing(root, "the token shards' folder (--data.cache_dir)"):
        root.mkdir(parents=True, exist_ok=True)
    with locked(root / "lock"):
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
    reader = DocumentReader(spec, state["record"], state["docs_read"], state["skipped"])

    def checkpoint() -> None:
        writer.sync()  # the data first: the record must never claim bytes that are not on disk
        _write_json(root / "progress.json", {"format": SHARD_FORMAT, "key": key, **state,
                                             "bytes": writer.sizes()})

    bar = tqdm(desc=f"tokenising {spec.source}", unit="tok", unit_scale=True,
               initial=sum(writer.tokens.values()), smoothing=0.1)
    pool = EncoderPool(tokenizer, eot, dtype, workers)
    stopped, since_docs, since_chars = False, 0, 0
    try:
        for batch, ids, lengths in pool.map(document_batches(reader)):
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
        check_split_sizes(spec, docs["train"], docs["val"], state["skipped"])
        if stopped:
            writer.truncate("train", spec.max_tokens)
        if not docs["val"]:  # a tiny corpus: hold out one document rather than validate on none
            writer.move_tail("train", state["train_last_doc"], "val")
            docs["train"], docs["val"] = docs["train"] - 1, 1
        writer.sync()
    finally:
        writer.close()
    if state["skipped"]:
        log.warning("skipped %d unreadable, non-UTF-8 or binary files of %s", state["skipped"],
                    spec.label)
    meta = {"format": SHARD_FORMAT, "source": spec.source, "key": key,
            "tokenizer_sha256": hashlib.sha256(tokenizer.to_str().encode()).hexdigest(),
            "eot_token": eot_token, "dtype": writer.dtype.name, "skipped_files": state["skipped"],
            "documents_read": state["docs_read"], "documents": docs,
            "stopped_at_max_tokens": stopped, "sha256": {}}
    for split in SPLITS:
        meta[f"{split}_tokens"] = writer.tokens[split]
        meta["sha256"][split] = _sha256(writer.paths[split])
        rename(writer.paths[split], root / f"{split}.bin")
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

"""Sources of documents and how they are read: specifications, readers, the train/validation split.

A source is the standard library, a Hugging Face dataset, or local files (a path, directory or
glob of .py / .txt files and .jsonl / .json / .parquet tables); `source_specs` lists a data
config's sources. `DocumentReader` streams a source's non-empty documents one at a time, resumable
at any record; a hash of each document's name puts it in the training or the validation split.
`load_corpus` holds one source in memory, for tests and inspection.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from mtp.config import DataConfig
from mtp.util.errors import InputError, MissingInput

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".py", ".txt")
TABLE_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


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
    return _regular_once(p for p in root.rglob("*.py") if "site-packages" not in p.parts)


def _regular_once(paths) -> list[Path]:
    """The regular files among `paths` (a link to one counts; a pipe, socket or device never
    does: reading one can block for ever), each file once by its resolved path, in path order.

    A file reached under several names keeps the name that passes no link, if one of them
    does, else the first in path order: adding a link never renames a document.
    """
    names: dict[Path, list[Path]] = {}
    for p in paths:
        if p.is_file():
            names.setdefault(p.resolve(), []).append(p)
    return sorted(min(found, key=lambda p: (p.absolute() != real, p))
                  for real, found in names.items())


def _glob(pattern: str) -> list[Path]:
    """The paths a glob matches, as `glob.glob(pattern, recursive=True)` gives them but never
    through a link to a folder at a `**`: with `corpus/loop -> .` that glob lists every file once
    per level of `loop/loop/...` (and `corpus/up -> ../corpus` without end), where this lists
    each name at most once per link a single `*` component passes.

    Names starting with `.` match only a pattern component starting with `.`, as in `glob`.
    """
    parts = Path(os.path.expanduser(pattern)).parts
    first = next(i for i, part in enumerate(parts) if any(c in part for c in "*?["))
    base = Path(*parts[:first]) if first else Path(".")
    rest = list(parts[first:])
    if rest[-1] == "**":  # glob's `x/**` matches the files below x too
        rest.append("*")
    hidden_ok = any(part.startswith(".") for part in rest)
    # pathlib's `**` does not follow links to folders (3.13 on: unless asked to); a test holds
    # it to that on the Python in use
    return [p for p in base.glob("/".join(rest))
            if hidden_ok or not any(q.startswith(".") for q in p.relative_to(base).parts)]


def _local_files(source: str) -> list[Path]:
    path = Path(source).expanduser()
    if path.is_dir():  # rglob does not follow links to folders
        files = _regular_once(path.rglob("*"))
    elif any(c in source for c in "*?["):
        files = _regular_once(_glob(source))
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


def in_validation(name: str, val_fraction: float) -> bool:
    # A hash of the document's name, not its position, decides the split: adding a file to the
    # corpus never moves another file between train and validation.
    h = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big")
    return h / 2**64 < val_fraction


def _read_text(path: Path) -> str | None:
    """A text file's contents; None for one that cannot be read, is not UTF-8, holds a NUL byte
    (binary, not text: warned, naming it) or is no longer a regular file (a pipe put in its
    place is not waited on)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with open(fd, encoding="utf-8") as f:  # universal newlines, as `Path.read_text`
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                log.warning("skipping %s: not a regular file", path)
                return None
            text = f.read()
    except (OSError, UnicodeDecodeError) as err:
        log.debug("skipping %s: %s", path, err)
        return None
    if "\0" in text:
        log.warning("skipping %s: it holds NUL bytes, so it is binary, not a text document",
                    path)
        return None
    return text


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


class DocumentReader:
    """The non-empty documents of a source in reading order, resumable at any record.

    `record` (records consumed), `docs_read` (readable records, for max_documents) and `skipped`
    (unreadable, non-UTF-8 or binary files) are up to date whenever a document is yielded.
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
    """Files that could not be read, were not UTF-8 or were binary (held a NUL byte)."""


def check_split_sizes(spec: SourceSpec, n_train: int, n_val: int, skipped: int) -> None:
    if n_train + n_val == 0:
        raise InputError(f"{spec.label} holds no non-empty documents "
                         f"({skipped} files skipped as unreadable, not UTF-8 or binary)")
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
    reader = DocumentReader(spec)
    train, val = [], []
    for name, text in reader:
        (val if in_validation(name, spec.val_fraction) else train).append(text)
    check_split_sizes(spec, len(train), len(val), reader.skipped)
    if not val:
        val.append(train.pop())
    return Corpus(train=train, val=val, skipped=reader.skipped)

"""Files that are either whole or absent: every write mtp keeps goes through here.

A write goes to a fresh temporary file beside its target, which is flushed and fsynced, renamed onto
the target, and the directory fsynced (a rename is durable only once its directory is). A crash, a
full disk or a signal at any point leaves the old file, or no file, never half of one; the temporary
file is removed where the process lives to do it (`mtp.train.fault` removes those a `kill -9` left).
`rename` is the one rename of the code base: moves go through it too.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO

__all__ = ["atomic_file", "atomic_write", "fsync_dir", "fsync_file", "lock", "rename",
           "write_json", "write_text"]

# The process's umask (read by setting it, then set back): a written file gets the mode a plain
# open would give it, not mkstemp's owner-only 0600, so a shared cache or results folder stays
# readable as before.
_UMASK = os.umask(0o022)
os.umask(_UMASK)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make the renames in directory `path` durable (POSIX; where a directory cannot be opened,
    as on Windows, nothing to do)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def lock(f: IO | int, *, blocking: bool) -> bool:
    """An exclusive flock on open file (or directory descriptor) `f`, released when it is
    closed or the process ends however it ends; False if another process holds it (without
    `blocking`). What one process is writing, no other writes at the same time."""
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks
        return True
    try:
        fcntl.flock(f, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    return True


def rename(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Rename `src` onto `dst` (a file, or a directory onto an empty one) and make it durable."""
    os.replace(src, dst)
    fsync_dir(Path(dst).parent)


@contextmanager
def _temporary(path: Path, prefix: str | None) -> Iterator[tuple[int, Path]]:
    """A new temporary file beside `path` (its descriptor and path), removed if the block
    raises."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=prefix or f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)
        yield fd, Path(tmp)
    except BaseException:  # a full disk, or a SIGINT / SIGTERM (`mtp.train.fault.Stopped`)
        with suppress(OSError):
            os.unlink(tmp)
        raise


@contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "wb", *,
                prefix: str | None = None) -> Iterator[IO]:
    """Open a temporary file to write `path`'s new content into; when the block ends cleanly it
    becomes `path`. The file stays open until the rename, so a lock taken on it covers the
    temporary file's whole life (`mtp.train.fault` relies on this)."""
    path = Path(path)
    with _temporary(path, prefix) as (fd, tmp), os.fdopen(fd, mode) as f:
        yield f
        f.flush()
        os.fsync(f.fileno())
        rename(tmp, path)


def atomic_write(path: str | os.PathLike, write: Callable[[Path], object], *,
                 prefix: str | None = None) -> None:
    """`write(tmp)` writes the new content by path (for writers that take a file name, such as
    `torch.save` or `Tokenizer.save`); then it becomes `path`. `tmp` exists, empty, beforehand."""
    path = Path(path)
    with _temporary(path, prefix) as (fd, tmp):
        os.close(fd)
        write(tmp)
        fsync_file(tmp)
        rename(tmp, path)


def write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_file(path, "w") as f:
        f.write(text)


def write_json(path: str | os.PathLike, obj, **dumps) -> None:
    write_text(path, json.dumps(obj, **dumps) + "\n")

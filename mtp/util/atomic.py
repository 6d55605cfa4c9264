"""Files that are either whole or absent: every write mtp keeps goes through here.

A write goes to a fresh temporary file beside its target, which is flushed and fsynced, renamed onto
the target, and the directory fsynced (a rename is durable only once its directory is). A crash, a
full disk or a signal at any point leaves the old file, or no file, never half of one; the temporary
file is removed where the process lives to do it (`mtp.train.fault` removes those a `kill -9` left).
`rename` is the one rename of the code base: moves go through it too.

A write that fails (a full disk, a read-only folder, a quota) is named: `writing` turns the
operating system's error into a `WriteError` that says which file, and what it holds, could not
be written; `mtp` prints that line and exits 2. Files that grow a line at a time (evaluation
samples, a distilled corpus, benchmark CSVs) are `AppendOnlyFile`s: each append is written in
one call and cut back if it fails, so such a file always ends with its last complete line.
"""

from __future__ import annotations

import errno
import json
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO

from mtp.util.errors import WriteError

__all__ = ["DISK_ERRNOS", "AppendOnlyFile", "atomic_file", "atomic_write", "check_writable",
           "fsync_dir", "fsync_file", "lock", "os_error_of", "rename", "write_json", "write_text",
           "writing"]

#: Errors that only a write raises: the disk or a quota is full, a file would grow past the
#: size allowed (a quota, `ulimit -f`), the folder is read-only. An error carrying one is a write
#: failure wherever it is caught (`mtp.train.cli` names those Lightning and loggers raise).
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})

# How libraries written in Rust (safetensors, tokenizers) spell an operating system's error.
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")

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


def os_error_of(err: BaseException) -> OSError | None:
    """The operating system's error behind `err`: `err` itself, one it was raised from or while
    handling (`torch.save` turns a failed write of its file into a RuntimeError raised while
    handling the OSError), or one a Rust library (safetensors, tokenizers) gives only in its
    message; None if there is none."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno is not None:
            return err
        found = _RUST_OS_ERROR.search(str(err)[-200:])
        if found:
            code = int(found[1])
            return OSError(code, os.strerror(code))
        err = err.__cause__ or err.__context__
    return None


@contextmanager
def writing(path: str | os.PathLike, what: str) -> Iterator[None]:
    """Name a write that fails in the block: the operating system's error behind an exception
    raised there (`os_error_of`) becomes a `WriteError` naming `path` and `what` it holds (`the
    checkpoint`, `scored samples`), which `mtp` prints as one line and exits 2. The one place
    where mtp turns a failed write into a user's error. Other exceptions pass unchanged."""
    try:
        yield
    except WriteError:
        raise
    except Exception as err:
        found = os_error_of(err)
        if found is None:
            raise
        raise WriteError(path, what, found.errno, found.strerror or str(found)) from err


def check_writable(folder: str | os.PathLike, what: str) -> None:
    """Create `folder` (and those above it) and a file in it, then remove the file: a folder
    that cannot be written (read-only, full, a file in its path) is named as `what` before any
    work is done whose results would go there, not after it."""
    folder = Path(folder)
    with writing(folder, what):
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".mtp-probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)


def rename(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Rename `src` onto `dst` (a file, or a directory onto an empty one) and make it durable."""
    os.replace(src, dst)
    fsync_dir(Path(dst).parent)


@contextmanager
def _temporary(path: Path, prefix: str | None, what: str) -> Iterator[tuple[int, Path]]:
    """A new temporary file beside `path` (its descriptor and path), removed if the block
    raises; a write that fails in it is named as `path`'s (`writing`)."""
    with writing(path, what):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=prefix or f".{path.name}.", suffix=".tmp",
                                   dir=path.parent)
        try:
            os.fchmod(fd, 0o666 & ~_UMASK)
            yield fd, Path(tmp)
        except BaseException:  # a full disk, or a SIGINT / SIGTERM (`mtp.train.fault.Stopped`)
            with suppress(OSError):
                os.unlink(tmp)
            raise


@contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "wb", *, prefix: str | None = None,
                what: str = "the file") -> Iterator[IO]:
    """Open a temporary file to write `path`'s new content into; when the block ends cleanly it
    becomes `path`. The file stays open until the rename, so a lock taken on it covers the
    temporary file's whole life (`mtp.train.fault` relies on this). A failed write raises a
    `WriteError` naming `path` and `what` it holds; the old `path` stays as it was."""
    path = Path(path)
    with _temporary(path, prefix, what) as (fd, tmp), os.fdopen(fd, mode) as f:
        yield f
        f.flush()
        os.fsync(f.fileno())
        rename(tmp, path)


def atomic_write(path: str | os.PathLike, write: Callable[[Path], object], *,
                 prefix: str | None = None, what: str = "the file") -> None:
    """`write(tmp)` writes the new content by path (for writers that take a file name, such as
    `Tokenizer.save`); then it becomes `path`. `tmp` exists, empty, beforehand. A failed write
    raises a `WriteError` naming `path` and `what` it holds."""
    path = Path(path)
    with _temporary(path, prefix, what) as (fd, tmp):
        os.close(fd)
        write(tmp)
        fsync_file(tmp)
        rename(tmp, path)


def write_text(path: str | os.PathLike, text: str, *, what: str = "the file") -> None:
    with atomic_file(path, "w", what=what) as f:
        f.write(text)


def write_json(path: str | os.PathLike, obj, *, what: str = "the file", **dumps) -> None:
    write_text(path, json.dumps(obj, **dumps) + "\n", what=what)


def _end_of_last_line(fd: int, size: int) -> int:
    """The offset just past the last newline of the first `size` bytes of `fd` (0 if none),
    read backwards: a long file costs one block, not a whole read."""
    end = size
    while end > 0:
        start = max(0, end - (1 << 16))
        newline = os.pread(fd, end - start, start).rfind(b"\n")
        if newline >= 0:
            return start + newline + 1
        end = start
    return 0


class AppendOnlyFile:
    """A file of lines that is only ever appended to and always ends with a complete line.

    Opening it cuts a last line that a killed run left unfinished (`torn` says how many bytes).
    `append` writes whole lines in one call and fsyncs them; if the write fails (a full disk, a
    quota, a signal) the file is cut back to where it was before the call, and a `WriteError`
    names the file: the lines written before are never touched, and the next run finds no
    fragment to misread.

    Args:
        path: The file (created, with its folder, if need be).
        what: What it holds, for the error message (`scored samples`).
        exclusive: Take an flock on it first (held until `close`); `BlockingIOError` if
            another process holds one.
    """

    def __init__(self, path: str | os.PathLike, what: str, *, exclusive: bool = False) -> None:
        self.path, self.what = Path(path), what
        with writing(self.path, what):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC,
                              0o666)
        try:
            if exclusive and not lock(self.fd, blocking=False):
                raise BlockingIOError(errno.EWOULDBLOCK, "being written by another process",
                                      str(self.path))
            size = os.fstat(self.fd).st_size
            self.size = _end_of_last_line(self.fd, size)
            self.torn = size - self.size
            if self.torn:
                with writing(self.path, what):
                    os.ftruncate(self.fd, self.size)
        except BaseException:
            os.close(self.fd)
            raise

    def append(self, lines: str | bytes) -> None:
        """Write `lines` (ending with a newline) at the end, durably, or not at all."""
        data = lines.encode("utf-8") if isinstance(lines, str) else lines
        if not data.endswith(b"\n"):
            raise ValueError("AppendOnlyFile.append takes whole lines, ending with a newline")
        with writing(self.path, self.what):
            try:
                view, done = memoryview(data), 0
                while done < len(data):  # a regular file takes all, or part then an error
                    done += os.write(self.fd, view[done:])
                os.fsync(self.fd)
            except BaseException:
                with suppress(OSError):
                    os.ftruncate(self.fd, self.size)
                raise
        self.size += len(data)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> AppendOnlyFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

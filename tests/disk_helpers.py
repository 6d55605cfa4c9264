"""What the tests of write failures share: a disk that fills at a chosen file, at the operating
system's level (deterministic, anywhere), and real small or read-only file systems where this
machine can mount them (a tmpfs; skipped where mounting is impossible).

`failing_writes` patches `os.write` and `os.fsync`, the calls through which mtp's appends
(`mtp.util.atomic.AppendOnlyFile`) write and every kept file is made durable: a write to a
matching file writes part of its bytes, as a filling disk does, then fails with the errno given.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def _path_of(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def failing_writes(monkeypatch, name: str, code: int = errno.ENOSPC, *,
                   after: int = 0) -> list[str]:
    """From now on the disk fills at files whose path contains `name`: once `after` more bytes
    have gone to them, the next write puts down only part of its bytes (a short write, as a
    filling disk gives), and every later write or fsync of them fails with `code`. Returns the
    paths of the writes that failed."""
    real_write, real_fsync = os.write, os.fsync
    failed: list[str] = []
    state = {"left": after, "full": False}

    def write(fd, data):
        path = _path_of(fd)
        if name not in path:
            return real_write(fd, data)
        if not state["full"] and len(data) <= state["left"]:
            state["left"] -= len(data)
            return real_write(fd, data)
        part = 0 if state["full"] else state["left"] or len(data) // 2
        state["full"] = True
        if part:
            return real_write(fd, bytes(memoryview(data)[:part]))
        failed.append(path)
        raise OSError(code, os.strerror(code))

    def fsync(fd):
        if state["full"] and name in _path_of(fd):
            raise OSError(code, os.strerror(code))
        return real_fsync(fd)

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "fsync", fsync)
    return failed


def failing_fsync(monkeypatch, name: str, code: int = errno.ENOSPC) -> None:
    """Every fsync of a file whose path contains `name` fails with `code`: a disk that took
    the data into its cache and then has no room for it (the last moment a write can fail)."""
    real = os.fsync

    def fsync(fd):
        if name in _path_of(fd):
            raise OSError(code, os.strerror(code))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def _mount(folder: Path, options: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None:
        pytest.skip("no mount command here")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
                          capture_output=True, text=True)
    if proc.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")


def _unmount(folder: Path) -> None:
    subprocess.run(["umount", "-l", str(folder)], capture_output=True)


@contextmanager
def small_disk(folder: Path, size: str) -> Iterator[Path]:
    """`folder` as a file system of `size` (`64k`, `2m`): a tmpfs, unmounted afterwards;
    skipped where this machine cannot mount one (not root, no mount)."""
    _mount(folder, f"size={size}")
    try:
        yield folder
    finally:
        _unmount(folder)


def resize(folder: Path, size: str) -> None:
    """Give the file system of `small_disk` another size (room again, for a rerun)."""
    subprocess.run(["mount", "-o", f"remount,size={size}", str(folder)], check=True)


@contextmanager
def read_only_folder(folder: Path) -> Iterator[Path]:
    """`folder` on a file system mounted read-only (as root, a folder's mode stops nothing),
    or, where mounting is impossible and the tests do not run as root, a folder of mode 555;
    skipped otherwise."""
    if os.geteuid() != 0:
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o555)
        try:
            yield folder
        finally:
            folder.chmod(0o755)
        return
    _mount(folder, "ro,size=64k")
    try:
        yield folder
    finally:
        _unmount(folder)


def fill(folder: Path, leave: int = 0) -> Path:
    """Fill the file system of `folder` up to `leave` bytes free; the filler file's path."""
    filler = folder / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                free = os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize
                if free <= leave:
                    break
                f.write(b"\0" * min(1 << 16, max(free - leave, 1)))
                f.flush()
        except OSError as err:
            assert err.errno == errno.ENOSPC, err
    return filler

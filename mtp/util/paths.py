"""What a path given to mtp is, in words: a file mtp reads must be a regular file, and one that
is not is named for what it is ("is a named pipe", "is a character device"), not said to be
missing. Reading a pipe or a device as a file would block, or never end (`/dev/zero`)."""

from __future__ import annotations

import errno
import os
import stat

__all__ = ["not_a_file"]

_KINDS = ((stat.S_ISDIR, "is a directory"), (stat.S_ISFIFO, "is a named pipe"),
          (stat.S_ISCHR, "is a character device"), (stat.S_ISBLK, "is a block device"),
          (stat.S_ISSOCK, "is a socket"))


def not_a_file(path: str | os.PathLike) -> str | None:
    """Why `path` cannot be read as a regular file, as the end of a sentence that begins with
    the path ("does not exist", "is a directory", "is a named pipe", "is a character device",
    "is a symbolic link in a loop", ...), or None if it is one."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return ("is a symbolic link to nothing" if os.path.islink(path) else "does not exist")
    except OSError as err:
        if err.errno == errno.ELOOP:
            return "is a symbolic link in a loop"
        if err.errno == errno.ENOTDIR:
            return "does not exist (a part of its path is a file)"
        return f"cannot be read ({err.strerror})"
    if stat.S_ISREG(mode):
        return None
    return next((words for test, words in _KINDS if test(mode)), "is not a regular file")

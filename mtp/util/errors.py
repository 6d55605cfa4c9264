"""The errors that say a user's input is wrong: `mtp` reports them in a line or two, naming the
flag, file or value, and exits 2 (`mtp.cli`)."""

from __future__ import annotations

__all__ = ["ConfigError", "ExportError", "InputError", "MissingInput", "UserError", "WriteError"]


class UserError(Exception):
    """A mistake in a command line, a file or a value; the message names it. `mtp` reports
    these in a line or two and exits 2 (with `--debug`, with the traceback)."""


class ConfigError(ValueError, UserError):
    """A configuration value is invalid; the message names each offending flag."""


class InputError(ValueError, UserError):
    """A file or value given to mtp is unusable (a corpus, tokenizer, shard or checkpoint)."""


class MissingInput(FileNotFoundError, UserError):
    """A file or directory given to mtp does not exist or holds nothing usable."""


class WriteError(OSError, UserError):
    """A file mtp writes could not be written: a full disk, a read-only folder, a quota. An
    `OSError` still (with the original errno, message and the path), so that code which handles
    an operating system's error goes on handling it; `str` gives the one line `mtp` prints,
    naming the path and what was being written (`mtp.util.atomic.writing`)."""

    def __init__(self, path: object, what: str, errno: int | None, strerror: str) -> None:
        super().__init__(errno, strerror, str(path))
        self.what = what

    def __str__(self) -> str:
        return f"cannot write {self.what} {self.filename}: {self.strerror}"

    def __reduce__(self):  # pickled across processes (DDP ranks) with its own arguments
        return type(self), (self.filename, self.what, self.errno, self.strerror)


class ExportError(ValueError):
    """A model or directory that cannot be written in, or read from, another library's layout
    (an export, a pretrained checkpoint); the message says why."""

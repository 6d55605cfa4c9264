"""`mtp fit --help` and `mtp validate --help` without importing torch or Lightning.

LightningCLI builds its help from the signatures of `Trainer` and mtp's config classes, which takes
seconds: it imports torch and Lightning and inspects every class. The help of each command is kept
in `mtp/train/fit_help/<command>.txt`, written by `python -m mtp.train.fit_help`, and printed from
there when the installed Lightning and jsonargparse are the versions it was written with; otherwise
LightningCLI answers. A test writes the text afresh and fails when the stored copy differs, so it
cannot drift from the code.
"""

from __future__ import annotations

import contextlib
import io
import os
from importlib import metadata
from pathlib import Path

__all__ = ["COMMANDS", "live_help", "stored_help", "write"]

COMMANDS = ("fit", "validate")
#: The width the stored help is wrapped to (argparse reads it from $COLUMNS).
COLUMNS = 100
_DIR = Path(__file__).resolve().parent


def _stamp() -> str:
    found = []
    for dist in ("lightning", "jsonargparse"):
        try:
            found.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            found.append(f"{dist} none")
    return "# " + ", ".join(found)


def stored_help(command: str) -> str | None:
    """The stored help of `command`, or None where it is missing or was written with other
    versions of Lightning or jsonargparse than those installed."""
    path = _DIR / f"{command}.txt"
    if not path.is_file():
        return None
    stamp, _, text = path.read_text().partition("\n")
    return text if stamp == _stamp() else None


def live_help(command: str) -> str:
    """LightningCLI's help of `command`, wrapped at `COLUMNS`."""
    from mtp.train.cli import fit_main

    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(COLUMNS)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            fit_main([command, "--help"])
    finally:
        if before is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = before
    return out.getvalue()


def write() -> list[Path]:
    """Store the help of every command (run after changing a config class or a Trainer
    default)."""
    paths = []
    for command in COMMANDS:
        path = _DIR / f"{command}.txt"
        path.write_text(_stamp() + "\n" + live_help(command))
        paths.append(path)
    return paths

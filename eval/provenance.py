"""What produced an evaluation's results, so that a rerun into the same ``--output`` reuses them
only when all of it matches.

``provenance.json`` in an output directory records, by the flag that sets each one: the
benchmark and a digest of its tasks, the checkpoint's digest, the generation and scoring
settings, the sandbox, and the code revision. A rerun compares what it would record with what
is there: equal, it resumes; different, it refuses and names each difference; with ``--fresh``,
it moves the old results into ``stale-<time>/`` inside the directory (nothing is deleted) and
starts afresh. Results without a ``provenance.json`` cannot be checked and are treated as
different; a ``provenance.json`` without results (a run that stopped before its first sample,
e.g. on a checkpoint without the chat template its ``--prompt-format`` needs) holds nothing to
protect and is replaced. One run at a time writes an output directory (`claimed`): a second one
started meanwhile is refused, since both would append to the same files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mtp.eval.data import Benchmark, DataError

from mtp.util.atomic import lock, rename, write_json

__all__ = ["PROVENANCE", "RESULTS", "check_or_record", "claimed", "code_revision", "path_digest",
           "tasks_digest"]

PROVENANCE = "provenance.json"
RESULTS = ("samples.jsonl", "completions.jsonl", "summary.json")


def _hash_file(path: Path, h) -> None:
    with open(path, "rb") as f:
        while chunk := f.read(1 << 23):
            h.update(chunk)


def path_digest(path: str | os.PathLike) -> str:
    """sha256 of a file, or of a directory's files (names and contents, in name order)."""
    path = Path(path)
    h = hashlib.sha256()
    if path.is_dir():
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            h.update(str(f.relative_to(path)).encode() + b"\0")
            _hash_file(f, h)
    else:
        _hash_file(path, h)
    return h.hexdigest()


def tasks_digest(benchmark: Benchmark) -> str:
    """sha256 of every task (prompt, tests, entry point, ...) and few-shot example."""
    tasks = [dataclasses.asdict(t) for t in [*benchmark.tasks, *benchmark.shots]]
    return hashlib.sha256(json.dumps(tasks, sort_keys=True, default=str).encode()).hexdigest()


def code_revision() -> str:
    """The git revision of the code (``-dirty`` with uncommitted changes), or its version."""
    from mtp.util.environment import git_state, versions

    rev, dirty = git_state(short=False)
    if rev != "unknown":
        return rev + ("-dirty" if dirty else "")
    found = versions("mtp")
    return f"mtp {found['mtp']}" if "mtp" in found else "unknown"


@contextmanager
def claimed(output_dir: str | os.PathLike) -> Iterator[Path]:
    """`output_dir` (created if need be) for this run alone while the block runs.

    Raises:
        DataError: If another run holds it, or it cannot be created.
    """
    out = Path(output_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(out, os.O_RDONLY)  # the lock is the directory's: no file of its own
    except OSError as err:  # a file where a folder of the path should be, no permission ...
        raise DataError(f"--output {out}: cannot create it ({err.strerror})") from None
    try:
        if not lock(fd, blocking=False):
            raise DataError(f"--output {out} is in use by another mtp eval running now; wait for "
                            "it to end, or choose another --output")
        yield out
    finally:
        os.close(fd)


def check_or_record(output_dir: str | os.PathLike, produced: dict, *, fresh: bool = False
                    ) -> Path | None:
    """Make sure the results in `output_dir` were produced by `produced`, then record it.

    Returns:
        Where earlier results were moved (with `fresh`), else None.

    Raises:
        DataError: If the directory holds results from other settings (each named by its flag)
            and `fresh` is false.
    """
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise DataError(f"--output {out} is a file; it must be a directory")
    record = out / PROVENANCE
    results = [out / name for name in RESULTS if (out / name).exists()]
    if record.is_file():
        try:
            old = json.loads(record.read_text())
        except ValueError as err:
            raise DataError(f"{record} is not valid JSON ({err}); pass --fresh to set the "
                            f"results beside it aside") from err
    else:
        old = None
    produced = json.loads(json.dumps(produced))  # as it reads back from the file
    moved = None
    if old == produced or not results:
        pass
    elif not fresh:
        if old is None:
            why = f"results ({', '.join(p.name for p in results)}) without a {PROVENANCE}"
        else:
            why = "results made with other settings: " + "; ".join(
                f"{k} (then {old.get(k)!r}, now {produced.get(k)!r})"
                for k in sorted(set(old) | set(produced)) if old.get(k) != produced.get(k))
        raise DataError(f"--output {out} holds {why}. Choose another --output, or pass --fresh "
                        f"to move them into {out}/stale-<time>/ and start afresh")
    else:
        moved = out / time.strftime("stale-%Y%m%d-%H%M%S")
        moved.mkdir()
        for p in [*results, *([record] if record.exists() else [])]:
            rename(p, moved / p.name)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # a file where a folder of the path should be, no permission ...
        raise DataError(f"--output {out}: cannot create it ({err.strerror})") from None
    if old != produced or moved is not None:  # unchanged: nothing to write (a full disk too)
        write_json(record, produced, indent=2, sort_keys=True,
                   what="the record of what made these results")
    return moved

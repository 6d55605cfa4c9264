"""How every benchmark reports: a fixed-width table on stdout and rows appended to a CSV.

Each CSV row carries what produced it: the benchmark's own settings (its columns), the exact
command line, and the environment (`mtp.util.environment.environment`: hardware, threads, versions,
git revision, time). A CSV is only ever appended to; rows with another set of columns start a
new file beside it, so an older run's rows are never rewritten or misread under new headers. A
run's rows are appended in one write (`mtp.util.atomic.AppendOnlyFile`): a full disk leaves the
file as it was, and says which file.
"""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path

from mtp.util.atomic import AppendOnlyFile
from mtp.util.environment import environment

__all__ = ["format_table", "publish", "write_csv"]


def _columns(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(k for row in rows for k in row))


def format_table(rows: list[dict], columns: list[str] | None = None) -> str:
    """A fixed-width text table of benchmark rows (columns: every key, in first-seen order)."""
    cols = columns or _columns(rows)

    def cell(value) -> str:
        if value is None:
            return "-"
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    table = [cols] + [[cell(row.get(c)) for c in cols] for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(cols))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(line, widths)) for line in table)


def publish(rows: list[dict], csv_path: str | os.PathLike, command: str,
            columns: list[str] | None = None) -> Path:
    """Print the environment line and the table of `rows` (`columns` of them, default all),
    then append the rows to `csv_path` (see `write_csv`)."""
    env = environment()
    print(", ".join(f"{k}={v}" for k, v in env.items()))
    print(format_table(rows, columns))
    return write_csv(rows, csv_path, command, env)


def write_csv(rows: list[dict], path: str | os.PathLike, command: str,
              env: dict[str, str] | None = None) -> Path:
    """Append `rows` to `path`, each with the `command` that made it and the environment
    columns; a new file beside it for another column set. Returns the file written."""
    env = env or environment()
    path = Path(path)
    fields = _columns(rows) + ["command", *env]
    if path.exists():
        with path.open(newline="") as f:
            if next(csv.reader(f), None) != fields:  # another column set: start a new file
                path = path.with_name(f"{path.stem}-{env['date'].replace(':', '')}{path.suffix}")
    with AppendOnlyFile(path, "the benchmark's rows") as f:
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, fieldnames=fields)
        if not f.size:
            writer.writeheader()
        for row in rows:
            writer.writerow({**row, "command": command, **env})
        f.append(text.getvalue())
    print(f"wrote {path}")
    return path

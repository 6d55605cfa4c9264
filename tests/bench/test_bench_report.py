"""mtp.bench.report: a benchmark's rows are appended to its CSV whole, or not at all; a CSV in a
folder that cannot be written is named before the benchmark runs."""

from __future__ import annotations

import csv

import pytest

from mtp.bench.report import write_csv
from mtp.cli import main
from mtp.util.errors import WriteError

ENV = {"hardware": "cpu", "date": "2026-01-01T00:00:00+00:00"}


def test_rows_are_appended_whole_and_a_full_disk_leaves_the_file_as_it_was(tmp_path,
                                                                            monkeypatch):
    from disk_helpers import failing_writes

    path = tmp_path / "decode.csv"
    write_csv([{"decoder": "greedy", "L": 1.0}], path, "mtp bench decode", ENV)
    before = path.read_bytes()
    failing_writes(monkeypatch, "decode.csv")
    with pytest.raises(WriteError, match=f"cannot write the benchmark's rows {path}: No space"):
        write_csv([{"decoder": "self-spec", "L": 2.0}] * 50, path, "mtp bench decode", ENV)
    assert path.read_bytes() == before
    monkeypatch.undo()
    write_csv([{"decoder": "self-spec", "L": 2.0}], path, "mtp bench decode", ENV)
    rows = list(csv.DictReader(path.open(newline="")))
    assert [r["decoder"] for r in rows] == ["greedy", "self-spec"]


def test_a_csv_that_cannot_be_written_is_refused_before_the_benchmark_runs(tmp_path, capsys):
    from disk_helpers import read_only_folder

    with read_only_folder(tmp_path / "ro") as ro:
        assert main(["bench", "loss", "--csv", str(ro / "loss.csv")]) == 2
        assert f"cannot write the folder of --csv {ro}: " in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "loss", "--csv", "/dev/null"])
    assert "--csv /dev/null is a character device" in capsys.readouterr().err

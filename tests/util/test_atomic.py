"""mtp.util.atomic: a write is whole or absent, durable once done, and the only rename there is."""

from __future__ import annotations

import os
import re

import pytest
from conftest import REPO as ROOT

from mtp.util import atomic


def _fsyncs(monkeypatch) -> list[str]:
    """Record what each os.fsync synced: 'dir' or 'file'."""
    seen, real = [], os.fsync

    def spy(fd):
        seen.append("dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "file")
        return real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return seen


@pytest.mark.parametrize("how", ["text", "file", "path"])
def test_a_write_lands_whole_with_file_and_folder_synced(tmp_path, monkeypatch, how):
    target = tmp_path / "sub" / "out.json"
    seen = _fsyncs(monkeypatch)
    if how == "text":
        atomic.write_json(target, {"a": 1})
    elif how == "file":
        with atomic.atomic_file(target, "w") as f:
            f.write('{"a": 1}\n')
    else:
        atomic.atomic_write(target, lambda tmp: tmp.write_text('{"a": 1}\n'))
    assert target.read_text() == '{"a": 1}\n'
    assert os.listdir(target.parent) == ["out.json"]  # no temporary file left
    assert seen == ["file", "dir"]  # the data before the rename, the rename after it


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), KeyboardInterrupt])
@pytest.mark.parametrize("how", ["file", "path"])
def test_a_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path, error, how):
    target = tmp_path / "out.json"
    target.write_text("old")

    def fail(write):
        write("half of the new")
        raise error

    with pytest.raises(type(error) if isinstance(error, BaseException) else error):
        if how == "file":
            with atomic.atomic_file(target, "w") as f:
                fail(f.write)
        else:
            atomic.atomic_write(target, lambda tmp: fail(tmp.write_text))
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["out.json"]


@pytest.mark.parametrize("how", ["file", "path"])
def test_a_written_file_has_the_mode_a_plain_write_gives(tmp_path, how):
    """Not mkstemp's owner-only 0600: others read a shared cache or results folder as before."""
    (tmp_path / "plain").write_text("x")
    target = tmp_path / "out"
    if how == "file":
        with atomic.atomic_file(target, "w") as f:
            f.write("x")
    else:
        atomic.atomic_write(target, lambda tmp: tmp.write_text("x"))
    assert target.stat().st_mode == (tmp_path / "plain").stat().st_mode


def test_rename_moves_a_folder_onto_an_empty_one(tmp_path):
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "x").write_text("1")
    (tmp_path / "dst").mkdir()
    atomic.rename(tmp_path / "new", tmp_path / "dst")
    assert (tmp_path / "dst" / "x").read_text() == "1" and not (tmp_path / "new").exists()


def test_every_rename_of_the_code_base_is_atomic_rename():
    """Writes that skip the helper lose its guarantees (fsync, cleanup): there is one rename."""
    found = []
    for folder in ("mtp", "kernels", "eval"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"\bos\.(replace|rename)\(|\.(rename|replace)\(\s*tmp\b", line):
                    found.append(f"{path.relative_to(ROOT)}:{i}")
    assert len(found) == 1 and found[0].startswith("mtp/util/atomic.py:"), found

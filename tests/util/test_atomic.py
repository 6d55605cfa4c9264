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


# -- write failures are named; appended lines stay whole --------------------------------------


def test_an_append_that_fills_the_disk_is_cut_back_and_named(tmp_path, monkeypatch):
    from disk_helpers import failing_writes

    path = tmp_path / "samples.jsonl"
    with atomic.AppendOnlyFile(path, "scored samples") as f:
        f.append('{"a": 1}\n')
    failed = failing_writes(monkeypatch, "samples.jsonl")
    with atomic.AppendOnlyFile(path, "scored samples") as f:
        with pytest.raises(atomic.WriteError) as err:
            f.append('{"b": 2, "long": "' + "x" * 1000 + '"}\n')
        assert str(err.value) == f"cannot write scored samples {path}: No space left on device"
        assert err.value.errno == 28 and failed  # half of it was written, then the disk was full
    assert path.read_text() == '{"a": 1}\n'  # cut back: the earlier line whole, no fragment
    monkeypatch.undo()  # room again: the next append lands after the last complete line
    with atomic.AppendOnlyFile(path, "scored samples") as f:
        f.append('{"c": 3}\n')
    assert path.read_text().splitlines() == ['{"a": 1}', '{"c": 3}']


def test_opening_an_append_only_file_cuts_a_torn_last_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"a": 1}\n{"b": 2}\n{"c": ' + b"x" * 70_000)  # torn, past one block
    with atomic.AppendOnlyFile(path, "rows") as f:
        assert (f.size, f.torn) == (18, 70_006)
        f.append("{}\n")
    assert path.read_bytes() == b'{"a": 1}\n{"b": 2}\n{}\n'
    with pytest.raises(ValueError, match="whole lines"):
        with atomic.AppendOnlyFile(path, "rows") as f:
            f.append("no newline")


def test_an_append_only_file_taken_exclusively_refuses_a_second_writer(tmp_path):
    path = tmp_path / "corpus.jsonl"
    with atomic.AppendOnlyFile(path, "corpus", exclusive=True):
        with pytest.raises(BlockingIOError):
            atomic.AppendOnlyFile(path, "corpus", exclusive=True)


@pytest.mark.parametrize("raised", [
    OSError(28, "No space left on device"),
    # torch.save into a Python file: a RuntimeError raised while handling the OSError
    "context",
    # safetensors and tokenizers (Rust) give the error only in their message
    Exception("Error while serializing: I/O error: No space left on device (os error 28)"),
], ids=["oserror", "torch", "rust"])
def test_writing_names_the_os_error_behind_any_exception(tmp_path, raised):
    def fail():
        if raised != "context":
            raise raised
        try:
            raise OSError(28, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] unexpected pos")  # noqa: B904

    with pytest.raises(atomic.WriteError) as err, atomic.writing(tmp_path / "x.ckpt",
                                                                "the checkpoint"):
        fail()
    assert str(err.value) == f"cannot write the checkpoint {tmp_path / 'x.ckpt'}: " \
                             "No space left on device"
    with pytest.raises(KeyError), atomic.writing(tmp_path / "x", "x"):
        raise KeyError("not a write failure: passed on unchanged")


def test_a_checkpoint_on_a_full_disk_keeps_the_old_one_and_is_named(tmp_path, monkeypatch):
    """torch.save writes through a Python file, so a full disk is an OSError, not torch's bare
    RuntimeError: `save_checkpoint` names it, and the old file stays."""
    from checkpoint_helpers import bpe_tokenizer
    from disk_helpers import failing_fsync

    from mtp.config import ModelConfig
    from mtp.model.checkpoint import load_checkpoint, save_checkpoint
    from mtp.model.transformer import MTPTransformer

    path = tmp_path / "m.ckpt"
    model = MTPTransformer(ModelConfig.from_name("debug", vocab_size=320))
    save_checkpoint(path, model, bpe_tokenizer())
    before = path.read_bytes()
    failing_fsync(monkeypatch, ".m.ckpt.")
    with pytest.raises(atomic.WriteError, match=f"cannot write the checkpoint {path}: No space"):
        save_checkpoint(path, model, bpe_tokenizer())
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["m.ckpt"]
    load_checkpoint(path)


def test_a_read_only_folder_is_named_before_anything_is_written(tmp_path):
    from disk_helpers import read_only_folder

    with read_only_folder(tmp_path / "ro") as folder:
        with pytest.raises(atomic.WriteError) as err:
            atomic.check_writable(folder / "runs", "the run's folder")
        assert str(err.value).startswith(f"cannot write the run's folder {folder / 'runs'}: ")
        assert err.value.errno in (13, 30)  # permission denied (a mode), read-only (a mount)
        with pytest.raises(atomic.WriteError, match="cannot write the summary"):
            atomic.write_json(folder / "summary.json", {}, what="the summary")


def test_a_real_full_disk_is_named_and_keeps_what_was_there(tmp_path):
    from disk_helpers import fill, small_disk

    with small_disk(tmp_path / "disk", "256k") as disk:
        (disk / "log.jsonl").write_text('{"a": 1}\n')
        fill(disk)
        with atomic.AppendOnlyFile(disk / "log.jsonl", "the log") as f:
            with pytest.raises(atomic.WriteError, match="No space left on device"):
                f.append('{"b": "' + "x" * 100_000 + '"}\n')
        assert (disk / "log.jsonl").read_text() == '{"a": 1}\n'
        with pytest.raises(atomic.WriteError, match=f"cannot write the summary {disk}/s.json"):
            atomic.write_json(disk / "s.json", {"x": "y" * 100_000}, what="the summary")
        assert sorted(os.listdir(disk)) == ["filler", "log.jsonl"]  # no temporary file left

"""mtp.util.paths: a path that is not a regular file is named for what it is."""

from __future__ import annotations

import os

import pytest

from mtp.util.paths import not_a_file


def test_each_kind_of_path_is_named_for_what_it_is(tmp_path):
    (tmp_path / "file.txt").write_text("x")
    os.mkfifo(tmp_path / "pipe")
    os.symlink("loop", tmp_path / "loop")
    os.symlink("nowhere", tmp_path / "dangling")
    os.symlink("file.txt", tmp_path / "link.txt")
    assert not_a_file(tmp_path / "file.txt") is None
    assert not_a_file(tmp_path / "link.txt") is None  # a link to a file is that file
    assert not_a_file(tmp_path / "pipe") == "is a named pipe"
    assert not_a_file("/dev/zero") == "is a character device"
    assert not_a_file(tmp_path) == "is a directory"
    assert not_a_file(tmp_path / "missing") == "does not exist"
    assert not_a_file(tmp_path / "loop") == "is a symbolic link in a loop"
    assert not_a_file(tmp_path / "dangling") == "is a symbolic link to nothing"
    assert not_a_file(tmp_path / "file.txt" / "x") == \
        "does not exist (a part of its path is a file)"


@pytest.mark.skipif(not os.path.exists("/dev/loop0") and not os.path.exists("/dev/sda"),
                    reason="no block device to name")
def test_a_block_device_is_named():
    device = "/dev/loop0" if os.path.exists("/dev/loop0") else "/dev/sda"
    assert not_a_file(device) == "is a block device"

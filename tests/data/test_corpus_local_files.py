"""Local corpora read as stated (`mtp.data.corpus`): each file of a glob or directory once,
through directory links (never followed) and a file's second name; a named pipe never a
document, not even one that replaced a file after listing; binary files skipped, named in a
warning."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mtp.config import DataConfig
from mtp.data.corpus import _local_files, load_corpus


def _corpus(root: Path, n: int = 12) -> Path:
    """`root/corpus` with `n` distinct small Python files, half of them in a subfolder."""
    corpus = root / "corpus"
    (corpus / "sub").mkdir(parents=True)
    for i in range(n):
        folder = corpus / "sub" if i % 2 else corpus
        (folder / f"f{i:02d}.py").write_text(f"def f{i}(x):\n    return x * {i} + {i * i}\n")
    return corpus


def test_glob_source_reads_each_file_once_through_directory_links(tmp_path):
    corpus = _corpus(tmp_path)
    plain = load_corpus(DataConfig(source=str(corpus / "**" / "*.py"), val_fraction=0.3))
    (corpus / "loop").symlink_to(".")  # glob.glob(recursive=True) walks loop/loop/... 40 deep
    (corpus / "sub" / "up").symlink_to("../../corpus")  # and this one without end
    (corpus / "alias.py").symlink_to("f00.py")  # a second name of one file

    # in bounded memory (first, in a child: unbounded, it would take this process down): a
    # child that may not grow past 2 GiB of address space lists them all
    code = (f"import resource; resource.setrlimit(resource.RLIMIT_AS, ({2**31}, {2**31}))\n"
            f"from mtp.data.corpus import _local_files\n"
            f"print(len(_local_files({str(corpus / '**' / '*.py')!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "12", out.stderr[-2000:]
    files = _local_files(str(corpus / "**" / "*.py"))
    assert len(files) == 12 and len({f.resolve() for f in files}) == 12
    assert all("loop" not in f.parts and "up" not in f.parts for f in files)
    assert corpus / "f00.py" in files, "the file keeps its own name, not the link's"

    linked = load_corpus(DataConfig(source=str(corpus / "**" / "*.py"), val_fraction=0.3))
    assert sorted(linked.train) == sorted(plain.train) and sorted(linked.val) == sorted(plain.val)
    assert not set(linked.train) & set(linked.val)
    # the directory form gives the same documents
    assert sorted(load_corpus(DataConfig(source=str(corpus), val_fraction=0.3)).train) == \
        sorted(plain.train)


@pytest.mark.parametrize("form", ["glob", "directory", "file"])
def test_a_named_pipe_is_never_a_document(tmp_path, form):
    corpus = _corpus(tmp_path)
    os.mkfifo(corpus / "pipe.py")
    source = {"glob": corpus / "*.py", "directory": corpus, "file": corpus / "pipe.py"}[form]
    if form == "file":
        with pytest.raises(FileNotFoundError, match="matches no .py"):
            load_corpus(DataConfig(source=str(source)))
        return
    assert corpus / "pipe.py" not in _local_files(str(source))
    # were it read, this would block for ever: the test's timeout is the proof
    corpus_docs = load_corpus(DataConfig(source=str(source), val_fraction=0.3))
    assert len(corpus_docs.train) + len(corpus_docs.val) == (6 if form == "glob" else 12)


def test_a_file_replaced_by_a_pipe_after_listing_is_skipped_not_waited_on(tmp_path, caplog):
    from mtp.data.corpus import _read_text

    path = tmp_path / "x.py"
    os.mkfifo(path)
    with caplog.at_level(logging.WARNING, logger="mtp.data.corpus"):
        assert _read_text(path) is None
    assert f"skipping {path}: not a regular file" in caplog.text


def test_binary_files_are_skipped_with_a_warning_naming_them(tmp_path, caplog):
    corpus = _corpus(tmp_path)
    (corpus / "zeros.py").write_bytes(b"\0" * 4096)
    (corpus / "sub" / "mixed.py").write_bytes(b"x = 1\n\0\0\0y = 2\n")
    with caplog.at_level(logging.WARNING, logger="mtp.data.corpus"):
        docs = load_corpus(DataConfig(source=str(corpus), val_fraction=0.3))
    assert docs.skipped == 2 and len(docs.train) + len(docs.val) == 12
    assert not any("\0" in d for d in docs.train + docs.val)
    for name in ("zeros.py", "mixed.py"):
        assert f"{name}: it holds NUL bytes, so it is binary" in caplog.text
    # a corpus of nothing else is an error that says why
    only = tmp_path / "only"
    only.mkdir()
    (only / "zeros.py").write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match=r"no non-empty documents \(1 files skipped as "
                                         r"unreadable, not UTF-8 or binary\)"):
        load_corpus(DataConfig(source=str(only)))

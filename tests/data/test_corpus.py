"""Sources and their documents: local files and tables, Hugging Face datasets, reading,
skipping and the train/validation split."""

import json

import pytest

from mtp.config import DataConfig
from mtp.data import MTPDataModule
from mtp.data.corpus import DocumentReader, load_corpus, source_specs


def test_unreadable_files_are_skipped_and_counted(tiny_corpus):
    corpus = load_corpus(DataConfig(source=str(tiny_corpus)))
    assert corpus.skipped == 1
    assert len(corpus.train) + len(corpus.val) == 60  # the empty file is dropped too
    assert corpus.val, "some files must land in validation"


def test_split_is_by_file_name_and_deterministic(tiny_corpus, tmp_path):
    a = load_corpus(DataConfig(source=str(tiny_corpus)))
    b = load_corpus(DataConfig(source=str(tiny_corpus / "*.py")))
    assert a.val == b.val and a.train == b.train
    # adding a file moves no other file between the splits
    extra = tmp_path / "more"
    extra.mkdir()
    for p in tiny_corpus.glob("*.py"):
        (extra / p.name).write_bytes(p.read_bytes())
    (extra / "new_file.py").write_text("print('hello')\n")
    c = load_corpus(DataConfig(source=str(extra)))
    assert set(a.val) <= set(c.val) and set(a.train) <= set(c.train)


def test_jsonl_source_reads_the_text_field(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"content": f"def f{i}(): return {i}\n"}) + "\n"
                            for i in range(50)))
    corpus = load_corpus(DataConfig(source=str(path), text_field="content"))
    assert len(corpus.train) + len(corpus.val) == 50
    with pytest.raises(ValueError, match="--data.text_field"):
        load_corpus(DataConfig(source=str(path), text_field="text"))


def test_sources_without_documents_are_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="--data.source"):
        load_corpus(DataConfig(source=str(tmp_path / "nothing" / "*.py")))
    (tmp_path / "a.py").write_text("   \n")
    with pytest.raises(ValueError, match="no non-empty documents"):
        load_corpus(DataConfig(source=str(tmp_path)))


def test_hub_sources_stream_rows_and_name_the_source_on_errors(tmp_path, monkeypatch):
    import datasets

    rows = datasets.Dataset.from_dict({"content": [f"def f{i}():\n    return {i}\n" * 8
                                                   for i in range(40)]})
    calls = []

    def load_dataset(name, config=None, split=None, streaming=False):
        calls.append((name, config, split, streaming))
        if name == "org/missing":
            raise FileNotFoundError("Dataset 'org/missing' doesn't exist on the Hub")
        return rows.to_iterable_dataset() if streaming else rows

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    cfg = DataConfig(source="org/code", text_field="content", streaming=True, max_documents=30)
    corpus = load_corpus(cfg)
    assert len(corpus.train) + len(corpus.val) == 30
    assert calls == [("org/code", None, "train", True)]
    # resuming skips the consumed rows without tokenising them again
    tail = list(DocumentReader(source_specs(cfg)[0], record=10, docs_read=10))
    assert [name for name, _ in tail] == [str(i) for i in range(10, 30)]
    with pytest.raises(ValueError, match=r"has no field 'text' \(--data\.text_field\)"):
        load_corpus(DataConfig(source="org/code"))
    mixture = DataConfig(cache_dir=str(tmp_path), tokenizer_train_bytes=1000, sources=[
        {"source": "org/code", "text_field": "content"}, {"source": "org/missing"}])
    with pytest.raises(FileNotFoundError,
                       match=r"--data\.sources\[1\]\.source 'org/missing' is no local file or "
                             r"directory, and as a Hugging Face dataset it could not be loaded"):
        MTPDataModule(mixture, vocab_size=300, n_future=2).prepare_data()

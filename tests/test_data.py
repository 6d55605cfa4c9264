"""Corpus reading and splitting, tokenizer, token shards and their cache, windows, sampler."""

import json

import numpy as np
import pytest
import torch

from mtp.checkpoint import EOT_TOKEN
from mtp.config import ConfigError, DataConfig
from mtp.data import (
    MTPDataModule,
    ResumableSampler,
    TokenWindows,
    load_corpus,
    train_tokenizer,
    unigram_entropy,
)


def _dm(corpus, tmp_path, **kw) -> MTPDataModule:
    cfg = DataConfig(source=str(corpus), cache_dir=str(tmp_path / "cache"), seq_len=16,
                     batch_size=4, val_fraction=0.1, **kw)
    dm = MTPDataModule(cfg, vocab_size=300, n_future=3)
    dm.prepare_data()
    dm.setup()
    return dm


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


def test_bad_data_configs_name_the_flag():
    with pytest.raises(ConfigError, match="--data.val_fraction"):
        DataConfig(val_fraction=1.5)
    with pytest.raises(ConfigError, match="--data.seq_len"):
        DataConfig(seq_len=0)


def test_tokenizer_round_trips_and_has_end_of_text():
    text = "def add(a, b):\n    return a + b\n" * 20
    tok = train_tokenizer([text], 300, 10_000)
    assert tok.token_to_id(EOT_TOKEN) == 0
    assert tok.decode(tok.encode(text).ids) == text
    assert tok.get_vocab_size() <= 300


def test_token_shards_are_cached_and_rebuilt_on_change(tiny_corpus, tmp_path):
    dm = _dm(tiny_corpus, tmp_path)
    shards = list((tmp_path / "cache" / "tokens").iterdir())
    assert len(shards) == 1
    meta = json.loads((shards[0] / "meta.json").read_text())
    assert meta["skipped_files"] == 1
    assert meta["train_tokens"] == len(dm.train_tokens)
    eot = dm.tokenizer.token_to_id(EOT_TOKEN)
    assert (np.asarray(dm.train_tokens) == eot).sum() == meta["documents"]["train"]
    # text round-trips through the shard
    first_doc = np.asarray(dm.train_tokens[:np.argmax(np.asarray(dm.train_tokens) == eot)])
    corpus = load_corpus(dm.cfg)
    assert dm.tokenizer.decode(first_doc.tolist()) == corpus.train[0]
    mtime = (shards[0] / "train.bin").stat().st_mtime_ns
    _dm(tiny_corpus, tmp_path)  # same corpus and tokenizer: reused, not rewritten
    assert (shards[0] / "train.bin").stat().st_mtime_ns == mtime
    (tiny_corpus / "zz_new.py").write_text("x = 1\n" * 100)
    try:
        _dm(tiny_corpus, tmp_path)  # changed corpus: new tokenizer and new shards
        assert len(list((tmp_path / "cache" / "tokens").iterdir())) == 2
    finally:
        (tiny_corpus / "zz_new.py").unlink()


def test_given_tokenizer_must_match_model_vocabulary(tiny_corpus, tmp_path):
    dm = _dm(tiny_corpus, tmp_path)
    path = tmp_path / "tok.json"
    dm.tokenizer.save(str(path))
    cfg = DataConfig(source=str(tiny_corpus), cache_dir=str(tmp_path / "cache"),
                     tokenizer=str(path))
    with pytest.raises(ValueError, match="--model.vocab_size"):
        MTPDataModule(cfg, vocab_size=dm.tokenizer.get_vocab_size() + 1, n_future=2)._prepare()
    with pytest.raises(FileNotFoundError, match="--data.tokenizer"):
        MTPDataModule(DataConfig(tokenizer=str(tmp_path / "missing.json")), vocab_size=300,
                      n_future=2)._prepare()


def test_windows_hold_seq_len_plus_k_tokens():
    tokens = np.arange(100, dtype=np.uint16)
    ds = TokenWindows(tokens, seq_len=10, n_future=4)
    assert len(ds) == (100 - 14) // 10 + 1
    assert ds[2].tolist() == list(range(20, 34))
    assert ds[len(ds) - 1][-1] < 100
    with pytest.raises(ValueError, match="--data.seq_len"):
        TokenWindows(tokens[:10], seq_len=10, n_future=4)


def test_sampler_is_seeded_resumable_and_sharded():
    def take(sampler, n):
        it = iter(sampler)
        return [next(it) for _ in range(n)]

    full = take(ResumableSampler(7, seed=3), 30)
    assert sorted(full[:7]) == list(range(7)) and sorted(full[7:14]) == list(range(7))
    assert full[:7] != full[7:14], "each epoch is reshuffled"
    assert take(ResumableSampler(7, seed=3, start=11), 19) == full[11:]
    assert take(ResumableSampler(7, seed=4), 7) != full[:7]
    ranks = [take(ResumableSampler(7, seed=3, start=4, rank=r, world_size=2), 8) for r in (0, 1)]
    assert [x for pair in zip(*ranks) for x in pair] == full[4:20]


def test_unigram_entropy():
    assert unigram_entropy(np.array([0, 1, 2, 3]), 8) == pytest.approx(np.log(4))
    assert unigram_entropy(np.array([5, 5, 5]), 8) == 0.0


def test_datamodule_batches(tiny_corpus, tmp_path):
    dm = _dm(tiny_corpus, tmp_path)
    batch = next(iter(dm.train_dataloader()))
    assert batch.shape == (4, 16 + 3) and batch.dtype == torch.long
    assert next(iter(dm.val_dataloader())).shape[1] == 19

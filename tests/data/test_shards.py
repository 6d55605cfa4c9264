"""Token shards: their cache, workers, crash safety, resume, and verification on loading."""

import hashlib
import json
import logging
import multiprocessing as mp
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from data_helpers import datamodule
from tokenizers import Tokenizer

import mtp.data.encoder_pool
import mtp.data.shards
from mtp.config import DataConfig
from mtp.data.bpe import tokenizer_sample, train_tokenizer
from mtp.data.corpus import load_corpus, source_specs
from mtp.data.shards import build_shards, load_shards
from mtp.model.checkpoint import EOT_TOKEN


def test_token_shards_are_cached_and_rebuilt_on_change(tiny_corpus, tmp_path):
    dm = datamodule(tiny_corpus, tmp_path)
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
    datamodule(tiny_corpus, tmp_path)  # same corpus and tokenizer: reused, not rewritten
    assert (shards[0] / "train.bin").stat().st_mtime_ns == mtime
    (tiny_corpus / "zz_new.py").write_text("x = 1\n" * 100)
    try:
        datamodule(tiny_corpus, tmp_path)  # changed corpus: new tokenizer and new shards
        assert len(list((tmp_path / "cache" / "tokens").iterdir())) == 2
    finally:
        (tiny_corpus / "zz_new.py").unlink()


def _spec_and_tokenizer(corpus, **kw):
    cfg = DataConfig(source=str(corpus), val_fraction=0.1, **kw)
    spec = source_specs(cfg)[0]
    return spec, train_tokenizer(tokenizer_sample([spec], 100_000), 300, 100_000)


def _shard_bytes(root):
    return {split: (root / f"{split}.bin").read_bytes() for split in ("train", "val")}


def test_shards_are_identical_for_any_worker_count(tiny_corpus, tmp_path, monkeypatch):
    # many batches, so the order of results matters
    monkeypatch.setattr(mtp.data.encoder_pool, "BATCH_DOCS", 3)
    spec, tok = _spec_and_tokenizer(tiny_corpus)
    metas = [build_shards(spec, tok, tmp_path / f"w{w}", workers=w) for w in (1, 2)]
    assert metas[0] == metas[1] and metas[0]["skipped_files"] == 1
    assert _shard_bytes(tmp_path / "w1") == _shard_bytes(tmp_path / "w2")
    # the shards hold exactly the documents `load_corpus` reads, in order
    corpus = load_corpus(DataConfig(source=str(tiny_corpus), val_fraction=0.1))
    eot = tok.token_to_id(EOT_TOKEN)
    expected = [ids for text in corpus.train for ids in (*tok.encode(text).ids, eot)]
    assert np.fromfile(tmp_path / "w1" / "train.bin", np.uint16).tolist() == expected
    assert metas[0]["sha256"]["train"] == hashlib.sha256(_shard_bytes(tmp_path / "w1")[
        "train"]).hexdigest()


def _build_slowly_then_exit(spec, tok_json, root):
    """Runs in a forked child: small batches and checkpoints, and a pause per document, so the
    parent can kill it midway."""
    mtp.data.encoder_pool.BATCH_DOCS, mtp.data.shards.CHECKPOINT_DOCS = 2, 4
    write = mtp.data.shards._ShardWriter.write

    def slow_write(self, split, ids):
        time.sleep(0.02)
        write(self, split, ids)

    mtp.data.shards._ShardWriter.write = slow_write
    build_shards(spec, Tokenizer.from_str(tok_json), root, workers=2)
    os._exit(0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork and /proc: Linux")
def test_killed_tokenisation_resumes_to_identical_shards(tiny_corpus, tmp_path, caplog):
    spec, tok = _spec_and_tokenizer(tiny_corpus)
    reference = build_shards(spec, tok, tmp_path / "ref", workers=1)
    root = tmp_path / "killed"
    child = mp.get_context("fork").Process(target=_build_slowly_then_exit,
                                           args=(spec, tok.to_str(), root))
    child.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # until the child has written its second checkpoint
        try:
            if sum(json.loads((root / "progress.json").read_text())["documents"].values()) >= 8:
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.01)
    workers = [int(p) for p in Path(f"/proc/{child.pid}/task/{child.pid}/children")
               .read_text().split()]
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    assert child.exitcode == -signal.SIGKILL and len(workers) == 2
    assert not (root / "meta.json").exists(), "the killed run must not look complete"
    with pytest.raises(FileNotFoundError):
        load_shards(root)
    while any(Path(f"/proc/{w}").exists() and "Z" not in Path(f"/proc/{w}/stat").read_text()
              .split()[2] for w in workers) and time.monotonic() < deadline:
        time.sleep(0.01)  # the workers die with their parent rather than block forever
    assert time.monotonic() < deadline, "tokeniser workers outlived the killed process"

    with caplog.at_level(logging.INFO, logger="mtp.data.shards"):
        resumed = build_shards(spec, tok, root, workers=2)
    assert "resuming" in caplog.text
    assert resumed == reference
    assert _shard_bytes(root) == _shard_bytes(tmp_path / "ref")
    assert not (root / "progress.json").exists()


def test_bytes_written_after_the_last_checkpoint_are_dropped(tiny_corpus, tmp_path,
                                                             monkeypatch):
    spec, tok = _spec_and_tokenizer(tiny_corpus)
    reference = build_shards(spec, tok, tmp_path / "ref", workers=2)
    monkeypatch.setattr(mtp.data.encoder_pool, "BATCH_DOCS", 2)
    monkeypatch.setattr(mtp.data.shards, "CHECKPOINT_DOCS", 4)
    write, calls = mtp.data.shards._ShardWriter.write, []

    def crash_after_15(self, split, ids):
        calls.append(split)
        if len(calls) > 15:  # 3 documents after the checkpoint at 12
            raise RuntimeError("simulated crash")
        write(self, split, ids)

    monkeypatch.setattr(mtp.data.shards._ShardWriter, "write", crash_after_15)
    root = tmp_path / "crashed"
    with pytest.raises(RuntimeError, match="simulated crash"):
        build_shards(spec, tok, root, workers=2)
    progress = json.loads((root / "progress.json").read_text())
    assert sum(progress["documents"].values()) == 12
    assert sum((root / f"{s}.bin.partial").stat().st_size for s in ("train", "val")) > \
        sum(progress["bytes"].values()), "the crash must leave bytes beyond the checkpoint"
    monkeypatch.setattr(mtp.data.shards._ShardWriter, "write", write)
    assert build_shards(spec, tok, root, workers=1) == reference
    assert _shard_bytes(root) == _shard_bytes(tmp_path / "ref")


def test_a_truncated_shard_is_an_error_naming_the_file(tiny_corpus, tmp_path):
    dm = datamodule(tiny_corpus, tmp_path)
    (shard,) = (tmp_path / "cache" / "tokens").iterdir()
    with open(shard / "train.bin", "r+b") as f:
        f.truncate(f.seek(0, os.SEEK_END) - 2)
    with pytest.raises(ValueError, match=r"train\.bin .*truncated or overwritten"):
        datamodule(tiny_corpus, tmp_path)
    assert len(dm.train_tokens) > 0


def test_a_shard_overwritten_in_place_is_an_error_naming_the_file(tiny_corpus, tmp_path):
    """Garbage of the right size (a crash inside the embedding before) fails the sha256 check,
    also after an earlier load recorded the file as verified."""
    datamodule(tiny_corpus, tmp_path)
    (shard,) = (tmp_path / "cache" / "tokens").iterdir()
    assert json.loads((shard / "verified.json").read_text())["train"][2] == \
        json.loads((shard / "meta.json").read_text())["sha256"]["train"]
    size = (shard / "train.bin").stat().st_size
    (shard / "train.bin").write_bytes(b"\xff" * size)
    with pytest.raises(ValueError, match=r"train\.bin does not match the sha256"):
        datamodule(tiny_corpus, tmp_path)


def test_max_tokens_bounds_the_training_split(tiny_corpus, tmp_path):
    full = datamodule(tiny_corpus, tmp_path)
    dm = datamodule(tiny_corpus, tmp_path, max_tokens=3000)
    assert len(dm.train_tokens) == 3000 and dm.stats["stopped_at_max_tokens"]
    assert np.array_equal(dm.train_tokens, full.train_tokens[:3000])
    # validation holds the held-out documents met on the way: a prefix of the full split
    assert 0 < len(dm.val_tokens) < len(full.val_tokens)
    assert np.array_equal(dm.val_tokens, full.val_tokens[:len(dm.val_tokens)])
    assert len(list((tmp_path / "cache" / "tokens").iterdir())) == 2, "max_tokens is keyed"


def test_tiny_corpus_holds_out_its_last_document(tmp_path):
    corpus = tmp_path / "two"
    corpus.mkdir()
    for name in ("a.py", "b.py"):  # with val_fraction 0.1, both land in train
        (corpus / name).write_text(f"# {name}\n" + "x = [i * i for i in range(10)]\n" * 20)
    spec, tok = _spec_and_tokenizer(corpus)
    meta = build_shards(spec, tok, tmp_path / "shard", workers=1)
    assert meta["documents"] == {"train": 1, "val": 1}
    val = np.fromfile(tmp_path / "shard" / "val.bin", np.uint16).tolist()
    assert tok.decode(val[:-1]) == (corpus / "b.py").read_text()


def test_a_full_disk_while_tokenising_is_named_and_the_rerun_builds_the_same_shard(
        tiny_corpus, tmp_path, monkeypatch):
    from disk_helpers import failing_fsync

    from mtp.util.errors import WriteError

    spec, tok = _spec_and_tokenizer(tiny_corpus)
    failing_fsync(monkeypatch, "train.bin.partial")
    with pytest.raises(WriteError) as err:
        build_shards(spec, tok, tmp_path / "a", workers=1)
    assert str(err.value) == f"cannot write a token shard {tmp_path / 'a' / 'train.bin.partial'}" \
                             ": No space left on device"
    assert not (tmp_path / "a" / "meta.json").exists()  # not trusted: rebuilt next time
    monkeypatch.undo()
    build_shards(spec, tok, tmp_path / "a", workers=1)
    build_shards(spec, tok, tmp_path / "b", workers=1)
    assert _shard_bytes(tmp_path / "a") == _shard_bytes(tmp_path / "b")

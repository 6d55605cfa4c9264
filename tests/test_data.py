"""Corpus reading and splitting, tokenizer, token shards (workers, crash safety, resume), their
cache, windows, samplers, mixtures, and the tokenisation benchmark."""

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
import torch
from tokenizers import Tokenizer

from mtp import data
from mtp.checkpoint import EOT_TOKEN
from mtp.config import ConfigError, DataConfig
from mtp.data import (
    MixtureSampler,
    MTPDataModule,
    ResumableSampler,
    SourceSpec,
    TokenWindows,
    build_shards,
    load_corpus,
    load_shards,
    source_specs,
    tokenizer_sample,
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


def test_given_tokenizer_must_fit_model_vocabulary(tiny_corpus, tmp_path):
    dm = _dm(tiny_corpus, tmp_path)
    path = tmp_path / "tok.json"
    dm.tokenizer.save(str(path))
    cfg = DataConfig(source=str(tiny_corpus), cache_dir=str(tmp_path / "cache"),
                     tokenizer=str(path))
    n = dm.tokenizer.get_vocab_size()
    with pytest.raises(ValueError, match="--model.vocab_size"):
        MTPDataModule(cfg, vocab_size=n - 1, n_future=2)._prepare()
    # fewer tokens than embedding rows is fine: pretrained models pad their embeddings
    MTPDataModule(cfg, vocab_size=n + 64, n_future=2)._prepare()
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


# -- streamed shards: workers, crash safety, resume, verification ------------------------------


def _spec_and_tokenizer(corpus, **kw):
    cfg = DataConfig(source=str(corpus), val_fraction=0.1, **kw)
    spec = source_specs(cfg)[0]
    return spec, train_tokenizer(tokenizer_sample([spec], 100_000), 300, 100_000)


def _shard_bytes(root):
    return {split: (root / f"{split}.bin").read_bytes() for split in ("train", "val")}


def test_shards_are_identical_for_any_worker_count(tiny_corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(data, "BATCH_DOCS", 3)  # many batches, so the order of results matters
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
    data.BATCH_DOCS, data.CHECKPOINT_DOCS = 2, 4
    write = data._ShardWriter.write

    def slow_write(self, split, ids):
        time.sleep(0.02)
        write(self, split, ids)

    data._ShardWriter.write = slow_write
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

    with caplog.at_level(logging.INFO, logger="mtp.data"):
        resumed = build_shards(spec, tok, root, workers=2)
    assert "resuming" in caplog.text
    assert resumed == reference
    assert _shard_bytes(root) == _shard_bytes(tmp_path / "ref")
    assert not (root / "progress.json").exists()


def test_bytes_written_after_the_last_checkpoint_are_dropped(tiny_corpus, tmp_path,
                                                             monkeypatch):
    spec, tok = _spec_and_tokenizer(tiny_corpus)
    reference = build_shards(spec, tok, tmp_path / "ref", workers=2)
    monkeypatch.setattr(data, "BATCH_DOCS", 2)
    monkeypatch.setattr(data, "CHECKPOINT_DOCS", 4)
    write, calls = data._ShardWriter.write, []

    def crash_after_15(self, split, ids):
        calls.append(split)
        if len(calls) > 15:  # 3 documents after the checkpoint at 12
            raise RuntimeError("simulated crash")
        write(self, split, ids)

    monkeypatch.setattr(data._ShardWriter, "write", crash_after_15)
    root = tmp_path / "crashed"
    with pytest.raises(RuntimeError, match="simulated crash"):
        build_shards(spec, tok, root, workers=2)
    progress = json.loads((root / "progress.json").read_text())
    assert sum(progress["documents"].values()) == 12
    assert sum((root / f"{s}.bin.partial").stat().st_size for s in ("train", "val")) > \
        sum(progress["bytes"].values()), "the crash must leave bytes beyond the checkpoint"
    monkeypatch.setattr(data._ShardWriter, "write", write)
    assert build_shards(spec, tok, root, workers=1) == reference
    assert _shard_bytes(root) == _shard_bytes(tmp_path / "ref")


def test_a_truncated_shard_is_an_error_naming_the_file(tiny_corpus, tmp_path):
    dm = _dm(tiny_corpus, tmp_path)
    (shard,) = (tmp_path / "cache" / "tokens").iterdir()
    with open(shard / "train.bin", "r+b") as f:
        f.truncate(f.seek(0, os.SEEK_END) - 2)
    with pytest.raises(ValueError, match=r"train\.bin .*truncated or overwritten"):
        _dm(tiny_corpus, tmp_path)
    assert len(dm.train_tokens) > 0


def test_a_shard_overwritten_in_place_is_an_error_naming_the_file(tiny_corpus, tmp_path):
    """Garbage of the right size (a crash inside the embedding before) fails the sha256 check,
    also after an earlier load recorded the file as verified."""
    _dm(tiny_corpus, tmp_path)
    (shard,) = (tmp_path / "cache" / "tokens").iterdir()
    assert json.loads((shard / "verified.json").read_text())["train"][2] == \
        json.loads((shard / "meta.json").read_text())["sha256"]["train"]
    size = (shard / "train.bin").stat().st_size
    (shard / "train.bin").write_bytes(b"\xff" * size)
    with pytest.raises(ValueError, match=r"train\.bin does not match the sha256"):
        _dm(tiny_corpus, tmp_path)


def test_max_tokens_bounds_the_training_split(tiny_corpus, tmp_path):
    full = _dm(tiny_corpus, tmp_path)
    dm = _dm(tiny_corpus, tmp_path, max_tokens=3000)
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


# -- mixtures -----------------------------------------------------------------------------------


def _take(sampler, n):
    it = iter(sampler)
    return [next(it) for _ in range(n)]


def test_mixture_sampler_is_seeded_resumable_and_sharded():
    sizes, weights = [7, 30], [2.0, 1.0]
    full = _take(MixtureSampler(sizes, weights, seed=3), 9000)  # crosses two chunks
    assert _take(MixtureSampler(sizes, weights, seed=3, start=4100), 200) == full[4100:4300]
    assert _take(MixtureSampler(sizes, weights, seed=4), 50) != full[:50]
    ranks = [_take(MixtureSampler(sizes, weights, seed=3, start=5, rank=r, world_size=2), 40)
             for r in (0, 1)]
    assert [x for pair in zip(*ranks) for x in pair] == full[5:85]
    # each source's windows come in shuffled epochs: its first n draws are a permutation
    first = [i for i in full if i < 7][:7]
    assert sorted(first) == list(range(7))
    second = [i - 7 for i in full if i >= 7][:30]
    assert sorted(second) == list(range(30))


def _jsonl(path, n, word):
    path.write_text("".join(json.dumps({"content": f"{word} {i} " * 40}) + "\n"
                            for i in range(n)))
    return path


def test_mixture_draws_windows_in_proportion_to_weights(tiny_corpus, tmp_path):
    prose = _jsonl(tmp_path / "prose.jsonl", 80, "lorem ipsum dolor")
    sources = [{"source": str(tiny_corpus), "weight": 1},
               {"source": str(prose), "weight": 3, "text_field": "content"}]
    dm = _dm("stdlib", tmp_path, sources=sources)
    assert [m["weight"] for m in dm.stats["mixture"]] == [1, 3]
    assert dm.stats["train_tokens"] == sum(len(t) for t in dm.train_shards)
    assert len(dm.val_tokens) == sum(len(v) for v in dm.val_shards)
    assert len(list((tmp_path / "cache" / "tokens").iterdir())) == 2, "one shard per source"
    n0 = len(dm.train_parts[0])
    draws = _take(dm.train_dataloader().sampler, 4000)
    from_code = sum(i < n0 for i in draws)
    # binomial(4000, 1/4): a 4-sigma bound
    assert abs(from_code - 1000) <= 4 * (4000 * 0.25 * 0.75) ** 0.5, from_code
    window = dm.train_set[draws[0]]
    part, offset = (0, draws[0]) if draws[0] < n0 else (1, draws[0] - n0)
    assert torch.equal(window, dm.train_parts[part][offset])
    batch = next(iter(dm.train_dataloader()))
    assert batch.shape == (4, 16 + 3)
    assert next(iter(dm.val_dataloader())).shape[1] == 19


def test_bad_mixtures_name_the_entry(tiny_corpus, tmp_path):
    ok = {"source": str(tiny_corpus)}
    with pytest.raises(ConfigError, match=r"--data\.sources\[1\]\.weight must be > 0"):
        DataConfig(sources=[ok, {"source": "x", "weight": 0}])
    with pytest.raises(ConfigError, match=r"--data\.sources\[0\] has unknown keys \['wieght'\]"):
        DataConfig(sources=[{"source": "x", "wieght": 2}])
    with pytest.raises(ConfigError, match=r"--data\.source .* and --data\.sources are both set"):
        DataConfig(source=str(tiny_corpus), sources=[ok])
    with pytest.raises(ConfigError, match=r"--data\.sources\[0\]\.max_tokens has the wrong type"):
        DataConfig(sources=[{"source": "x", "max_tokens": "many"}])
    missing = str(tmp_path / "nowhere" / "*.py")
    cfg = DataConfig(sources=[ok, {"source": missing}], cache_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"--data\.sources\[1\]\.source .*nowhere"):
        MTPDataModule(cfg, vocab_size=300, n_future=2).prepare_data()


def test_mixture_flag_parses_from_the_command_line_and_yaml(tmp_path):
    from lightning.pytorch.cli import LightningArgumentParser

    from mtp.fit_cli import add_run_arguments, run_config

    parser = LightningArgumentParser(allow_abbrev=False)
    add_run_arguments(parser)
    ns = parser.parse_args(["--data.sources", "[{source: a/*.py, weight: 2}, {source: b.jsonl, "
                            "text_field: content, max_tokens: 1000}]", "--data.max_tokens", "5",
                            "--data.tokenize_workers", "2"])
    data_cfg = run_config(ns).data
    assert data_cfg.sources[1] == {"source": "b.jsonl", "text_field": "content",
                                   "max_tokens": 1000}
    assert data_cfg.max_tokens == 5 and data_cfg.tokenize_workers == 2
    specs = [SourceSpec(**{**s, "index": i}) for i, s in enumerate(data_cfg.sources)]
    assert specs[0].flag("weight") == "--data.sources[0].weight"
    yaml_ns = parser.parse_object({"data": {"sources": [{"source": "a", "weight": 0.5}]}})
    assert run_config(yaml_ns).data.sources == [{"source": "a", "weight": 0.5}]


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
    tail = list(data._Reader(source_specs(cfg)[0], record=10, docs_read=10))
    assert [name for name, _ in tail] == [str(i) for i in range(10, 30)]
    with pytest.raises(ValueError, match=r"has no field 'text' \(--data\.text_field\)"):
        load_corpus(DataConfig(source="org/code"))
    mixture = DataConfig(cache_dir=str(tmp_path), tokenizer_train_bytes=1000, sources=[
        {"source": "org/code", "text_field": "content"}, {"source": "org/missing"}])
    with pytest.raises(FileNotFoundError,
                       match=r"--data\.sources\[1\]\.source 'org/missing' is no local file or "
                             r"directory, and as a Hugging Face dataset it could not be loaded"):
        MTPDataModule(mixture, vocab_size=300, n_future=2).prepare_data()

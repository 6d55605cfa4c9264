"""Nothing wrong without a word (issue 29): inputs that used to give a wrong result with exit 0
are refused naming what is wrong, or handled as stated: symlinked and piped corpora, binary
documents, duplicate YAML keys, the data position of a resume with another batch size, and the
"also" list of small cases."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from mtp.cli import main
from mtp.config import DataConfig, LossConfig, ModelConfig, OptimConfig
from mtp.data import MTPDataModule, ResumableSampler
from mtp.data.corpus import _local_files, load_corpus
from mtp.train.module import MTPModule, TokenizerInCheckpoint
from mtp.util.errors import InputError
from mtp.util.yaml_file import read_yaml_mapping

TINY = ModelConfig(vocab_size=300, d_model=16, n_layers=1, n_attn_heads=2, n_future=2,
                   max_seq_len=16)


def _corpus(root: Path, n: int = 12) -> Path:
    """`root/corpus` with `n` distinct small Python files, half of them in a subfolder."""
    corpus = root / "corpus"
    (corpus / "sub").mkdir(parents=True)
    for i in range(n):
        folder = corpus / "sub" if i % 2 else corpus
        (folder / f"f{i:02d}.py").write_text(f"def f{i}(x):\n    return x * {i} + {i * i}\n")
    return corpus


# -- corpora: links, pipes, binary files ---------------------------------------------------------


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


# -- duplicate YAML keys -------------------------------------------------------------------------


def test_duplicate_yaml_keys_are_refused_naming_file_line_and_key(tmp_path, capsys):
    cfg = tmp_path / "dup.yaml"
    cfg.write_text("trainer:\n  val_check_interval: 3\n"
                   "model:\n  n_future: 2\n  d_model: 64\n  n_future: 4\n"
                   "trainer:\n  val_check_interval: 100\n")
    with pytest.raises(InputError) as err:
        read_yaml_mapping(cfg, f"--config {cfg}")
    assert str(err.value).splitlines() == [
        f"--config {cfg}: duplicate keys (YAML would keep only the last, silently):",
        "  line 6: key 'n_future' again (first on line 4)",
        "  line 7: key 'trainer' again (first on line 1)"]
    # through the CLI: exit 2 before anything else happens
    assert main(["fit", "--config", str(cfg), "--data.cache_dir", "/nonexistent/cache"]) == 2
    assert "line 7: key 'trainer' again (first on line 1)" in capsys.readouterr().err


def test_yaml_merge_keys_and_repeated_keys_in_other_mappings_are_fine(tmp_path):
    cfg = tmp_path / "ok.yaml"
    cfg.write_text("base: &b {n_future: 2, d_model: 64}\n"
                   "model:\n  <<: *b\n  n_future: 4\n"
                   "data:\n  n_future: 1\n")
    data = read_yaml_mapping(cfg, "x")
    assert data["model"] == {"n_future": 4, "d_model": 64} and data["data"] == {"n_future": 1}
    flow = tmp_path / "flow.yaml"
    flow.write_text("model: {n_future: 2, n_future: 3}\n")
    with pytest.raises(InputError, match=r"line 1: key 'n_future' again \(first on line 1\)"):
        read_yaml_mapping(flow, "x")


# -- the data position of a resume ---------------------------------------------------------------


class _Windows(L.Callback):
    def __init__(self) -> None:
        self.batches = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.batches.append(batch.clone())


def _fit(corpus: Path, cache: Path, batch_size: int, max_steps: int, *, ckpt_path=None,
         save_to=None, accumulate: int = 1) -> tuple[list[torch.Tensor], MTPDataModule]:
    data = DataConfig(source=str(corpus), cache_dir=str(cache), seq_len=8, batch_size=batch_size,
                      val_fraction=0.1, tokenizer_train_bytes=20_000)
    dm = MTPDataModule(data, vocab_size=TINY.vocab_size, n_future=TINY.n_future)
    rec = _Windows()
    trainer = L.Trainer(max_steps=max_steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[rec, TokenizerInCheckpoint(dm)], use_distributed_sampler=False,
                        limit_val_batches=0, accumulate_grad_batches=accumulate)
    trainer.fit(MTPModule(TINY, OptimConfig(), LossConfig()), datamodule=dm, ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return rec.batches, dm


def test_a_resume_with_another_batch_size_continues_where_the_data_stopped(tiny_corpus,
                                                                           tmp_path):
    cache = tmp_path / "cache"
    a, b = tmp_path / "a.ckpt", tmp_path / "b.ckpt"
    first, dm = _fit(tiny_corpus, cache, 8, 2, save_to=a)  # windows 0..15 of the stream
    second, _ = _fit(tiny_corpus, cache, 16, 4, ckpt_path=a, save_to=b)  # 16..47
    # global_step x batch size would say 4 x 16 = 64
    assert torch.load(b, weights_only=True)["MTPDataModule"]["samples_consumed"] == 48
    third, _ = _fit(tiny_corpus, cache, 16, 5, ckpt_path=b)  # 48..63
    stream = iter(ResumableSampler(len(dm.train_set), dm.cfg.seed))
    drawn = [next(stream) for _ in range(64)]
    want = torch.stack([dm.train_set[i] for i in drawn])
    assert [len(x) for x in first + second + third] == [8, 8, 16, 16, 16]
    assert torch.equal(torch.cat(first + second + third), want)


def test_accumulated_batches_count_as_drawn(tiny_corpus, tmp_path):
    ckpt = tmp_path / "a.ckpt"
    batches, dm = _fit(tiny_corpus, tmp_path / "cache", 4, 3, save_to=ckpt, accumulate=2)
    assert len(batches) == 6 and dm.samples_consumed == 24
    assert torch.load(ckpt, weights_only=True)["MTPDataModule"]["samples_consumed"] == 24


# -- the "also" list -----------------------------------------------------------------------------


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from mtp.model.checkpoint import EOT_TOKEN

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[EOT_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def add(a, b):\n    return a + b\n"] * 10, trainer)
    return tok


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """An untrained debug checkpoint with a 32-token context length."""
    from mtp.model.checkpoint import save_checkpoint
    from mtp.model.transformer import MTPTransformer

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("ckpt") / "tiny.ckpt"
    cfg = ModelConfig.from_name("debug", vocab_size=320, n_future=2, max_seq_len=32)
    save_checkpoint(path, MTPTransformer(cfg), _tokenizer())
    return path


def _completions(path: Path) -> Path:
    from mtp.eval.data import load_benchmark

    task = load_benchmark("humaneval").tasks[0]
    path.write_bytes(b'{"task_id": "%s", "completion": "    return 1\\n"}\n' %
                     task.task_id.encode() + b'{"task_id": "HumanEval/0", "completion": "\xff"}\n')
    return path


def test_eval_output_that_is_a_file_is_refused_naming_it(tmp_path, capsys):
    from mtp.eval.cli import main as eval_main

    comp = tmp_path / "c.jsonl"
    comp.write_text('{"task_id": "HumanEval/0", "completion": "    return 1\\n"}\n')
    out = tmp_path / "out"
    out.write_text("not a folder\n")
    assert eval_main(["humaneval", "--completions", str(comp), "--limit", "1",
                      "--output", str(out)]) == 2
    assert f"--output {out} is a file; it must be a directory" in capsys.readouterr().err
    assert out.read_text() == "not a folder\n"
    below = out / "results"  # a file where a folder of the path should be
    from mtp.eval.data import DataError
    from mtp.eval.provenance import check_or_record

    with pytest.raises(DataError, match=rf"--output {below}: cannot create it"):
        check_or_record(below, {"x": 1})


def test_a_completions_line_that_is_not_utf8_names_file_and_line(tmp_path, capsys):
    from mtp.eval.cli import main as eval_main

    comp = _completions(tmp_path / "c.jsonl")
    assert eval_main(["humaneval", "--completions", str(comp)]) == 2
    assert f"{comp}:2: not UTF-8 (byte 43 of the line is 0xff)" in capsys.readouterr().err


def test_eval_and_generate_refuse_a_folder_that_is_no_export(tmp_path, capsys):
    from mtp.model.checkpoint import load_checkpoint

    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["eval", "humaneval", "--ckpt", str(empty), "--limit", "1"]) == 2
    err = capsys.readouterr().err
    assert f"--ckpt {empty} is a directory but not an mtp export" in err
    assert "Traceback" not in err
    with pytest.raises(InputError, match=rf"{empty} is not an mtp export"):
        load_checkpoint(empty)
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--ckpt", str(empty), "--prompt", "x"])
    assert exit_.value.code == 2 and f"{empty} is not an mtp export" in capsys.readouterr().err


def test_fit_ckpt_path_on_an_export_says_what_it_is(ckpt, tmp_path, capsys):
    export = tmp_path / "export"
    assert main(["export", "hf", "--ckpt", str(ckpt), "--output", str(export)]) == 0
    capsys.readouterr()
    assert main(["fit", "--ckpt_path", str(export), "--data.cache_dir", "/nonexistent/cache"]) == 2
    err = capsys.readouterr().err
    assert f"--ckpt_path: {export} is an export directory (`mtp export hf`)" in err
    assert "does not exist" not in err
    assert main(["fit", "--ckpt_path", str(tmp_path), "--data.cache_dir", "/nonexistent/c"]) == 2
    assert f"--ckpt_path: {tmp_path} is a directory, neither a checkpoint file nor an mtp " \
           f"export" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--trainer.max_steps", "-1"], "--trainer.max_steps -1 (no limit) leaves the cosine "
                                    "learning-rate schedule without a length"),
    (["--trainer.max_steps", "0"], "--trainer.max_steps 0 trains no step"),
    (["--trainer.max_steps", "-5"], "--trainer.max_steps must be >= 1, or -1 for no limit "
                                    "(got -5)"),
])
def test_max_steps_without_a_length_is_refused_before_the_data(args, message, capsys):
    # the cache folder cannot exist: the error comes before any data is read
    assert main(["fit", *args, "--data.cache_dir", "/nonexistent/cache"]) == 2
    assert message in capsys.readouterr().err


def test_max_steps_minus_one_with_decay_steps_passes_the_check():
    from mtp.train.cli import _check_max_steps

    _check_max_steps(-1, OptimConfig(decay_steps=100))  # trains until stopped
    with pytest.raises(ValueError, match="--optim.decay_steps N"):
        _check_max_steps(-1, OptimConfig())


def test_bench_decode_records_the_batch_size_it_ran(ckpt, tmp_path):
    import csv
    import json

    import mtp.bench

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n"
                               for p in ["def add(a, b):", "x = 1", "y = 2", "z = 3"]))
    out = tmp_path / "bench.csv"
    assert mtp.bench.main(["decode", "--ckpt", str(ckpt), "--prompts", str(prompts), "--limit",
                           "2", "--batch-size", "8", "--max-new-tokens", "4", "--decoders",
                           "greedy", "--repeat", "1", "--csv", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert rows and all(r["batch_size"] == "2" for r in rows)


def test_generate_says_when_the_context_window_stopped_it(ckpt, capsys):
    assert main(["generate", "--ckpt", str(ckpt), "--prompt", "def add(a, b):",
                 "--max-new-tokens", "100", "--compare", "none"]) == 0
    err = capsys.readouterr().err
    assert "note: stopped at the context length (--model.max_seq_len 32): " in err
    assert "of --max-new-tokens 100 new tokens" in err


def test_eval_says_how_many_prompts_were_cut_and_rows_stopped_at_the_window(ckpt, tmp_path,
                                                                         capsys):
    from mtp.eval.completer import load_completer

    completer = load_completer(str(ckpt), decoder="greedy")
    long_prompt = "def add(a, b):\n    return a + b\n" * 8  # far more than 32 tokens
    texts = completer.complete([long_prompt, "x"], max_new_tokens=20, temperature=0.0,
                               top_p=1.0, stop=[], seed=0)
    assert len(texts) == 2
    # room for the prompt: max(32 - 20, 32 // 2) = 16 tokens; the long prompt is cut to them
    assert (completer.rows, completer.prompts_cut) == (2, 1)
    assert completer.at_context_end == 1  # 16 + 20 > 32: stopped at the context length, "x" was not
    from mtp.eval.cli import main as eval_main

    assert eval_main(["humaneval", "--ckpt", str(ckpt), "--limit", "1", "--max-new-tokens",
                      "20", "--output", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert "mtp eval: note: 1 of 1 completions continue a prompt cut to its last tokens, to " \
           "fit the context length (--model.max_seq_len 32) with --max-new-tokens 20" in err


# -- checkpoint digests --------------------------------------------------------------------------


def _corrupt(path: Path, tensor: torch.Tensor) -> None:
    """XOR 256 bytes inside `tensor`'s stored bytes in the file; the zip directory stays intact."""
    raw = bytearray(path.read_bytes())
    start = raw.find(tensor.detach().contiguous().numpy().tobytes())
    assert start >= 0, "the tensor's bytes are stored as they are"
    for i in range(start + 64, start + 320):
        raw[i] ^= 0x5A
    path.write_bytes(bytes(raw))


def test_a_corrupted_tensor_in_a_checkpoint_is_refused_naming_file_and_tensor(ckpt, tmp_path):
    import shutil

    from mtp.model.checkpoint import load_checkpoint
    from mtp.util.digests import DIGESTS

    bad = tmp_path / "bad.ckpt"
    shutil.copy(ckpt, bad)
    model, _ = load_checkpoint(bad)
    _corrupt(bad, model.embed.weight)
    torch.load(bad, weights_only=True)  # torch itself reads it without a word
    with pytest.raises(InputError, match=rf"checkpoint {bad} is corrupted: tensor "
                                         r"model\.embed\.weight does not match the sha256"):
        load_checkpoint(bad)
    # a checkpoint written before the digests loads unchecked
    old = torch.load(ckpt, weights_only=True)
    del old["mtp"][DIGESTS]
    torch.save(old, tmp_path / "old.ckpt")
    assert torch.equal(load_checkpoint(tmp_path / "old.ckpt")[0].embed.weight, model.embed.weight)


def test_a_corrupted_tensor_in_an_export_is_refused_naming_file_and_tensor(ckpt, tmp_path):
    import json

    from safetensors.torch import load_file

    from mtp.interop.hf_export import export
    from mtp.model.checkpoint import MTP_CONFIG, MTP_HEADS, load_checkpoint, load_export
    from mtp.util.digests import DIGESTS
    from mtp.util.errors import ExportError

    model, tok = load_checkpoint(ckpt)
    out = export(model, tok, tmp_path / "hf")
    assert torch.equal(load_export(out)[0].heads[1].attn.qkv.weight,
                       model.heads[1].attn.qkv.weight)
    # Flipped bytes in a draft head: safetensors reads the file without a word.
    _corrupt(out / MTP_HEADS, model.heads[1].attn.qkv.weight)
    load_file(out / MTP_HEADS)
    with pytest.raises(ExportError, match=rf"{out / MTP_HEADS} is corrupted: tensor "
                                          r"heads\.1\.attn\.qkv\.weight does not match"):
        load_export(out)
    # An export written before the digests loads unchecked.
    meta = json.loads((out / MTP_CONFIG).read_text())
    del meta[DIGESTS]
    (out / MTP_CONFIG).write_text(json.dumps(meta))
    load_export(out)


def test_a_corrupted_training_checkpoint_is_refused_on_resume_and_load(tiny_corpus, tmp_path,
                                                                      capsys):
    from mtp.model.checkpoint import load_checkpoint

    path = tmp_path / "a.ckpt"
    _, dm = _fit(tiny_corpus, tmp_path / "cache", 4, 1, save_to=path)
    model, _ = load_checkpoint(path)  # the digests Lightning's checkpoint carries match
    _corrupt(path, dict(model.named_parameters())["heads.0.attn.qkv.weight"])
    with pytest.raises(InputError, match=rf"checkpoint {path} is corrupted: tensor "
                                         r"model\.heads\.0\.attn\.qkv\.weight does not match"):
        load_checkpoint(path)
    with pytest.raises(InputError, match=rf"checkpoint {path} is corrupted"):
        _fit(tiny_corpus, tmp_path / "cache", 4, 2, ckpt_path=path)
    # `mtp fit --ckpt_path`: before any data is read
    flags = [f"--model.{k}={getattr(TINY, k)}" for k in ("vocab_size", "d_model", "n_layers",
                                                         "n_attn_heads", "n_future", "max_seq_len")]
    assert main(["fit", *flags, "--data.seq_len", "8", "--ckpt_path", str(path),
                 "--data.cache_dir", "/nonexistent/cache"]) == 2
    assert f"--ckpt_path: checkpoint {path} is corrupted" in capsys.readouterr().err

"""Training through Lightning: resume, checkpoints, the `mtp fit` CLI, every shipped YAML."""

import json
import logging
import re
import subprocess
import sys

import lightning as L
import pytest
import torch
import yaml
from conftest import REPO
from lightning.pytorch.cli import LightningArgumentParser
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mtp.cli import main
from mtp.config import DataConfig, LossConfig, ModelConfig, OptimConfig
from mtp.data import MTPDataModule
from mtp.model.checkpoint import load_checkpoint
from mtp.train.cli import add_run_arguments, run_config
from mtp.train.module import MTPModule, TokenizerInCheckpoint, lr_factor

TINY = ModelConfig(vocab_size=300, d_model=32, n_layers=1, n_attn_heads=2, n_future=2,
                   max_seq_len=32)


class Record(L.Callback):
    """Loss, learning rate and first window of every training step."""

    def __init__(self) -> None:
        self.rows = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.rows.append((trainer.global_step, float(outputs["loss"]),
                          trainer.optimizers[0].param_groups[0]["lr"], batch[0, :4].tolist()))


def _fit(corpus, tmp_path, max_steps, *, ckpt_path=None, save_to=None, accumulate=1,
         model_cfg=TINY, tokenizer=None, optim=None):
    L.seed_everything(0)
    data = DataConfig(source=str(corpus), cache_dir=str(tmp_path / "cache"), seq_len=16,
                      batch_size=4, val_fraction=0.1, tokenizer=tokenizer)
    module = MTPModule(model_cfg, optim or OptimConfig(lr=1e-2, warmup_steps=2, decay_steps=10),
                       LossConfig())
    dm = MTPDataModule(data, vocab_size=model_cfg.vocab_size, n_future=model_cfg.n_future)
    rec = Record()
    trainer = L.Trainer(max_steps=max_steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[rec, TokenizerInCheckpoint(dm)],
                        use_distributed_sampler=False, limit_val_batches=0,
                        accumulate_grad_batches=accumulate, gradient_clip_val=1.0)
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return rec.rows


@pytest.mark.parametrize("accumulate", [1, 2])
def test_resume_continues_step_lr_data_and_loss(tiny_corpus, tmp_path, accumulate):
    full = _fit(tiny_corpus, tmp_path, 8, accumulate=accumulate)
    ckpt = tmp_path / "half.ckpt"
    first = _fit(tiny_corpus, tmp_path, 4, save_to=ckpt, accumulate=accumulate)
    second = _fit(tiny_corpus, tmp_path, 8, ckpt_path=ckpt, accumulate=accumulate)
    assert first == full[:len(first)]
    assert len(first) + len(second) == len(full)
    for a, b in zip(second, full[len(first):]):
        assert a[0] == b[0] and a[2] == pytest.approx(b[2], rel=1e-12) and a[3] == b[3]
        assert a[1] == pytest.approx(b[1], rel=1e-5), "loss after resume differs"


def test_resume_applies_changed_optimiser_settings(tiny_corpus, tmp_path, caplog):
    """A resume with another --optim.lr and weight decay trains as a run that had them from
    the start would at those steps; another --optim.train is refused, naming it."""
    ckpt = tmp_path / "half.ckpt"
    _fit(tiny_corpus, tmp_path, 4, save_to=ckpt)
    other = OptimConfig(lr=2e-2, weight_decay=0.05, warmup_steps=2, decay_steps=10)
    lightning_log = logging.getLogger("lightning.pytorch")
    lightning_log.addHandler(caplog.handler)  # Lightning's logger does not propagate
    try:
        with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
            resumed = _fit(tiny_corpus, tmp_path, 8, ckpt_path=ckpt, optim=other)
    finally:
        lightning_log.removeHandler(caplog.handler)
    # the learning rate a run with `other` from the start has after each of steps 5..8
    expected = [2e-2 * lr_factor(s, 2, 10, other.min_lr_ratio) for s in range(5, 9)]
    assert [r[2] for r in resumed] == pytest.approx(expected, rel=1e-12)
    assert "--optim.lr (checkpoint 0.01, now 0.02)" in caplog.text
    with pytest.raises(ValueError, match="--optim.train all, now heads"):
        _fit(tiny_corpus, tmp_path, 8, ckpt_path=ckpt, optim=OptimConfig(train="heads"))


def test_resume_with_another_tokenizer_is_refused(tiny_corpus, tmp_path):
    ckpt = tmp_path / "a.ckpt"
    _fit(tiny_corpus, tmp_path, 2, save_to=ckpt)
    other = tmp_path / "other.json"
    from mtp.data.bpe import train_tokenizer
    from mtp.data.corpus import load_corpus

    # same size, other merges: BPE trained on the corpus read backwards
    docs = load_corpus(DataConfig(source=str(tiny_corpus))).train
    tok = train_tokenizer([d[::-1] for d in docs], TINY.vocab_size, 10**6)
    assert tok.get_vocab_size() == TINY.vocab_size
    tok.save(str(other))
    with pytest.raises(ValueError, match="different tokenizer"):
        _fit(tiny_corpus, tmp_path, 4, ckpt_path=ckpt, tokenizer=str(other))


def test_checkpoint_carries_config_and_tokenizer(tiny_corpus, tmp_path):
    ckpt = tmp_path / "a.ckpt"
    _fit(tiny_corpus, tmp_path, 2, save_to=ckpt)
    model, tok = load_checkpoint(ckpt)  # weights_only=True: nothing but plain data inside
    assert model.cfg == TINY
    assert tok.decode(tok.encode("def f(x):\n    return x\n").ids) == "def f(x):\n    return x\n"
    raw = torch.load(ckpt, weights_only=True)
    small = ModelConfig(**{**TINY.__dict__, "vocab_size": 10})
    raw["mtp"]["model_config"] = small.__dict__
    raw["state_dict"]["model.embed.weight"] = raw["state_dict"]["model.embed.weight"][:10]
    raw["state_dict"]["model.unembed.weight"] = raw["state_dict"]["model.unembed.weight"][:10]
    torch.save(raw, tmp_path / "bad.ckpt")
    with pytest.raises(ValueError, match="vocab_size"):
        load_checkpoint(tmp_path / "bad.ckpt")


def test_lr_schedule_warms_up_then_decays_to_floor():
    f = [lr_factor(s, 10, 110, 0.1) for s in range(130)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[10:], f[11:]))
    assert f[110] == pytest.approx(0.1) and f[129] == pytest.approx(0.1)


def test_no_weight_decay_on_norms_and_embeddings():
    module = MTPModule(TINY, OptimConfig(), LossConfig())
    module.trainer = L.Trainer(max_steps=10, logger=False)
    groups = module.configure_optimizers()["optimizer"].param_groups
    no_decay = {id(p) for g in groups if g["weight_decay"] == 0.0 for p in g["params"]}
    assert any(g["weight_decay"] > 0 for g in groups)
    assert id(module.model.embed.weight) in no_decay
    assert id(module.model.norm.weight) in no_decay
    assert id(module.model.unembed.weight) not in no_decay


def _parser() -> LightningArgumentParser:
    parser = LightningArgumentParser(allow_abbrev=False)
    add_run_arguments(parser)
    return parser


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_every_shipped_config_loads_and_validates(path):
    ns = _parser().parse_object(yaml.safe_load(path.read_text()))
    run = run_config(ns)
    assert run.model.n_future >= 1 and run.data.seq_len <= run.model.max_seq_len


def test_default_config_file_spells_out_the_defaults():
    parser = _parser()
    from_file = parser.parse_object(yaml.safe_load((REPO / "configs" / "cpu.yaml").read_text()))
    assert run_config(from_file) == run_config(parser.parse_args([]))
    assert from_file.trainer == parser.parse_args([]).trainer


def test_misspelled_keys_are_rejected(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  n_futur: 2\n")
    with pytest.raises(SystemExit) as err:
        main(["fit", "--config", str(bad)])
    assert err.value.code != 0 and "n_futur" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["fit", "--model.n_futur", "2"])  # an abbreviation is not accepted either
    assert "n_futur" in capsys.readouterr().err


def test_invalid_values_name_every_flag(capsys):
    code = main(["fit", "--model.n_future", "0", "--data.seq_len", "512"])
    err = capsys.readouterr().err
    assert code == 2 and "--model.n_future must be >= 1 (got 0)" in err
    code = main(["fit", "--data.seq_len", "512"])
    assert code == 2 and "--data.seq_len (512) exceeds --model.max_seq_len (256)" in \
        capsys.readouterr().err
    code = main(["fit", "--model.vocab_size", "100", "--data.cache_dir", "/nonexistent/cache"])
    assert code == 2 and "--model.vocab_size (100) is below the 257 tokens" in \
        capsys.readouterr().err
    code = main(["fit", "--ckpt_path", "/nonexistent/last.ckpt",
                 "--data.cache_dir", "/nonexistent/cache"])  # checked before any data is read
    assert code == 2 and "--ckpt_path: checkpoint /nonexistent/last.ckpt does not exist" in \
        capsys.readouterr().err


def test_a_user_error_is_two_lines_and_debug_shows_the_traceback(tmp_path, capsys):
    from mtp.util.errors import MissingInput

    args = ["fit", "--config", str(REPO / "configs" / "debug.yaml"), "--data.source",
            str(tmp_path / "missing"), "--data.cache_dir", str(tmp_path / "cache")]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-2:] == [f"mtp fit: error: --data.source '{tmp_path / 'missing'}' matches no .py, "
                        f".txt, .jsonl or .parquet files", "(--debug shows where it was raised)"]
    assert not any("Traceback" in line for line in err)
    with pytest.raises(MissingInput):
        main([*args, "--debug"])


def test_a_ctrl_c_is_one_line_and_exit_status_130(monkeypatch, capsys):
    """Outside `mtp fit` (which keeps what it can, `mtp.train.fault`): no KeyboardInterrupt trace.
    """
    import mtp.decoding.cli

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(mtp.decoding.cli, "generate_main", interrupted)
    assert main(["generate", "--prompt", "x"]) == 130
    assert capsys.readouterr().err.strip() == "mtp generate: interrupted"
    with pytest.raises(KeyboardInterrupt):
        main(["generate", "--debug"])


def test_step_lines_show_the_heads_and_trunk_rates_where_they_differ():
    from mtp.train.log_lines import _rates

    same = [{"new": True, "lr": 1e-3}, {"new": False, "lr": 1e-3}]
    assert _rates(same) == "lr 1.00e-03"
    delayed = [{"new": False, "lr": 0.0}, {"new": True, "lr": 1e-3}, {"new": True, "lr": 1e-3}]
    assert _rates(delayed) == "lr heads 1.00e-03 trunk 0.00e+00"
    assert _rates([{"lr": 2e-4}]) == "lr 2.00e-04"  # groups of a run saved before the key


def test_mtp_fit_end_to_end(tiny_corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = main(["fit", "--config", str(REPO / "configs" / "debug.yaml"),
                 "--data.source", str(tiny_corpus), "--trainer.max_steps", "12",
                 "--trainer.val_check_interval", "6", "--trainer.enable_progress_bar", "false"])
    assert code == 0
    out = capsys.readouterr().out
    assert "head 1: loss" in out and "head 2: loss" in out and "sample (temperature 0.7" in out
    # no terminal: plain progress lines (mtp.train.log_lines), every log_every_n_steps and at the
    # end
    lines = out.splitlines()
    steps = [line for line in lines if re.match(r"step \d+/12  loss [\d.]+  heads [\d.]+ [\d.]+  "
                                                r"lr \S+  [\d,]+ tok/s  [\d.]+ s/step  left \S+$",
                                                line)]
    assert [s.split()[1] for s in steps] == ["5/12", "10/12", "12/12"], lines
    vals = [line for line in lines if line.startswith("validation at step ")]
    assert len(vals) == 2 and re.match(r"validation at step 6  next_token_loss [\d.]+  "
                                       r"sim_tokens_per_forward [\d.]+  ", vals[0])
    assert "loss_head2 " in vals[0] and "acc_head2 " in vals[0]
    run = tmp_path / "runs" / "mtp" / "version_0"
    assert (run / "config.yaml").is_file() and (run / "checkpoints" / "last.ckpt").is_file()
    assert yaml.safe_load((run / "config.yaml").read_text())["model"]["n_future"] == 2
    model, _ = load_checkpoint(run / "checkpoints" / "last.ckpt")
    assert model.cfg.n_future == 2
    events = EventAccumulator(str(run))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for name in ("val/loss_head1", "val/loss_head2", "train/loss_head2", "train/acc_head1",
                 "val/acc_head2", "val/sim_accept_draft1", "val/sim_tokens_per_forward"):
        assert name in tags, f"{name} missing from TensorBoard: {sorted(tags)}"
    assert any("items_per_sec" in t for t in tags), "tokens per second not logged"

    # resuming through the CLI continues from the checkpoint's step
    last = str(run / "checkpoints" / "last.ckpt")
    args = ["fit", "--config", str(REPO / "configs" / "debug.yaml"), "--data.source",
            str(tiny_corpus), "--trainer.val_check_interval", "6",
            "--trainer.enable_progress_bar", "false", "--ckpt_path", last]
    assert main([*args, "--trainer.max_steps", "14"]) == 0
    assert torch.load(tmp_path / "runs" / "mtp" / "version_1" / "checkpoints" / "last.ckpt",
                      weights_only=True)["global_step"] == 14
    capsys.readouterr()
    assert main([*args, "--trainer.max_steps", "16", "--model.d_model", "64"]) == 2
    assert "--model.d_model (checkpoint 32, now 64)" in capsys.readouterr().err


def test_mtp_fit_without_logger_or_checkpoints(tiny_corpus, tmp_path, monkeypatch, capsys):
    """`--trainer.logger false` and `--trainer.enable_checkpointing false` train and report;
    the callbacks that need a logger or write checkpoints are left out."""
    monkeypatch.chdir(tmp_path)
    code = main(["fit", "--config", str(REPO / "configs" / "debug.yaml"),
                 "--data.source", str(tiny_corpus), "--trainer.max_steps", "4",
                 "--trainer.val_check_interval", "4", "--trainer.enable_progress_bar", "false",
                 "--trainer.logger", "false", "--trainer.enable_checkpointing", "false"])
    assert code == 0
    out = capsys.readouterr().out
    assert "head 1: loss" in out and "checkpoints:" not in out and "TensorBoard" not in out
    assert not (tmp_path / "runs").exists() and not list(tmp_path.rglob("*.ckpt"))


@pytest.mark.slow
def test_training_learns_far_below_unigram_entropy(tiny_corpus, tmp_path):
    """A thousand steps of a small model: head-1 validation loss well under the unigram
    entropy (the loss of the best model that ignores context), for both loss strategies."""
    from mtp.data import unigram_entropy
    from mtp.train.loss import mtp_loss
    from mtp.train.targets import mtp_inputs_targets

    cfg = ModelConfig(vocab_size=512, d_model=64, n_layers=2, n_attn_heads=2, n_future=2,
                      max_seq_len=64)
    for strategy in ("sequential", "naive"):
        L.seed_everything(0)
        module = MTPModule(cfg, OptimConfig(lr=3e-3, warmup_steps=20), LossConfig(strategy))
        dm = MTPDataModule(DataConfig(source=str(tiny_corpus), cache_dir=str(tmp_path),
                                      seq_len=64, batch_size=16, val_fraction=0.1),
                           vocab_size=512, n_future=2)
        L.Trainer(max_steps=1000, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, limit_val_batches=0,
                  use_distributed_sampler=False).fit(module, datamodule=dm)
        module.model.eval()
        losses = torch.stack([mtp_loss(module.model, *mtp_inputs_targets(b, 2),
                                       path="metrics").head_losses
                              for b in dm.val_dataloader()]).mean(0)
        entropy = unigram_entropy(dm.val_tokens, dm.tokenizer.get_vocab_size())
        assert losses[0] < 0.75 * entropy, (strategy, float(losses[0]), entropy)
        assert losses[1] < entropy


def test_train_accuracy_is_computed_on_the_steps_that_are_logged(tiny_corpus, tmp_path,
                                                                 monkeypatch):
    """The sequential path computes accuracy only on logging steps; each logged value must come
    from the step it is logged under, not from an earlier one."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    import mtp.train.module
    from mtp.train.loss import mtp_loss

    asked = []  # with_accuracy of each training step's loss, in step order

    def probe(*args, with_accuracy=False, **kw):
        asked.append(with_accuracy)
        return mtp_loss(*args, with_accuracy=with_accuracy, **kw)

    monkeypatch.setattr(mtp.train.module, "mtp_loss", probe)
    L.seed_everything(0)
    module = MTPModule(TINY, OptimConfig(warmup_steps=2, decay_steps=20), LossConfig("sequential"))
    dm = MTPDataModule(DataConfig(source=str(tiny_corpus), cache_dir=str(tmp_path / "cache"),
                                  seq_len=16, batch_size=4, val_fraction=0.1),
                       vocab_size=TINY.vocab_size, n_future=TINY.n_future)
    L.Trainer(max_steps=12, log_every_n_steps=4, logger=CSVLogger(tmp_path), limit_val_batches=0,
              enable_checkpointing=False, enable_progress_bar=False,
              use_distributed_sampler=False).fit(module, datamodule=dm)
    rows = csv.DictReader((tmp_path / "lightning_logs" / "version_0" / "metrics.csv").open())
    logged = [int(r["step"]) for r in rows if r.get("train/acc_head1")]
    computed = [step for step, yes in enumerate(asked) if yes]
    assert len(asked) == 12 and logged == computed == [3, 7, 11]


HELP_LINES = [[], ["fit"], ["validate"], ["generate"], ["demo"], ["eval"], ["export"],
              ["export", "hf"],
              ["bench"], *[["bench", b] for b in ("loss", "train", "kernel", "decode", "tokenize",
                                                 "sandbox")]]


def test_every_help_imports_nothing_heavy():
    """`mtp --help` and every subcommand's `--help` answer without importing torch or
    Lightning (seconds each); every one prints a usage line naming its command."""
    code = ("import contextlib, io, json, sys\n"
            "from mtp.cli import main\n"
            "out = {}\n"
            f"for line in {HELP_LINES!r}:\n"
            "    buf = io.StringIO()\n"
            "    with contextlib.redirect_stdout(buf):\n"
            "        try:\n"
            "            code = main([*line, '--help'])\n"
            "        except SystemExit as e:\n"
            "            code = e.code\n"
            "    out[' '.join(line)] = [code, buf.getvalue()[:200]]\n"
            "heavy = {'torch', 'lightning', 'numpy', 'tokenizers'} & set(sys.modules)\n"
            "print(json.dumps({'heavy': sorted(heavy), 'out': out}))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["heavy"] == []
    for line, (code, text) in result["out"].items():
        assert code in (0, None), (line, code, text)
        assert "usage:" in text and (line.split()[-1] if line else "commands") in text, line


def test_stored_fit_help_is_what_lightning_cli_prints():
    """`mtp fit --help` prints a stored copy (Lightning takes seconds to build it); the copy
    must be the live text of a fresh process (the help lists the callback classes imported), or
    `python -m mtp.train.fit_help` must be rerun."""
    code = ("import json\nfrom mtp.train import fit_help\n"
            "print(json.dumps({c: [fit_help.stored_help(c), fit_help.live_help(c)] "
            "for c in fit_help.COMMANDS}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    for command, (stored, live) in json.loads(proc.stdout.splitlines()[-1]).items():
        assert stored is not None, f"mtp/train/fit_help/{command}.txt is missing or stale"
        assert stored == live, (f"`mtp {command} --help` changed: rerun "
                                "`python -m mtp.train.fit_help`")
        assert "--model.n_future" in stored and "--trainer.max_steps" in stored


@pytest.mark.parametrize("text, why", [
    ("model: [1, 2\n", "not valid YAML: line 2, column 1: expected ',' or ']'"),
    ("- model\n- data\n", "must be a YAML mapping of settings (it holds a list)"),
    ("ckpt_path: last.ckpt\n", "ckpt_path belongs on the command line (--ckpt_path FILE)"),
])
def test_a_malformed_config_file_is_named_with_its_line(tmp_path, capsys, text, why):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    assert main(["fit", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"--config {path}: {why}" in err and "Traceback" not in err


def test_mtp_cli_overrides_no_private_lightning_cli_method():
    from lightning.pytorch.cli import LightningCLI

    from mtp.train.cli import MTPCLI

    private = [n for n in vars(MTPCLI) if n.startswith("_") and not n.startswith("__")
               and hasattr(LightningCLI, n)]
    assert private == []

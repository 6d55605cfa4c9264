"""Measuring the host costs of `experiments.budget.FixedCosts` on this machine and writing them
to `fixed_costs.yaml` (`FIXED_COSTS`), for `python -m experiments.budget --measure`.

The layer below budget.py: budget.py reads the file this module writes and runs its `measure`;
this module imports nothing of budget.py (the model's shape comes from `experiments.common`)."""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from experiments.common import REPO, model_shape, single_thread

FIXED_COSTS = Path(__file__).resolve().parent / "fixed_costs.yaml"
"""The measured host costs, with the command, revision and CPU that measured them:
`write_fixed_costs` writes it, `experiments.budget.load_fixed_costs` reads it."""


def _median_time(fn, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _gpu_presets() -> list[tuple[str, dict]]:
    from experiments.common import load_preset

    out = []
    for path in sorted((REPO / "experiments" / "presets").glob("*_gpu.yaml")):
        study = "k_sweep" if path.stem.startswith("k_sweep") else path.stem.split("_")[0]
        out.append((study, load_preset(study, str(path))))
    return out


def measure() -> dict:
    """Measure every host cost of `FixedCosts` on this machine, one CPU thread for torch (as the
    studies run), and return them with the command, revision, CPU and time."""
    import numpy as np
    import torch
    from mtp.eval.sandbox import run_program

    from experiments.common import fit_sections, provenance
    from experiments.synthetic import (
        InductionTask,
        PolynomialTask,
        induction_bag_baseline,
        train_model,
    )
    from mtp.config import DataConfig, ModelConfig, OptimConfig
    from mtp.data import source_specs, tokenizer_sample, train_tokenizer
    from mtp.decoding.generation import generate
    from mtp.model.transformer import build_model

    single_thread()
    out: dict = {}
    imports = "import torch, lightning, mtp.cli, mtp.train.module, mtp.data, experiments.synthetic"
    out["start_s"] = _median_time(lambda: subprocess.run([sys.executable, "-c", imports],
                                                         cwd=REPO, check=True))

    # Steps: a model so small that its arithmetic is negligible, at two depths; the slope in
    # steps is a step's host work, the intercept a run's setup.
    task = InductionTask(n_first=4, n_second=4, n_filler=8, names_per_seq=1, name_prob=0.3)

    def fit(layers: int, steps: int) -> float:
        cfg = ModelConfig(vocab_size=task.vocab_size, d_model=16, n_layers=layers, n_attn_heads=1,
                          max_seq_len=16)
        start = time.perf_counter()
        train_model(task, cfg, OptimConfig(lr=1e-3, warmup_steps=1), seq_len=8, batch_size=1,
                    steps=steps, seed=0)
        return time.perf_counter() - start

    per_step = {}
    for layers in (1, 7):
        short, long = fit(layers, 20), fit(layers, 120)
        per_step[layers + 1] = (long - short) / 100  # blocks: trunk + head 1
        if layers == 1:
            out["synthetic_run_s"] = max(0.0, short - 20 * per_step[2])
    out["step_block_s"] = (per_step[8] - per_step[2]) / 6
    # a noisy machine can put an intercept below zero: none of these costs is negative
    out["step_s"] = max(0.0, per_step[2] - 2 * out["step_block_s"])

    per_forward = {}
    for layers in (1, 7):
        torch.manual_seed(0)
        model = build_model(ModelConfig(vocab_size=64, d_model=16, n_layers=layers, n_attn_heads=1,
                                        max_seq_len=160)).eval()
        generate(model, [[1, 2, 3, 4]], 8)
        _, stats = generate(model, [[1, 2, 3, 4]], 128)
        per_forward[layers + 1] = stats.seconds / stats.forwards
    out["forward_block_s"] = (per_forward[8] - per_forward[2]) / 6
    out["forward_s"] = max(0.0, per_forward[2] - 2 * out["forward_block_s"])

    out["fit_run_s"], out["eval_run_s"] = _measure_fit_run(out)

    # Tokenisers: each vocabulary of a GPU preset's text corpus, on the standard library's
    # source: BPE on 2 MB of it, encoding the next 2 MB.
    vocabs = sorted({fit_sections(p)["model"]["vocab_size"] for s, p in _gpu_presets()
                     if s == "k_sweep"})
    docs = list(tokenizer_sample(source_specs(DataConfig(source="stdlib")), 4_000_000))
    half = len(docs) // 2
    train_docs, encode_docs = docs[:half], docs[half:]
    train_bytes = sum(len(d.encode()) for d in train_docs)
    encode_bytes = sum(len(d.encode()) for d in encode_docs)
    out["tokeniser"] = {}
    for vocab in vocabs:
        start = time.perf_counter()
        tok = train_tokenizer(iter(train_docs), vocab, train_bytes)
        bpe = time.perf_counter() - start
        start = time.perf_counter()
        tokens = sum(len(e.ids) for e in tok.encode_batch(encode_docs))
        encode = time.perf_counter() - start
        out["tokeniser"][vocab] = {"bpe_s_per_byte": bpe / train_bytes,
                                   "encode_s_per_byte": encode / encode_bytes,
                                   "bytes_per_token": encode_bytes / tokens}

    # Synthetic tasks at their GPU presets' settings.
    out["generate_s_per_token"] = {}
    for study, preset in _gpu_presets():
        if study == "k_sweep":
            continue
        t = dict(preset["task"])
        if study == "arithmetic":
            t["train_ops"] = tuple(t["train_ops"])
        task = (InductionTask if study == "induction" else PolynomialTask)(**t)
        width = preset["seq_len"] + 1
        seconds = _median_time(lambda: [task.sequence(np.random.default_rng(i), width)
                                        for i in range(200)])
        out["generate_s_per_token"][study] = seconds / (200 * width)
        if study == "induction":
            seqs = 20
            seconds = _median_time(lambda: induction_bag_baseline(task, n_seqs=seqs,
                                                                  length=preset["seq_len"]))
            out["bag_s_per_token"] = seconds / (seqs * preset["seq_len"])

    out["sandbox_s"] = _median_time(lambda: run_program("def f():\n    return 1\n",
                                                        "assert f() == 1\n", entry_point="f"),
                                    repeat=5)
    prov = provenance()
    return {"command": "python -m experiments.budget --measure", "git": prov["git"],
            "cpu": prov["cpu"], "utc": prov["utc"], **out}


def _measure_fit_run(out: dict) -> tuple[float, float]:
    """An `mtp fit` run's setup beyond its steps (data tokenised and cached beforehand), and
    loading a finished run's checkpoint and validation data."""
    from mtp.cli import main as mtp_main
    from mtp.config import DataConfig, ModelConfig
    from mtp.data import build_datamodule
    from mtp.model.checkpoint import load_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        base = yaml.safe_load((REPO / "configs" / "debug.yaml").read_text())
        base.setdefault("model", {})["vocab_size"] = 300
        base["data"] = {**base.get("data", {}), "source": "stdlib", "max_documents": 40,
                        "tokenizer_train_bytes": 200_000, "cache_dir": f"{tmp}/cache",
                        "num_workers": 0}
        base["trainer"] = {**base.get("trainer", {}), "max_steps": 2, "val_check_interval": 2,
                           "limit_val_batches": 1, "enable_progress_bar": False,
                           "default_root_dir": f"{tmp}/warm", "logger": False}
        cfg_path = Path(tmp) / "fit.yaml"

        def run(name: str, steps: int) -> float:
            cfg = {**base, "trainer": {**base["trainer"], "max_steps": steps,
                                       "default_root_dir": f"{tmp}/{name}"}}
            cfg_path.write_text(yaml.safe_dump(cfg))
            start = time.perf_counter()
            if mtp_main(["fit", "--config", str(cfg_path)]):
                raise RuntimeError("mtp fit of the measurement failed")
            return time.perf_counter() - start

        run("warm", 1)  # tokenises and caches the corpus, as a study's first run does
        blocks = model_shape(ModelConfig(**base["model"]), base["data"]["seq_len"]).blocks
        fit_run = max(0.0, run("timed", 2) - 2 * (out["step_s"] + out["step_block_s"] * blocks))
        ckpt = next(Path(tmp, "timed").rglob("last.ckpt"), None) or next(
            Path(tmp, "timed").rglob("*.ckpt"))

        def load() -> None:
            model, _ = load_checkpoint(ckpt, device="cpu")
            dm = build_datamodule(DataConfig(**base["data"]), vocab_size=model.cfg.vocab_size,
                                  n_future=model.cfg.n_future)
            dm.setup("validate")

        return fit_run, _median_time(load)


def write_fixed_costs(figures: dict, path: Path = FIXED_COSTS) -> None:
    """`fixed_costs.yaml`: the figures, rounded, under a comment saying what they are."""
    def rounded(v):
        if isinstance(v, dict):
            return {k: rounded(x) for k, x in v.items()}
        return float(f"{v:.3g}") if isinstance(v, float) else v

    header = ("# Host costs of the studies' runs that a faster GPU does not shorten (seconds),\n"
              "# measured on the CPU machine by the command below; experiments/budget.py reads\n"
              "# them for `--estimate` (FixedCosts documents each field).\n")
    path.write_text(header + yaml.safe_dump(rounded(figures), sort_keys=False))



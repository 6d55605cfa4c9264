"""What a preset costs before it runs: tokens per parameter, seeds against the power they buy,
and wall time on a device from the FLOP model plus host costs measured on a CPU.

    python -m experiments.k_sweep --preset scan_gpu --estimate
    python -m experiments.induction --preset gpu --estimate
    python -m experiments.budget --measure      # measure the host costs again

A run's estimated time is

    FLOPs / (the device's peak FLOP/s at the run's precision x its assumed utilisation)
    + host seconds

FLOPs are `MTPTransformer.flops_per_token(seq_len)` (forward and backward; tests/test_flops.py
checks it against FlopCounterMode) times the tokens trained on, plus a third of it for every
token scored afterwards (a forward pass). Host seconds are the work a faster GPU does not
shorten, measured on the CPU machine by `measure` and kept in `fixed_costs.yaml` beside this
file with the command, revision and CPU that measured them: starting a study's process,
tokenising its corpus, setting up each run, dispatching each optimizer step and each decode
forward, generating a synthetic task's tokens, running code-benchmark programs. They are added
to the GPU's time, not overlapped with it, which bounds the time from above where the host
dispatches while the GPU computes; and they were measured on a shared 2-core machine, slower
than a GPU server's host.

A GPU preset is sized by two rules, which `tests/test_experiments.py` checks for every one:
the same tokens per parameter at every width (`tokens_per_param`: the steps of a width are the
fewest that give every parameter of its K = 1 model that many training tokens; every K at the
width trains as long), and enough seeds that Holm's strictest step over the largest family of
tests a page of the preset makes detects a true difference of `POWER_TARGET_SD` pooled standard
deviations with 80% probability (`stats.detectable_difference`).
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a script, `python experiments/budget.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml  # noqa: E402

from experiments.common import REPO, markdown_table, single_thread  # noqa: E402
from mtp.config import InputError  # noqa: E402

FIXED_COSTS = Path(__file__).resolve().parent / "fixed_costs.yaml"

POWER_TARGET_SD = 2.0
"""The true difference, in pooled standard deviations of the seeds, that a GPU preset's seeds
must detect with 80% probability at Holm's strictest step: twice the seed-to-seed spread.
Differences of that size separate neighbouring settings of the CPU studies (a K from its
depth-matched control, one width from the next); with the 5 seeds of the CPU presets the
strictest step needs more than twice that."""

UTILISATION = 0.3
"""The share of a device's peak FLOP/s a training run is assumed to sustain (model FLOPs
utilisation): an assumption that no GPU run of these presets has checked, of the order that
large dense transformers reach. Small models reach less; for them the host's per-step work,
which the fixed costs count, is most of a step."""


@dataclass(frozen=True)
class Device:
    """A device's dense peak FLOP/s by precision and the share of it a run is assumed to
    sustain."""

    name: str
    peak: dict[str, float]
    """Dense peak FLOP/s by arithmetic: `bf16` (tensor cores, bf16 or fp16) and `fp32`
    (without TF32: torch's default float32 matmul precision)."""
    utilisation: float = UTILISATION

    def throughput(self, precision: str | int) -> float:
        """Sustained FLOP/s at a Lightning precision (`bf16-mixed`, `32-true`, ...)."""
        return self.peak[arithmetic(precision)] * self.utilisation

    def describe(self, precision: str | int) -> str:
        """The sustained throughput at a precision, and how it follows from the peak."""
        p = arithmetic(precision)
        return (f"{precision} ({p}): {self.peak[p] / 1e12:g} TFLOP/s dense peak x "
                f"{self.utilisation:g} assumed utilisation = "
                f"{self.throughput(precision) / 1e12:.0f} TFLOP/s sustained")


#: NVIDIA's H200 SXM datasheet: 989 TFLOP/s dense bf16 / fp16 tensor core (the peak
#: `mtp bench kernel` reports against), 67 TFLOP/s fp32.
H200 = Device("NVIDIA H200 SXM", {"bf16": 989e12, "fp32": 67e12})
DEVICES = {"h200": H200}


def arithmetic(precision: str | int) -> str:
    """`bf16` or `fp32`: the arithmetic a Lightning precision runs its matmuls in."""
    p = str(precision)
    if p in ("bf16-mixed", "bf16-true", "bf16", "16-mixed", "16-true", "16"):
        return "bf16"
    if p in ("32-true", "32"):
        return "fp32"
    raise InputError(f"precision {precision!r}: the estimate knows bf16-mixed, bf16-true, "
                     "16-mixed, 16-true and 32-true")


# -- host costs --------------------------------------------------------------------------------


@dataclass(frozen=True)
class FixedCosts:
    """Host seconds that a faster GPU does not shorten (`measure` writes them)."""

    start_s: float
    """Starting a study's process: Python with torch, Lightning and mtp imported."""
    fit_run_s: float
    """One `mtp fit` run beyond its steps: config, cached data, trainer, last checkpoint."""
    synthetic_run_s: float
    """One `synthetic.train_model` run beyond its steps."""
    eval_run_s: float
    """Loading a finished K-sweep run's checkpoint and validation data for its evaluation."""
    step_s: float
    """One optimizer step's host work, the part that does not grow with depth."""
    step_block_s: float
    """One optimizer step's host work per transformer block the step runs."""
    forward_s: float
    """One batch-1 decode forward's host work, the part that does not grow with depth."""
    forward_block_s: float
    """One decode forward's host work per transformer block."""
    tokeniser: dict[int, dict[str, float]]
    """By vocabulary size: `bpe_s_per_byte` (training the BPE), `encode_s_per_byte`,
    `bytes_per_token` (of the standard library's source)."""
    generate_s_per_token: dict[str, float]
    """Generating a synthetic task's tokens, by study (`induction`, `arithmetic`)."""
    bag_s_per_token: float
    """Induction's context-bag floor, per token scored (generation included)."""
    sandbox_s: float
    """Running one code-benchmark program and its test in the sandbox."""
    measured: dict[str, str] = field(default_factory=dict)
    """The command, git revision, CPU and UTC time of the measurement."""

    def step(self, blocks: int) -> float:
        """Host seconds of one optimizer step of a model of `blocks` transformer blocks."""
        return self.step_s + self.step_block_s * blocks

    def forward(self, blocks: int) -> float:
        """Host seconds of one forward call of a model of `blocks` transformer blocks."""
        return self.forward_s + self.forward_block_s * blocks


def load_fixed_costs(path: Path = FIXED_COSTS) -> FixedCosts:
    """The measured host costs (`fixed_costs.yaml`)."""
    if not path.is_file():
        raise InputError(f"{path} does not exist: measure the host costs with "
                         "`python -m experiments.budget --measure`")
    data = yaml.safe_load(path.read_text())
    names = set(FixedCosts.__dataclass_fields__)
    missing = sorted(names - set(data) - {"measured"})
    unknown = sorted(set(data) - names - {"command", "git", "cpu", "utc"})
    if missing or unknown:
        raise InputError(f"{path}: missing {missing or 'nothing'}, unknown {unknown or 'nothing'}"
                         "; measure again with `python -m experiments.budget --measure`")
    measured = {k: str(data.pop(k)) for k in ("command", "git", "cpu", "utc") if k in data}
    data["tokeniser"] = {int(v): dict(c) for v, c in data["tokeniser"].items()}
    return FixedCosts(**data, measured=measured)


# -- one preset's plan -------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """What the estimate needs of a model: parameters, FLOPs per training token, blocks."""

    params: int
    flops_per_token: float
    blocks: int


def model_shape(model_cfg, seq_len: int) -> Shape:
    """A `ModelConfig`'s parameters (all, embeddings included), FLOPs per training token at
    `seq_len` and transformer blocks, from a model built without memory (on the meta device)."""
    import torch

    from mtp.layers import Block
    from mtp.model import build_model

    with torch.device("meta"):
        model = build_model(model_cfg)
    return Shape(model.num_params(), model.flops_per_token(seq_len),
                 sum(isinstance(m, Block) for m in model.modules()))


def steps_for(tokens_per_param: float, params: int, tokens_per_step: int) -> int:
    """The fewest optimizer steps that give each of `params` parameters `tokens_per_param`
    training tokens."""
    return math.ceil(tokens_per_param * params / tokens_per_step)


@dataclass(frozen=True)
class RunCost:
    """The runs of one kind (a width and K; one per seed) of a preset."""

    label: str
    count: int
    params: int
    tokens: int
    """Training tokens of one run."""
    steps: int
    flops: float
    """Training and evaluation FLOPs of one run."""
    host_s: float
    """Host seconds of one run."""
    precision: str

    @property
    def tokens_per_param(self) -> float:
        """Training tokens per parameter of one run (of its own model, K > 1 heads included)."""
        return self.tokens / self.params


@dataclass
class Plan:
    """A preset's runs and what they cost apart from the device: what `estimate` times."""

    preset: str
    runs: list[RunCost]
    study: dict[str, float]
    """Host seconds paid once per study, by what they are for."""
    seeds: int
    family: int
    """Tests of the largest family a page of the preset decides (Holm's m)."""
    tokens_per_param: float | None
    """The preset's stated tokens per parameter (None: its steps are given)."""
    notes: list[str] = field(default_factory=list)


def synthetic_plan(preset: dict, costs: FixedCosts, kind: str, model_config, train_steps,
                   family: int, scoring) -> Plan:
    """The plan of a generated-task study (`kind`: ``induction`` or ``arithmetic``): per size
    and K, the FLOPs of training and of scoring (probes and the final evaluation), and host
    seconds (setup, each optimizer step, generating every token trained on, each forward that
    scores). `scoring(d, probes)` gives a size's scored tokens, its scoring forwards and any
    host seconds more of a run (the study's floor)."""
    if preset.get("accelerator", "cpu") == "cpu":
        raise InputError(f"--estimate times a GPU preset; {preset['_path']} trains on the CPU "
                         "(accelerator: cpu)")
    seq, batch = preset["seq_len"], preset["batch_size"]
    generate = costs.generate_s_per_token[kind]
    # training windows come from `data_workers` processes beside the step (none: in its loop)
    workers = preset.get("data_workers", 0)
    runs = []
    for d in preset["sizes"]:
        n_steps = train_steps(preset, d)
        every = preset["probe_every"]
        probes = n_steps // every + bool(n_steps % every)  # and at the last step
        scored, forwards, more = scoring(d, probes)
        for k in preset["ks"]:
            shape = model_shape(model_config(preset, d, k), seq)
            tokens = n_steps * batch * seq
            host = (costs.synthetic_run_s + n_steps * costs.step(shape.blocks)
                    + generate * (n_steps * batch * (seq + k) / max(1, workers) + scored)
                    + forwards * costs.forward(shape.blocks) + more)
            runs.append(RunCost(f"d={d} K={k}", len(preset["seeds"]), shape.params, tokens,
                                n_steps, shape.flops_per_token * (tokens + scored / 3), host,
                                str(preset.get("precision", "32-true"))))
    return Plan(preset["_path"], runs, {"process start": costs.start_s}, len(preset["seeds"]),
                family, preset.get("tokens_per_param"))


@dataclass(frozen=True)
class Estimate:
    """A plan's wall time on a device."""

    plan: Plan
    device: Device
    costs: FixedCosts

    def gpu_s(self, run: RunCost) -> float:
        """One run's FLOPs over the device's sustained throughput at its precision."""
        return run.flops / self.device.throughput(run.precision)

    def run_s(self, run: RunCost) -> float:
        """One run: FLOPs / sustained throughput + host seconds."""
        return self.gpu_s(run) + run.host_s

    @property
    def total_s(self) -> float:
        """Every run and the once-per-study costs."""
        return (sum(self.run_s(r) * r.count for r in self.plan.runs)
                + sum(self.plan.study.values()))

    def text(self) -> str:
        """The estimate as a report: a table of run kinds, the totals, power and notes."""
        from experiments.stats import MIN_SEEDS, detectable_difference

        plan, costs = self.plan, self.costs
        precisions = sorted({r.precision for r in plan.runs})
        table = [[r.label, r.count, count_text(r.params), count_text(r.tokens),
                  f"{r.tokens_per_param:.2f}", r.steps, f"{r.flops:.3g}",
                  _duration(self.gpu_s(r)), _duration(r.host_s), _duration(self.run_s(r)),
                  _duration(self.run_s(r) * r.count)] for r in plan.runs]
        gpu = sum(self.gpu_s(r) * r.count for r in plan.runs)
        n, m = plan.seeds, plan.family
        power = (f"Seeds: {n} per group, fewer than {MIN_SEEDS}: no page tests them."
                 if n < MIN_SEEDS else
                 f"Seeds: {n} per group; the largest page decides m = {m} tests: Holm's "
                 "strictest step detects a true difference of "
                 f"{detectable_difference(n, m):.2f} pooled standard deviations with 80% "
                 f"probability, its last {detectable_difference(n, 1):.2f} (target: "
                 f"{POWER_TARGET_SD:g} at the strictest).")
        measured = costs.measured
        source = (f"Host costs from {FIXED_COSTS.relative_to(REPO)}, measured by "
                  f"`{measured['command']}` at git {measured.get('git')} on "
                  f"{measured.get('cpu')} ({measured.get('utc')} UTC)."
                  if measured.get("command") else "Host costs as given (not measured).")
        lines = [
            f"Estimate of {plan.preset} on one {self.device.name}: "
            + "; ".join(self.device.describe(p) for p in precisions) + ".",
            source,
            "Time of a run = FLOPs / sustained throughput + host seconds (added, not overlapped: "
            "an upper bound).",
            "",
            markdown_table(["runs", "count", "params", "tokens", "tokens/param", "steps",
                            "FLOPs", "GPU", "host", "per run", "all"], table),
            "",
            "Once per study: " + "; ".join(f"{what}: {_duration(s)}"
                                           for what, s in plan.study.items()) + ".",
            f"Total: {_duration(self.total_s)} on one device ({len(plan.runs)} kinds of run, "
            f"{sum(r.count for r in plan.runs)} runs; GPU {_duration(gpu)}, host "
            f"{_duration(self.total_s - gpu)}).",
            "Tokens per parameter: "
            + (f"{plan.tokens_per_param:g} at every width (stated; steps rounded up)."
               if plan.tokens_per_param is not None else "not stated (fixed steps)."),
            power,
        ]
        lines += [f"- {note}" for note in plan.notes]
        return "\n".join(lines)


def estimate(plan: Plan, device: Device = H200, costs: FixedCosts | None = None) -> Estimate:
    """A plan's time on `device` with the measured host costs (`fixed_costs.yaml`)."""
    return Estimate(plan, device, costs or load_fixed_costs())


def count_text(x: float) -> str:
    """1.53M, 2.5B: a count for a table."""
    return f"{x / 1e9:.3g}B" if x >= 1e9 else f"{x / 1e6:.3g}M" if x >= 1e6 else f"{x:.0f}"


def _duration(s: float) -> str:
    if s < 100:
        return f"{s:.1f} s"
    if s < 6000:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def preset_steps(preset: dict, params: int) -> int:
    """A synthetic study's training steps at a width whose K = 1 model has `params` parameters:
    the preset's `steps`, or the fewest that give each parameter its `tokens_per_param`
    training tokens (windows of `seq_len`, `batch_size` of them a step)."""
    if ("steps" in preset) == ("tokens_per_param" in preset):
        raise InputError(f"--preset {preset['_path']}: give exactly one of steps and "
                         "tokens_per_param")
    if "steps" in preset:
        return int(preset["steps"])
    return steps_for(preset["tokens_per_param"], params,
                     preset["batch_size"] * preset["seq_len"])


# -- a text corpus -----------------------------------------------------------------------------


def corpus_bytes(data: dict) -> int | None:
    """Bytes of a `--data` section's documents, where they can be counted offline (the
    standard library or local files; `max_documents` respected), else None."""
    from mtp.config import DataConfig
    from mtp.data import source_specs

    cfg = DataConfig(**data)
    if cfg.sources:
        return None
    try:
        spec = source_specs(cfg)[0]
    except (InputError, OSError):
        return None
    if not spec.files:
        return None
    files = spec.files[:spec.max_documents] if spec.max_documents else spec.files
    return sum(p.stat().st_size for p in files)


def tokenising(data: dict, vocab: int, costs: FixedCosts) -> tuple[float | None, str]:
    """Host seconds to train a corpus's BPE and encode it (once per study: both are cached), and
    a note on what the figure covers."""
    size = corpus_bytes(data)
    source = data.get("source")
    if size is None:
        return None, (f"tokenising {source}: not estimated (its size is not known offline)")
    rates = costs.tokeniser.get(vocab)
    if rates is None:
        return None, (f"tokenising {source} at vocabulary {vocab}: not measured (add the "
                      "vocabulary to a GPU preset and run `python -m experiments.budget "
                      "--measure`)")
    train_bytes = min(size, int(data.get("tokenizer_train_bytes", size)))
    seconds = rates["bpe_s_per_byte"] * train_bytes + rates["encode_s_per_byte"] * size
    return seconds, f"{source} ({size / 1e6:.1f} MB)"


def corpus_tokens(data: dict, vocab: int, costs: FixedCosts) -> float | None:
    """Training tokens of a corpus (its bytes outside validation / measured bytes per token)."""
    size = corpus_bytes(data)
    rates = costs.tokeniser.get(vocab)
    if size is None or rates is None:
        return None
    return size * (1 - float(data.get("val_fraction", 0.02))) / rates["bytes_per_token"]


# -- measuring the host costs ------------------------------------------------------------------


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
    from mtp.decoding import generate
    from mtp.model import build_model

    single_thread()
    out: dict = {}
    imports = "import torch, lightning, mtp.cli, mtp.module, mtp.data, experiments.synthetic"
    out["start_s"] = _median_time(lambda: subprocess.run([sys.executable, "-c", imports],
                                                         cwd=REPO, check=True))

    # Steps: a model so small that its arithmetic is negligible, at two depths; the slope in
    # steps is a step's host work, the intercept a run's setup.
    task = InductionTask(n_first=4, n_second=4, n_filler=8, names_per_seq=1, name_prob=0.3)

    def fit(layers: int, steps: int) -> float:
        cfg = ModelConfig(vocab_size=task.vocab_size, d_model=16, n_layers=layers, n_heads=1,
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
        model = build_model(ModelConfig(vocab_size=64, d_model=16, n_layers=layers, n_heads=1,
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
    from mtp.checkpoint import load_checkpoint
    from mtp.cli import main as mtp_main
    from mtp.config import DataConfig, ModelConfig
    from mtp.data import build_datamodule

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--measure", action="store_true",
                        help=f"measure the host costs on this machine into {FIXED_COSTS.name}")
    args = parser.parse_args(argv)
    if not args.measure:
        parser.error("nothing to do: give --measure (estimates: `python -m experiments.<study> "
                     "--preset <gpu preset> --estimate`)")
    figures = measure()
    write_fixed_costs(figures)
    print(FIXED_COSTS.read_text())
    return 0


if __name__ == "__main__":
    from experiments.common import study_main

    sys.exit(study_main(main))

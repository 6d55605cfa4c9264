"""What a preset costs before it runs: tokens per parameter, seeds against the power they buy,
and wall time on a device from the FLOP model plus host costs measured on a CPU.

    python -m experiments.k_sweep --preset scan_gpu --estimate
    python -m experiments.induction --preset gpu --estimate
    python -m experiments.budget --measure      # measure the host costs again

A run's estimated time is

    FLOPs / (the device's peak FLOP/s at the run's precision x its assumed utilisation)
    + host seconds

FLOPs are `MTPTransformer.flops_per_token(seq_len)` (forward and backward; tests/model/test_flops.py
checks it against FlopCounterMode) times the tokens trained on, plus a third of it for every
token scored afterwards (a forward pass). Host seconds are the work a faster GPU does not
shorten, measured on the CPU machine by `host_costs.measure` and kept in `fixed_costs.yaml`
beside this file with the command, revision and CPU that measured them: starting a study's
process, tokenising its corpus, setting up each run, dispatching each optimizer step and each
decode forward, generating a synthetic task's tokens, running code-benchmark programs. They are
added to the GPU's time, not overlapped with it, which bounds the time from above where the host
dispatches while the GPU computes; and they were measured on a shared 2-core machine, slower
than a GPU server's host.

A GPU preset is sized by two rules, which `tests/experiments/test_experiments_budget.py` checks for
every one: the same tokens per parameter at every width (`tokens_per_param`: the steps of a width
are the fewest that give every parameter of its K = 1 model that many training tokens; every K at
the width trains as long), and enough seeds that Holm's strictest step over the largest family of
tests a page of the preset makes detects a true difference of `POWER_TARGET_SD` pooled standard
deviations with 80% probability (`stats.detectable_difference`).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a script, `python experiments/budget.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml  # noqa: E402

from experiments.common import REPO, markdown_table, model_shape  # noqa: E402
from experiments.host_costs import FIXED_COSTS, measure, write_fixed_costs  # noqa: E402
from mtp.util.errors import InputError  # noqa: E402

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
    """Host seconds that a faster GPU does not shorten (`host_costs.measure` measures them)."""

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--measure", action="store_true",
                        help=f"measure the host costs on this machine into {FIXED_COSTS.name}")
    args = parser.parse_args(argv)
    if not args.measure:
        parser.error("nothing to do: give --measure (estimates: `python -m experiments.<study> "
                     "--preset <gpu preset> --estimate`)")
    write_fixed_costs(measure())
    print(FIXED_COSTS.read_text())
    return 0


if __name__ == "__main__":
    from experiments.common import study_main

    sys.exit(study_main(main))

"""Learning curves of a study's runs, and what they say about its training budget.

A run's curve is `[[optimizer step, value], ...]`: the validation loss `mtp fit` logged (the K
sweeps, read back from the run's TensorBoard events) or a held-out probe score (the generated
tasks). A group of runs (one per seed) has *converged* where the last `FLAT_SHARE` of its
steps left it flat within its seed spread: the mean over seeds of each curve's change across
that stretch (the least-squares slope through its points there, times the stretch's length) is
no larger in size than the sample standard deviation over seeds of the curves' last values, and
no larger than twice its own standard error: a change the seeds cannot tell from none. A loss
still falling by much more than its standard error has not converged, however far apart the
seeds end.
Two groups compared after both converged are compared *converged*; otherwise the comparison is
at a *fixed budget* (the steps the preset gives), and a difference may be one of speed, not of
where training ends.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from experiments.common import (
    NOT_RECORDED,
    Recorded,
    column,
    curve_plot,
    markdown_table,
    model_shape,
    summarize,
)

#: The closing share of a curve's steps that must be flat for its group to count as converged.
FLAT_SHARE = 0.2

#: What a K-sweep run's curve measures, as its page says.
FIT_METRIC = (
    "Next-token validation loss as `mtp fit` logged it (`val/next_token_loss`) every "
    "`fit.trainer.val_check_interval` steps, on its first `fit.trainer.limit_val_batches` "
    "validation batches: fewer windows than the tables score (the first `eval.val_windows`), "
    "and the validation text is uneven, so the curves sit at another level than the tables' "
    "loss; their shape is what decides convergence")

Curve = list[list[float]]
"""[[optimizer step, value], ...] in step order."""


def tensorboard_curve(log_dir: Path, tag: str) -> Curve:
    """The scalar `tag` of the TensorBoard event files under `log_dir`, [[step, value], ...]:
    where a resumed run logged a step twice, the later value is kept."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    if tag not in events.Tags().get("scalars", []):
        raise FileNotFoundError(f"{log_dir}: no `{tag}` scalars in its TensorBoard events")
    by_step = {int(e.step): float(e.value) for e in events.Scalars(tag)}
    return [[s, round(v, 5)] for s, v in sorted(by_step.items())]


def of(rows: Sequence[dict]) -> list[Curve]:
    """The rows' `curve` cells; [] for a row that recorded none."""
    return [json.loads(r["curve"]) if r.get("curve") else [] for r in rows]


def closing_change(curve: Curve, share: float = FLAT_SHARE) -> float:
    """How much a curve moved over the last `share` of its steps: the least-squares slope
    through its points at steps >= (1 - share) x its last step, times that stretch's length;
    nan with fewer than two such points."""
    if not curve:
        return math.nan
    start = (1 - share) * curve[-1][0]
    pts = [(s, v) for s, v in curve if s >= start]
    if len(pts) < 2:
        return math.nan
    ms = sum(s for s, _ in pts) / len(pts)
    mv = sum(v for _, v in pts) / len(pts)
    var = sum((s - ms) ** 2 for s, _ in pts)
    slope = sum((s - ms) * (v - mv) for s, v in pts) / var
    return slope * (curve[-1][0] - start)


@dataclass(frozen=True)
class Convergence:
    """Whether a group's curves ended flat: `change` is the mean over seeds of each curve's
    `closing_change` and `change_se` its standard error, `spread` the sample std over seeds of
    the curves' last values."""

    label: str
    change: float
    change_se: float
    spread: float
    seeds: int
    steps: int

    @property
    def known(self) -> bool:
        return not (math.isnan(self.change) or math.isnan(self.spread))

    @property
    def converged(self) -> bool:
        return self.known and abs(self.change) <= min(self.spread, 2 * self.change_se)

    def numbers(self, digits: int = 3) -> str:
        return (f"{self.change:+.{digits}f} ± {self.change_se:.{digits}f} over the last "
                f"{FLAT_SHARE:.0%} of its steps, seed spread {self.spread:.{digits}f}")

    def status(self, digits: int = 3) -> str:
        """`converged` or why not, with both numbers."""
        if not self.known:
            return ("not judged (fewer than 2 seeds, or fewer than 2 points in the last "
                    f"{FLAT_SHARE:.0%} of its curve)")
        return f"{'converged' if self.converged else 'still moving'} ({self.numbers(digits)})"


def convergence(label: str, curves: Sequence[Curve]) -> Convergence:
    """A group's `Convergence` from its per-seed curves (empty curves are left out)."""
    curves = [c for c in curves if c]
    changes = [closing_change(c) for c in curves]
    # a curve too short to judge leaves its whole group unjudged
    moved = summarize([] if any(map(math.isnan, changes)) else changes)
    return Convergence(label, moved["mean"], moved["std"] / math.sqrt(max(1, moved["n"])),
                       summarize(c[-1][1] for c in curves)["std"], len(curves),
                       max((int(c[-1][0]) for c in curves), default=0))


def budget(*groups: Convergence, digits: int = 3) -> str:
    """The sentence a verdict ends with: whether its groups had converged, or were compared at
    the fixed budget of their steps."""
    if all(g.converged for g in groups):
        return ("Trained: converged (" + "; ".join(f"{g.label} {g.numbers(digits)}"
                                                   for g in groups) + ").")
    steps = " / ".join(map(str, sorted({g.steps for g in groups})))
    return (f"Trained: at a fixed budget of {steps} steps ("
            + "; ".join(f"{g.label} {g.status(digits)}" for g in groups if not g.converged)
            + ").")


def section(groups: Sequence[Convergence], tokens_per_param: dict[str, float], metric: str,
            plots: Sequence[str], digits: int = 3) -> list[str]:
    """A page's learning-curve section: the plots (one line per seed), then per group its
    steps, tokens per parameter, change over the closing stretch, seed spread and status."""
    def number(x: float, sign: str = "") -> str:
        return "–" if math.isnan(x) else f"{x:{sign}.{digits}f}"

    tpp = {label: NOT_RECORDED if math.isnan(x) else f"{x:.2f}"
           for label, x in tokens_per_param.items()}
    table = [[g.label, g.steps, tpp[g.label], g.seeds, number(g.change, "+"),
              number(g.change_se), number(g.spread),
              "yes" if g.converged else "no" if g.known else "not judged"] for g in groups]
    return [
        "### Learning curves and budget",
        "",
        f"{metric}, one line per seed. A group has converged where the last "
        f"{FLAT_SHARE:.0%} of its steps left it flat within its seed spread: the mean over "
        "seeds of each curve's change across that stretch (least-squares slope times its "
        "length) is no larger than the sample std over seeds of the curves' last values, and "
        "no larger than twice its own standard error (a change the seeds cannot tell from "
        "none). Each "
        "verdict below says whether its groups had converged or were compared at a fixed "
        "budget. Tokens per parameter: training tokens (steps x the tokens of a step) over "
        "all the run's parameters.",
        "",
        " ".join(plots),
        "",
        markdown_table(["group", "steps", "tokens/param", "seeds",
                        f"change, last {FLAT_SHARE:.0%}", "its std error", "seed spread",
                        "converged"], table),
        "",
    ]


def plot(path: Path, curves: dict[str, list[Curve]], *, ylabel: str, title: str,
         hline: float | None = None, hline_label: str | None = None) -> str:
    """`common.curve_plot` of the groups that recorded curves; the page's image link, or ""
    where none did."""
    curves = {label: [c for c in cs if c] for label, cs in curves.items()}
    curves = {label: cs for label, cs in curves.items() if cs}
    if not curves:
        return ""
    curve_plot(path, curves, ylabel=ylabel, title=title, hline=hline, hline_label=hline_label)
    return f"![{title}]({path.name})"


# -- what the generated-task studies' runs trained on -------------------------------------------


def synthetic_settings(rows: list[dict], preset: dict | None,
                       keys: Sequence[str]) -> tuple[dict, str]:
    """The settings `keys` of a generated-task study's runs (its model and batch: what tokens
    per parameter and training FLOPs need), as the rows recorded them; where they recorded
    none, from `preset` as it is today, and the sentence that says so. A key neither gives is
    left out."""
    recorded = Recorded(rows)
    values = {k: recorded.get(k) for k in keys}
    missing = [k for k, v in values.items() if v is None]
    if not missing:
        return values, ""
    if preset is None:
        return {k: v for k, v in values.items() if v is not None}, ""
    values |= {k: preset[k] for k in missing if k in preset}
    return values, (
        "The rows recorded no " + ", ".join(f"`{k}`" for k in missing) + ", which tokens "
        f"per parameter and the training FLOPs need: they are read from `{preset['_path']}` "
        "as it is today.")


def synthetic_budget(rows: list[dict], by: dict, sizes: list[int], ks: list[int],
                     preset: dict | None, model_config):
    """What a generated-task study's groups ({(d_model, K) as strings: rows}) trained on: each
    group's `Convergence` ({(d, k): ...}) and tokens per parameter (by its label), the
    training FLOPs per token of each width and K ({d: {k: flops}}, {} where the settings are
    not known; `model_config(settings, d, k)` is the study's model) and the page's note on
    settings read from the preset file."""
    settings, fallback = synthetic_settings(
        rows, preset, ("task", "n_layers", "head_dim", "seq_len", "batch_size"))
    known = len(settings) == 5
    trained, tpp, flops = {}, {}, {}
    for d in sizes:
        for k in ks:
            rs = by.get((str(d), str(k)), [])
            if not rs:
                continue
            label = f"d = {d}, K = {k}"
            trained[d, k] = convergence(label, of(rs))
            tpp[label] = (int(rs[0]["steps"]) * settings["batch_size"] * settings["seq_len"]
                          / int(rs[0]["params"]) if known else math.nan)
            if known:
                flops.setdefault(d, {})[k] = model_shape(model_config(settings, d, k),
                                                         settings["seq_len"]).flops_per_token
    return trained, tpp, flops, fallback


def compute_line(where: str, k: int, rows_k: list[dict], rows_1: list[dict],
                 flops: dict[int, float] | None) -> str:
    """Whether K's runs had the compute of the K = 1 baseline's at `where` (a description):
    their parameters, training FLOPs per token (`flops`: K -> `MTPTransformer
    .flops_per_token`, None where not recorded) and training wall time, as ratios."""
    params = int(rows_k[0]["params"]) / int(rows_1[0]["params"])
    seconds = (sum(column(rows_k, "train_s")) / len(rows_k)) / (
        sum(column(rows_1, "train_s")) / len(rows_1))
    per_token = (f"{flops[k] / flops[1]:.2f}x the training FLOPs per token "
                 "(`MTPTransformer.flops_per_token`), " if flops else "")
    matched = abs(params - 1) < 0.01 and (not flops or abs(flops[k] / flops[1] - 1) < 0.01)
    return (f"- {where}, compute of K = {k} against the K = 1 baseline (a description, not a "
            f"test): {params:.2f}x the parameters, {per_token}{seconds:.2f}x the training wall "
            "time (mean over seeds, one CPU thread each) for the same steps and tokens: "
            + ("compute-matched." if matched else "**not compute-matched**: K = "
               f"{k} spends more compute on the same data, the extra head's."))

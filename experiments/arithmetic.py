"""Algorithmic-reasoning study (Gloeckle et al. 2024, section 4.2): polynomial arithmetic vs K.

Generated expressions over F_p[X]/(X^m) with +, * and negation (`synthetic.PolynomialTask`).
Models are trained on expressions of `train_ops` operations and scored on exact-match answers of
every operation count in `eval_ops`: those inside the training range are in distribution, the
rest out of distribution. Every K keeps the K = 1 model's trunk, so head 1's path (its depth and
its parameters) is the same for every K and a difference in its accuracy is the objective's;
the K - 1 extra heads are parameters only training uses. Each run records a learning curve, and
the report first checks that the K = 1 baseline rose above the floor of always giving the most
frequent answer before it compares any K.

    python -m experiments.arithmetic --preset cpu --out experiments/reports/arithmetic

Results are appended to `<out>/results.csv` as runs finish (a rerun skips finished runs);
`<out>/README.md` and the PNG plots are regenerated from the CSV at the end (or alone, with
`--report-only`). A preset gives `steps`, or `tokens_per_param` (each width trains on that many
tokens per parameter of its K = 1 model); `--estimate` prints what a GPU preset's runs cost
(tokens per parameter, power, time on one H200; `experiments/budget.py`) and trains nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script, `python experiments/<study>.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments import curves  # noqa: E402
from experiments.common import (  # noqa: E402 (a script puts the repository on the path first)
    NOT_RECORDED,
    Recorded,
    ResultsCSV,
    column,
    command_line,
    curve_plot,
    errorbar_plot,
    group,
    head1_depth,
    load_preset,
    log_hparams,
    map_runs,
    markdown_table,
    model_shape,
    per_seed,
    pm,
    preset_settings,
    provenance,
    provenance_line,
    settings_line,
    single_thread,
    steps_line,
    study_main,
    summarize,
    to_float,
    trained_here,
)
from experiments.stats import Family, finding, why_untestable  # noqa: E402
from mtp.util.errors import InputError  # noqa: E402

COLUMNS = ["d_model", "K", "seed", "params", "head1_depth", "steps", "acc_in", "acc_out",
           "coef_acc_in", "coef_acc_out", "acc_by_ops", "floor_in", "floor_out", "curve",
           "train_s", "git", "environment", "utc", "fit_git", "fit_cpu", "cpu", "settings"]
"""One row per run. `floor_*` is the exact-match accuracy of always giving the training
distribution's most frequent answer; `curve` is [[step, in-distribution exact match], ...]. A
run trains and is scored in one call, so `fit_git` / `fit_cpu` (what trained it) equal `git` /
`cpu` (what scored it); `settings` (JSON) is the preset it ran with, but for its plan
(`PLAN`)."""
KEY = ["d_model", "K", "seed"]
#: Preset keys that say which runs to make (a row's own columns say which run it is).
PLAN = ("sizes", "ks", "seeds")


def _task(preset: dict):
    from experiments.synthetic import PolynomialTask

    t = dict(preset["task"])
    t["train_ops"] = tuple(t["train_ops"])
    return PolynomialTask(**t)


def train_steps(preset: dict, d: int) -> int:
    """Training steps at width d: the preset's `steps`, or those its `tokens_per_param` gives
    the K = 1 model of that width (every K trains as long)."""
    from experiments.budget import preset_steps

    return preset_steps(preset, model_shape(model_config(preset, d, 1),
                                            preset["seq_len"]).params)


def model_config(preset: dict, d: int, k: int):
    from mtp.config import ModelConfig

    return ModelConfig(vocab_size=_task(preset).vocab_size, d_model=d,
                       n_layers=preset["n_layers"], n_attn_heads=max(1, d // preset["head_dim"]),
                       n_future=k, max_seq_len=preset["seq_len"] + 8)


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def run(preset: dict, out: Path, work: Path, jobs: int = 1) -> None:
    """Train and score every (size, K, seed) of the preset that the CSV does not hold yet,
    `jobs` runs at a time; each row is written as its run finishes."""
    csv = ResultsCSV(out / "results.csv", COLUMNS, KEY)
    todo = []
    for d in preset["sizes"]:
        for k in preset["ks"]:
            for seed in preset["seeds"]:
                if csv.is_done(d_model=d, K=k, seed=seed):
                    print(f"[arithmetic] d={d} K={k} seed={seed}: done, skipped")
                else:
                    todo.append((preset, d, k, seed))
    for row in map_runs(one_run, todo, jobs):
        csv.append(row)
        log_hparams(work / "hparams" / f"d{row['d_model']}-K{row['K']}-s{row['seed']}",
                    {c: row[c] for c in ("d_model", "K", "seed", "params")},
                    {c: row[c] for c in ("acc_in", "acc_out", "coef_acc_in", "coef_acc_out")})
        print(f"[arithmetic] d={row['d_model']} K={row['K']} seed={row['seed']}: exact in "
              f"{row['acc_in']:.3f} out {row['acc_out']:.3f} (floor {row['floor_in']:.3f} / "
              f"{row['floor_out']:.3f}; {row['train_s']:.0f} s)", flush=True)


def one_run(preset: dict, d: int, k: int, seed: int) -> dict:
    """Train one model, with its learning curve, and score it: its CSV row."""
    from experiments.synthetic import (
        arithmetic_accuracy,
        majority_accuracy,
        majority_answer,
        train_model,
    )
    from mtp.config import OptimConfig

    task = _task(preset)
    lo, hi = task.train_ops
    ins = [n for n in preset["eval_ops"] if lo <= n <= hi]
    outs = [n for n in preset["eval_ops"] if not lo <= n <= hi]

    def probe(model) -> float:  # in-distribution exact match on a smaller held-out set
        return _mean(arithmetic_accuracy(model, task, n, n_examples=preset["probe_examples"],
                                         seed=20_000)[0] for n in ins)

    n_steps = train_steps(preset, d)
    trained = train_model(task, model_config(preset, d, k),
                          OptimConfig(lr=preset["lr"], warmup_steps=preset["warmup_steps"]),
                          seq_len=preset["seq_len"], batch_size=preset["batch_size"],
                          steps=n_steps, seed=seed, accelerator=preset.get("accelerator", "cpu"),
                          precision=preset.get("precision", "32-true"),
                          data_workers=preset.get("data_workers", 0), probe=probe,
                          probe_every=preset["probe_every"])
    by_ops = {n: arithmetic_accuracy(trained.model, task, n, n_examples=preset["eval_examples"])
              for n in preset["eval_ops"]}
    answer = majority_answer(task)
    floor = {n: majority_accuracy(task, n, n_examples=preset["eval_examples"], answer=answer)
             for n in preset["eval_ops"]}
    prov = provenance()
    return {"d_model": d, "K": k, "seed": seed, "params": trained.model.num_params(),
            "head1_depth": head1_depth(trained.model), "steps": n_steps,
            "acc_in": _mean(by_ops[n][0] for n in ins),
            "acc_out": _mean(by_ops[n][0] for n in outs),
            "coef_acc_in": _mean(by_ops[n][1] for n in ins),
            "coef_acc_out": _mean(by_ops[n][1] for n in outs),
            "acc_by_ops": json.dumps({n: round(v[0], 4) for n, v in by_ops.items()}),
            "floor_in": _mean(floor[n] for n in ins), "floor_out": _mean(floor[n] for n in outs),
            "curve": json.dumps([[s, round(v, 4)] for s, v in trained.curve]),
            "train_s": trained.seconds, **prov, **trained_here(prov),
            "settings": json.dumps(preset_settings(preset, PLAN))}


def report(out: Path, command: str, preset: dict | None = None) -> str:
    """Write `<out>/README.md` and the PNG plots from `<out>/results.csv` alone: the settings
    it describes are those the rows recorded (`preset` stands in only for the model and batch
    settings of rows that recorded none, which tokens per parameter and FLOPs need, and the
    page says so)."""
    rows = ResultsCSV(out / "results.csv", COLUMNS, KEY).rows()
    if not rows:
        raise InputError(f"no results in {out / 'results.csv'} (run the study without "
                         "--report-only first)")
    recorded = Recorded(rows)
    train_ops = recorded.get("task", "train_ops")
    trained_on = "–".join(map(str, train_ops)) if train_ops else recorded.text("task", "train_ops")
    by = group(rows, ["d_model", "K"])
    sizes = sorted({int(r["d_model"]) for r in rows})
    ks = sorted({int(r["K"]) for r in rows})
    floor = {s: to_float(rows[0][f"floor_{s}"]) for s in ("in", "out")}
    p, m = recorded.get("task", "p"), recorded.get("task", "m")
    uniform = f"{p ** -m:.3f}" if p and m else NOT_RECORDED

    trained, tpp, flops, fallback = curves.synthetic_budget(rows, by, sizes, ks, preset,
                                                            model_config)
    for d in sizes:
        series = {}
        for k in ks:
            rs = by.get((str(d), str(k)), [])
            if not rs:
                continue
            per = [json.loads(r["acc_by_ops"]) for r in rs]
            ops = sorted(int(n) for n in per[0])
            stats = [summarize(p[str(n)] for p in per) for n in ops]
            series[f"K = {k}"] = (ops, [s["mean"] for s in stats], [s["std"] for s in stats])
        errorbar_plot(out / f"accuracy_by_ops_d{d}.png", series,
                      xlabel=f"operations (training: {trained_on})",
                      ylabel="exact-match accuracy",
                      title=f"Polynomial arithmetic, d_model = {d}")
        curve_plot(out / f"curves_d{d}.png",
                   {f"K = {k}": curves.of(by.get((str(d), str(k)), []))
                    for k in ks},
                   ylabel="exact match, in distribution (held-out probe)",
                   title=f"Learning curves, d_model = {d}, one line per seed",
                   hline=floor["in"], hline_label="majority-answer floor")

    table = []
    for d in sizes:
        for k in ks:
            rs = by.get((str(d), str(k)), [])
            if rs:
                table.append([d, rs[0]["params"], rs[0]["head1_depth"], k,
                              pm(summarize(column(rs, "acc_in"))), per_seed(rs, "acc_in"),
                              pm(summarize(column(rs, "acc_out"))), per_seed(rs, "acc_out"),
                              pm(summarize(column(rs, "coef_acc_in"))), len(rs)])
    lines = [
        "# Algorithmic reasoning: polynomial arithmetic as K varies",
        "",
        "Reproduce every number and plot on this page (the CSV is appended as runs finish; a "
        "rerun skips finished runs; `--report-only` rewrites this page from the CSV):",
        "",
        f"```\n{command}\n```",
        "",
        "Task: expressions over F_p[X]/(X^m) (`task.p`, `task.m`) in prefix notation with +, * "
        "and unary negation, then `=` and the m coefficients of the result; training "
        "expressions have `task.train_ops` operations (in distribution), evaluation also uses "
        "more (out of distribution; the plots give every operation count scored). Windows of "
        "`seq_len` tokens hold examples packed back to back; the loss covers every token "
        "(operands are random, so most of it is irreducible). Every K keeps the K = 1 model's "
        "trunk (`n_layers` blocks), so "
        "head 1's path (depth in the table) and its parameters are the same for every K and a "
        "difference in head-1 accuracy is the training objective's, not lost depth; the "
        "K − 1 extra heads are parameters only training uses (hence the larger totals). "
        "Accuracy: exact match of all m answer coefficients by head-1 argmax "
        "(teacher-forced, which equals greedy decoding for exact match), `eval_examples` "
        "held-out examples per operation count, the same for every run; 'coef' is the "
        "per-coefficient accuracy. Floor: always giving the training distribution's most "
        "frequent answer scores "
        f"{floor['in']:.3f} in and {floor['out']:.3f} out of distribution on these examples "
        f"(uniform guessing: {uniform}). Cells: mean ± sample std over seeds, then the "
        "per-seed values.",
        "",
        settings_line(recorded, ["preset", "task.p", "task.m", "task.train_ops",
                                 "task.neg_prob", "eval_ops", "seq_len", "batch_size", "lr",
                                 "warmup_steps", "n_layers", "head_dim", "tokens_per_param",
                                 "precision", "eval_examples", "probe_examples", "probe_every"])
        + " " + steps_line(rows, "d_model"),
        "",
        markdown_table(["d_model", "params", "head-1 depth", "K", "exact in-dist",
                        "per seed", "exact out-of-dist", "per seed", "coef in-dist", "seeds"],
                       table),
        "",
        *[f"![accuracy by operations, d={d}](accuracy_by_ops_d{d}.png)" for d in sizes],
        "",
        *([fallback, ""] if fallback else []),
        *curves.section(list(trained.values()), tpp,
                        "In-distribution exact match on the probe examples every `probe_every` "
                        "steps (the out-of-distribution verdicts are judged by the same "
                        "curve: there is no out-of-distribution probe)",
                        [f"![learning curves, d={d}](curves_d{d}.png)" for d in sizes]),
        "## Which findings of the paper reproduce here",
        "",
        *findings(by, sizes, ks, floor, trained, flops),
        "",
        f"Runs: {len(rows)}; training wall time "
        f"{sum(column(rows, 'train_s')) / 60:.1f} min in total (one CPU thread each, learning-"
        "curve probes excluded).",
        "",
        provenance_line(rows),
        "",
    ]
    text = "\n".join(lines)
    (out / "README.md").write_text(text)
    return text


SPLITS = (("in", "in distribution"), ("out", "out of distribution"))


def findings(by: dict, sizes: list[int], ks: list[int], floor: dict[str, float],
             trained: dict | None = None, flops: dict | None = None) -> list[str]:
    """Each group against the floor of each split, each K = 1 baseline against a perfect score,
    then each K against K = 1 per size and split: every test joins one family, Holm's
    correction decides them together, then they render. A comparison tests the paper's finding
    only where its K = 1 baseline rose above the floor and stayed below a perfect score on the
    same split. `trained` holds each group's `curves.Convergence` ({(d, k): ...}): every verdict
    says whether its groups had converged; `flops` ({d: {k: FLOPs per token}}) the compute of
    each K."""
    trained = trained or {}

    def budget(*groups: tuple[int, int]) -> str:
        known = [trained[g] for g in groups if g in trained]
        return " " + curves.budget(*known) if known else ""

    fam = Family()
    above, below, tests = {}, {}, {}
    for d in sizes:
        base = by.get((str(d), "1"), [])
        for split, _ in SPLITS:
            for k in ks:
                if by.get((str(d), str(k))):
                    above[d, k, split] = fam.floor(column(by[(str(d), str(k))], f"acc_{split}"),
                                                   floor[split], "the majority-answer floor")
            if base:
                below[d, split] = fam.ceiling(column(base, f"acc_{split}"), 1.0,
                                              "a perfect score")
                for k in ks:
                    if k > 1 and by.get((str(d), str(k))):
                        tests[d, k, split] = fam.compare(
                            column(by[(str(d), str(k))], f"acc_{split}"),
                            column(base, f"acc_{split}"))
    fam.decide()

    out = [fam.criterion(), ""]
    for d in sizes:
        if not by.get((str(d), "1")):
            out.append(f"- d = {d}: no K = 1 baseline, nothing to compare against.")
            continue
        present = [k for k in ks if by.get((str(d), str(k)))]
        for split, where in SPLITS:
            for k in present:
                what = "the K = 1 baseline" if k == 1 else f"K = {k}"
                test = above[d, k, split]
                out.append(f"- d = {d}, {what} {where}: {test.stat()}: **{test.verdict()}**."
                           + budget((d, k)))
            out.append(f"- d = {d}, the K = 1 baseline {where} against a perfect score (room "
                       f"to improve): {below[d, split].stat()}: "
                       f"**{below[d, split].verdict()}**.{budget((d, 1))}")
        for k in (k for k in present if k > 1):
            for split, where in SPLITS:
                test = tests[d, k, split]
                why = why_untestable(f"the K = 1 baseline {where}", above[d, 1, split],
                                     below[d, split])
                verdict = "" if why else f": {test.verdict()}"
                out.append(f"- d = {d}, K = {k} vs K = 1, {where}: {test.stat()}{verdict}. "
                           "Paper: K > 1 is more accurate: "
                           f"**{finding(test.verdict(), 'higher', why)}**."
                           + budget((d, k), (d, 1)))
            out.append(curves.compute_line(f"d = {d}", k, by[(str(d), str(k))],
                                           by[(str(d), "1")], (flops or {}).get(d)))
    return out


def planned_tests(sizes: list[int], ks: list[int]) -> int:
    """The m of `findings` for a complete study: per size and split, each K against the floor
    and, with a K = 1 baseline, it against a perfect score and each K > 1 against it."""
    base = int(1 in ks)
    return len(sizes) * len(SPLITS) * (len(ks) + base * (1 + len([k for k in ks if k > 1])))


def _example_tokens(task, n_ops: int | None, n: int = 64) -> float:
    """Mean tokens of the task's examples of `n_ops` operations (None: the training mix), over
    a fixed sample."""
    import numpy as np

    return _mean(len(task.example(np.random.default_rng([7, i]), n_ops)[0]) for i in range(n))


def estimate_plan(preset: dict, costs):
    """What the preset's runs cost apart from the device (`experiments.budget.synthetic_plan`),
    the majority-answer floor included."""
    from experiments import budget

    task = _task(preset)
    lo, hi = task.train_ops
    length = {n: _example_tokens(task, n) for n in preset["eval_ops"]}
    ins = [n for n in preset["eval_ops"] if lo <= n <= hi]
    evaluated = preset["eval_examples"] * sum(length.values())
    # the floor: the most frequent of 20 000 training answers, then every evaluation example
    floor = costs.generate_s_per_token["arithmetic"] * (
        20_000 * _example_tokens(task, None) + evaluated)

    def scoring(d: int, probes: int) -> tuple[float, int, float]:
        scored = probes * preset["probe_examples"] * sum(length[n] for n in ins) + evaluated
        forwards = (probes * len(ins) * math.ceil(preset["probe_examples"] / 128)
                    + len(length) * math.ceil(preset["eval_examples"] / 128))
        return scored, forwards, floor

    return budget.synthetic_plan(preset, costs, "arithmetic", model_config, train_steps,
                                 planned_tests(preset["sizes"], preset["ks"]), scoring)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="cpu", help="`cpu`, `gpu` or a YAML path")
    parser.add_argument("--out", type=Path, default=Path("experiments/reports/arithmetic"))
    parser.add_argument("--work", type=Path, default=Path("runs/experiments/arithmetic"),
                        help="TensorBoard hyperparameter summaries (not committed)")
    parser.add_argument("--seeds", default=None, help="override the preset's seeds: 0,1,2")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs trained side by side, one CPU thread each")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--estimate", action="store_true",
                        help="print a GPU preset's runs, tokens per parameter, seeds against "
                             "power and time on one H200 by the FLOP model plus measured host "
                             "costs (experiments/budget.py); trains nothing")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        raise InputError(f"--jobs must be >= 1 (got {args.jobs})")
    single_thread()
    preset = load_preset("arithmetic", args.preset)
    if args.seeds:
        preset["seeds"] = [int(s) for s in args.seeds.split(",")]
    if args.estimate:
        from experiments.budget import estimate, load_fixed_costs

        print(estimate(estimate_plan(preset, load_fixed_costs())).text())
        return 0
    if not args.report_only:
        run(preset, args.out, args.work, args.jobs)
    print(report(args.out, command_line(), preset))
    return 0


if __name__ == "__main__":
    sys.exit(study_main(main))

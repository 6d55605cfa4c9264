"""The report of `experiments/k_sweep.py` over K (block heads): every K at matched parameters,
the depth-matched K = 1 controls, and each of the paper's findings with its test, computed from
results.csv."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from experiments import curves
from experiments.common import (
    Recorded,
    column,
    errorbar_plot,
    fit_sections,
    group,
    markdown_table,
    per_seed,
    pm,
    provenance_line,
    settings_line,
    steps_line,
    summarize,
    wall_minutes,
)
from experiments.stats import Family, finding, judged, why_untestable
from mtp.config import BYTE_LEVEL_BASE
from mtp.util.errors import InputError

#: The settings a K-sweep page lists, as its rows recorded them.
SETTINGS = ["preset", "fit_config", "fit", "depth_controls", "tokens_per_param", "eval.device",
            "eval.val_windows", "eval.humaneval_limit", "eval.mbpp_limit",
            "eval.max_new_tokens", "eval.spec_prompts", "eval.spec_prompt_tokens",
            "eval.spec_new_tokens", "eval.spec_repeat"]


def vocab_and_step_tokens(recorded: Recorded, preset: dict) -> tuple[int, int, str]:
    """The vocabulary size and training tokens per optimizer step the rows recorded (the
    verdicts need them: a uniform guess's loss, the tokens a run trained on), and "". Rows that
    recorded no settings take them from `preset` as it is today, and the third value is the
    sentence that says so."""
    resolved = recorded.get("resolved")
    if all(recorded.get("resolved", *key) is not None
           for key in (("model", "vocab_size"), ("data", "batch_size"), ("data", "seq_len"))):
        return int(resolved["model"]["vocab_size"]), tokens_per_step(resolved), ""
    sections = fit_sections(preset)
    vocab, per_step = int(sections["model"]["vocab_size"]), tokens_per_step(sections)
    return vocab, per_step, (
        "The rows recorded no vocabulary size, batch or sequence length, which the tests "
        "against a uniform guess and the scale of the findings need: they are read from "
        f"`{preset['_path']}` as it is today (vocabulary {vocab}, {per_step} training tokens a "
        "step).")


def report(out: Path, preset: dict, command: str, rows: list[dict], base_layers: int,
           note: str = "") -> str:
    """Write `<out>/README.md` and the loss / L / speedup plots from the rows of
    `<out>/results.csv`. The page describes the settings the rows recorded; `preset` (and
    `base_layers`, its `--model.n_layers`) stand in only for what the verdicts need and rows
    written before the `settings` column lack, and the page says so."""
    if not rows:
        raise InputError(f"no results in {out / 'results.csv'} (run the study without "
                         "--report-only first)")
    recorded = Recorded(rows)
    base_n = str(recorded.get("resolved", "model", "n_layers") or base_layers)
    # The sweep proper: every K at the preset's n_layers (older CSVs recorded none).
    main_rows = group([r for r in rows if r.get("n_layers", "") in ("", base_n)], ["K"])
    ks = sorted(int(k) for (k,) in main_rows)
    by = {k: main_rows[(str(k),)] for k in ks}
    # Depth-matched K = 1 controls, by the depth of their next-token path.
    controls = group([r for r in rows if r["K"] == "1" and r.get("n_layers", "") not in
                      ("", base_n)], ["head1_depth"])

    def stat(k: int, col: str) -> dict:
        return summarize(column(by[k], col))

    def series(col: str, only=lambda k: True) -> tuple[list, list, list]:
        xs = [k for k in ks if only(k) and stat(k, col)["n"]]
        return xs, [stat(k, col)["mean"] for k in xs], [stat(k, col)["std"] for k in xs]

    def control(k: int) -> list[dict]:
        return controls.get((by[k][0]["head1_depth"],), []) if by[k][0].get("head1_depth") \
            else []

    loss_series = {"next-token (head 1)": series("next_token_loss"),
                   "mean over heads": series("val_loss_mean")}
    matched = [k for k in ks if k > 1 and control(k)]
    if matched:
        cs = [summarize(column(control(k), "next_token_loss")) for k in matched]
        loss_series["K = 1 control of head 1's depth"] = (matched, [c["mean"] for c in cs],
                                                          [c["std"] for c in cs])
    vocab, per_step, fallback = vocab_and_step_tokens(recorded, preset)

    def tpp(rs: list[dict]) -> float:
        return max(int(r["steps"]) for r in rs) * per_step / int(rs[0]["params"])

    def trained(label: str, rs: list[dict]) -> curves.Convergence:
        return curves.convergence(label, curves.of(rs))

    conv = {("K", k): trained(f"K = {k}", by[k]) for k in ks}
    conv |= {("control", k): trained(f"the control of {by[k][0]['head1_depth']} blocks",
                                     control(k)) for k in matched}
    budget_tpp = {conv["K", k].label: tpp(by[k]) for k in ks}
    budget_tpp |= {conv["control", k].label: tpp(control(k)) for k in matched}
    plots = [curves.plot(out / "curves.png", {f"K = {k}": curves.of(by[k]) for k in ks},
                         ylabel="next-token validation loss (nats)",
                         title="Learning curves by K (matched parameters)")]
    if matched:
        plots.append(curves.plot(
            out / "curves_controls.png",
            {**({"K = 1": curves.of(by[1])} if 1 in ks else {}),
             **{f"control, {by[k][0]['head1_depth']} blocks":
                curves.of(control(k)) for k in matched}},
            ylabel="next-token validation loss (nats)",
            title="Learning curves of the depth-matched K = 1 controls"))
    errorbar_plot(out / "loss_vs_k.png", loss_series, xlabel="K (heads)",
                  ylabel="validation loss (nats)", logx=True,
                  title="Validation loss vs K (matched parameters)")
    errorbar_plot(out / "L_vs_k.png", {"self-speculative": series("spec_L")},
                  xlabel="K (heads)", ylabel="L (tokens per forward)", logx=True,
                  title="Accepted tokens per forward vs K")
    speed = {"vs its own greedy": series("spec_speedup", lambda k: k > 1)}
    if any(stat(k, "spec_speedup_vs_k1")["n"] for k in ks if k > 1):
        speed["vs the K = 1 model's greedy"] = series("spec_speedup_vs_k1", lambda k: k > 1)
    errorbar_plot(out / "speedup_vs_k.png", speed, xlabel="K (heads)",
                  ylabel="wall-clock speedup", logx=True, hline=1.0, hline_label="greedy",
                  title="Self-speculative speedup vs K (batch 1, CPU)")

    scale = Scale(max(int(r["params"]) for rs in by.values() for r in rs),
                  max(int(r["steps"]) for rs in by.values() for r in rs) * per_step, vocab)
    # a byte-level vocabulary: one token per byte (and the end-of-text token)
    byte_level = scale.vocab == BYTE_LEVEL_BASE
    table = []
    for k in ks:
        rs = by[k]
        heads = " / ".join(f"{stat(k, f'loss_head{i}')['mean']:.3f}" for i in range(1, k + 1))
        ident = [r["spec_identical"] for r in rs if r.get("spec_identical", "") != ""]
        bits = summarize(v / math.log(2) for v in column(rs, "next_token_loss"))
        table.append([k, rs[0]["params"], rs[0].get("head1_depth") or "–", f"{tpp(rs):.2f}",
                      len(rs),
                      pm(stat(k, "next_token_loss")), per_seed(rs, "next_token_loss"),
                      *([pm(bits)] if byte_level else []), heads, pm(stat(k, "spec_L"), 2),
                      per_seed(rs, "spec_L", 2),
                      pm(stat(k, "spec_speedup"), 2) if k > 1 else "(baseline)",
                      pm(stat(k, "spec_speedup_vs_k1"), 2) if k > 1 else "–",
                      f"{sum(int(i) for i in ident)}/{len(ident)}" if ident else "–"])
    depth_table = []
    for k in matched:
        c = control(k)
        depth_table.append([k, by[k][0]["head1_depth"], pm(stat(k, "next_token_loss")),
                            pm(summarize(column(c, "next_token_loss"))), c[0]["params"],
                            f"{tpp(c):.2f}", per_seed(c, "next_token_loss")])
    fit_min, eval_min = wall_minutes(rows)
    lines = [
        "# K sweep: matched-parameter multi-token prediction",
        "",
        "Reproduce every number and plot on this page (results are appended to `results.csv` "
        "as runs finish; rerunning the command skips finished runs and resumes an interrupted "
        "training from its `last.ckpt`; `--report-only` rewrites this page from the CSV):",
        "",
        f"```\n{command}\n```",
        "",
        *([note, ""] if note else []),
        "Each run: `mtp fit --config <fit_config>` with the overrides `fit` (both below), "
        "plus `--model.n_future K --model.matched_params true --seed_everything SEED "
        "--data.seed SEED` (K − 1 trunk blocks move into the heads, so every K has the same "
        "number of blocks and parameters; the unembedding is shared by the heads). Validation "
        "loss: the same first `eval.val_windows` validation windows (at most) for every K. "
        "HumanEval / MBPP: `mtp eval` on the first `eval.humaneval_limit` / `eval.mbpp_limit` "
        "tasks, one greedy sample, at most `eval.max_new_tokens` new tokens. "
        "Self-speculation: `eval.spec_prompts` prompts of `eval.spec_prompt_tokens` validation "
        "tokens, `eval.spec_new_tokens` new tokens each, batch 1, greedy vs `self-spec` with "
        "all K heads, one CPU thread, timed interleaved: for each prompt, `eval.spec_repeat` "
        "rounds of the model's greedy, its self-spec and the K = 1 model's greedy in a "
        "rotating order, the median round per prompt. Cells: mean ± sample std over seeds "
        "(error bars in the plots: ± 1 std); `head-1 depth` is the number of blocks on the "
        "next-token path.",
        "",
        settings_line(recorded, SETTINGS) + " " + steps_line(rows, "K"),
        "",
        *([fallback, ""] if fallback else []),
        *(["A byte-level model: the vocabulary is the 256 bytes and the end-of-text token, "
           "so one token is one byte and bits per byte are the next-token loss / ln 2.", ""]
          if byte_level else []),
        markdown_table(["K", "params", "head-1 depth", "tokens/param", "seeds",
                        "next-token loss", "per seed",
                        *(["bits per byte"] if byte_level else []),
                        "loss per head (1..K, mean)", "L", "L per seed", "speedup",
                        "speedup vs K = 1 greedy", "self-spec = greedy"], table),
        "",
    ]
    if depth_table:
        lines += [
            "### Depth: the objective apart from the lost blocks",
            "",
            "Matched parameters move K − 1 blocks from the trunk into the heads, so head 1's "
            "path gets shallower as K grows. Each K > 1 therefore has a K = 1 control of the "
            "same next-token depth (`--model.n_layers` = n_layers + 1 − K, same data, steps "
            "and seeds): K against its control is the cost of the objective at equal depth, "
            "the control against the full K = 1 model the cost of the lost depth.",
            "",
            markdown_table(["K", "head-1 depth", "K's next-token loss",
                            "control's next-token loss", "control params",
                            "control tokens/param", "control per seed"],
                           depth_table),
            "",
        ]
    lines += [
        "![validation loss vs K](loss_vs_k.png) ![L vs K](L_vs_k.png) "
        "![speedup vs K](speedup_vs_k.png)",
        "",
        *curves.section(list(conv.values()), budget_tpp,
                        curves.FIT_METRIC, [p for p in plots if p]),
        "## Which findings of the paper reproduce here",
        "",
        *verdicts(by, ks, control, byte_level, scale, conv),
        "",
        f"Runs: {len(rows)}; {fit_min:.1f} min training + {eval_min:.1f} min evaluation (one "
        "CPU thread each). Losses, accuracies and L do not depend on machine load; timings "
        "do.",
        "",
        provenance_line(rows),
        "",
    ]
    text = "\n".join(lines)
    (out / "README.md").write_text(text)
    return text


def verdicts(by: dict, ks: list[int], control, byte_level: bool, scale: Scale,
             conv: dict) -> list[str]:
    """Each of the paper's findings the numbers can speak to, with its test: every test is
    added to one family first, Holm's correction decides them together, then they render.
    `conv` holds each group's `curves.Convergence` ({("K", k) or ("control", k): ...}): every
    verdict says whether its groups had converged."""
    multi = [k for k in ks if k > 1]
    steps = list(zip(ks, ks[1:]))
    fam = Family()

    def loss(rs: list[dict]) -> list[float]:
        return column(rs, "next_token_loss")

    # -- the tests: every comparison, every baseline against chance, every speedup against 1
    learned, vs_k1, objective, depth = {}, {}, {}, {}
    if 1 in ks:
        learned[1] = fam.against(loss(by[1]), scale.chance, "a uniform guess's loss", "less")
        for k in multi:
            vs_k1[k] = fam.compare(loss(by[k]), loss(by[1]))
            if control(k):
                learned[k] = fam.against(loss(control(k)), scale.chance,
                                         "a uniform guess's loss", "less")
                objective[k] = fam.compare(loss(by[k]), loss(control(k)))
                depth[k] = fam.compare(loss(control(k)), loss(by[1]))
    lengths = {(a, b): fam.compare(column(by[b], "spec_L"), column(by[a], "spec_L"), 2)
               for a, b in steps}
    speedups = {}
    for col in ("spec_speedup", "spec_speedup_vs_k1"):
        for k in multi:
            v = [x for x in column(by[k], col) if x == x]
            if v:
                speedups[col, k] = fam.against(v, 1.0, "a speedup", digits=2)
    fam.decide()

    # -- the page
    out = [fam.criterion(), ""]
    chance = f"a uniform guess's loss (ln {scale.vocab}; whether it learned)"

    def budget(*groups: tuple) -> str:
        return curves.budget(*(conv[g] for g in groups))

    if 1 in ks:
        why = {1: why_untestable("the K = 1 model", learned[1])}
        out.append(f"- Next-token loss of the K = 1 model against {chance}: "
                   f"{learned[1].stat()}: **{learned[1].verdict()}**. {budget(('K', 1))}")
        # K -> (its next-token verdict against the depth-matched control where one ran, else
        # against K = 1 at equal parameters; whether it was the control)
        against = {}
        for k in multi:
            against[k] = (judged(vs_k1[k], why[1]), False)
            out.append(f"- Next-token loss, K = {k} vs K = 1 at equal parameters: "
                       f"{vs_k1[k].stat()}: **{against[k][0]}**. "
                       f"{budget(('K', k), ('K', 1))}")
            if k in objective:
                blocks = by[k][0]["head1_depth"]
                why[k] = why_untestable(f"the K = 1 control of {blocks} blocks", learned[k])
                against[k] = (judged(objective[k], why[k]), True)
                out += [f"  - the K = 1 control of head 1's depth ({blocks} blocks) against "
                        f"{chance}: {learned[k].stat()}: **{learned[k].verdict()}**. "
                        f"{budget(('control', k))}",
                        f"  - K = {k} against the K = 1 control of head 1's depth ({blocks} "
                        f"blocks), the objective itself: {objective[k].stat()}: "
                        f"**{against[k][0]}**. {budget(('K', k), ('control', k))}",
                        f"  - the control of {blocks} blocks against the full K = 1 model, the "
                        f"lost depth: {depth[k].stat()}: **{judged(depth[k], why[1])}**. "
                        f"{budget(('control', k), ('K', 1))}"]

        by_k = {k: verdict for k, (verdict, _) in against.items()}

        def outcomes() -> str:
            return "; ".join(f"K = {k}: {verdict} (against "
                             + ("its depth-matched control)" if controlled else
                                "K = 1 at equal parameters; no depth-matched control ran)")
                             for k, (verdict, controlled) in against.items())

        if byte_level and against:
            out.append("- Gloeckle et al.: byte-level models gain the most from multi-token "
                       "prediction (K = 8 bytes beat K = 1 by a wide margin): "
                       f"{scale.status(PAPER_BYTES, 'lower', by_k)}. What this scale shows, bits "
                       f"per byte (nats / ln 2; the tests above are in nats): {outcomes()}. "
                       "The paper also finds that below about a billion parameters "
                       "multi-token prediction scores lower than next-token prediction, which "
                       "predicts the opposite at this size.")
        if against:
            out.append("- Gloeckle et al.: at its smallest sizes multi-token prediction scores "
                       "lower than next-token prediction (it helps from a few billion "
                       f"parameters on): {scale.status(PAPER_SMALL, 'higher', by_k)}. What this "
                       f"scale shows, next-token loss: {outcomes()}.")
    for (a, b), test in lengths.items():
        out.append(f"- L, K = {b} vs K = {a}: {test.stat()}: **{test.verdict()}**. "
                   f"{budget(('K', b), ('K', a))}")
    if lengths:
        ls = [summarize(column(by[k], "spec_L"))["mean"] for k in ks]
        out.append("  Paper: L of about 3.5 at K = 4 on 7B models; here "
                   + ", ".join(f"{v:.2f}" for v in ls) + " for K = " + ", ".join(map(str, ks))
                   + ".")
    for (col, k), test in speedups.items():
        what = ("its own greedy" if col == "spec_speedup" else "the K = 1 model's greedy "
                "(a different model, whose head 1 sits deeper: this compares two models, not "
                "the paper's speedup over a model's own greedy)")
        out.append(f"- Self-speculative wall-clock speedup of K = {k} against {what}: "
                   f"{test.stat()}: **{test.verdict('faster', 'slower')}**. "
                   + budget(("K", k), *([("K", 1)] if col != "spec_speedup" and 1 in ks else [])))
    ident = [r["spec_identical"] for k in multi for r in by[k]
             if r.get("spec_identical", "") != ""]
    out.append(f"- Greedy self-speculative output equals plain greedy output in "
               f"{sum(int(i) for i in ident)} of {len(ident)} runs (required: all).")
    solved = max((x for k in ks for c in ("humaneval_pass@1", "mbpp_pass@1")
                  for x in column(by[k], c) if x == x), default=float("nan"))
    if solved == solved:
        out.append("- HumanEval / MBPP pass@1 (paper: K = 4 beats K = 1 at several billion "
                   "parameters): " + ("**not testable at this scale**: no model solves a "
                                      "task." if solved == 0 else
                                      f"the best run solves {solved:.2f}; see the table."))
    return out


def planned_tests(ks: list[int], depth_controls: bool) -> int:
    """The m of `verdicts` for a complete sweep of `ks` (every group of 5 or more seeds): the
    seeds a GPU preset needs for its power follow from it (`experiments.budget`)."""
    multi = len([k for k in ks if k > 1])
    base = int(1 in ks)  # K = 1 against chance; each K > 1 against it; its timed greedy
    controls = base * int(bool(depth_controls))  # chance, objective and depth per control
    return base + multi * (base + 3 * controls + 1 + base) + max(0, len(ks) - 1)


def planned_scan_tests(widths: list[int], ks: list[int]) -> int:
    """The m of `scan_report` for a complete scan: per width, K = 1 against chance and each
    K > 1 against K = 1."""
    return len(widths) * (1 + len([k for k in ks if k > 1])) if 1 in ks else 0


def scan_report(out: Path, preset: dict, command: str, by_width: dict[int, list[dict]],
                base_layers: int) -> str:
    """Write `<out>/README.md` and `<out>/loss_vs_params.png` of a size scan (a K sweep per
    width, each with its own page under `<out>/d<width>/`); `base_layers` is the preset's
    `--model.n_layers`. Runs are grouped by K and n_layers, so a depth-matched K = 1 control
    is a group of its own and never part of the K = 1 baseline. As on a sweep's page, the
    settings are the rows' (`preset` stands in where rows recorded none, and the page says
    so)."""
    widths = [w for w, rows in by_width.items() if rows]
    if not widths:
        raise InputError(f"no results under {out}/d<width>/results.csv (run the scan without "
                         "--report-only first)")
    base_n = str(base_layers)
    # (K, n_layers) -> rows; older CSVs recorded no n_layers: those runs are the sweep proper
    groups = {w: group([{**r, "n_layers": r.get("n_layers") or base_n} for r in by_width[w]],
                       ["K", "n_layers"]) for w in widths}
    keys = sorted({(int(k), int(n)) for w in widths for k, n in groups[w]},
                  key=lambda kn: (kn[0], -kn[1]))
    ks = sorted({k for k, n in keys if n == base_layers})
    multi = [k for k in ks if k > 1]

    def rows_of(w: int, k: int, n: int = base_layers) -> list[dict]:
        return groups[w].get((str(k), str(n)), [])

    series = {}
    for k in ks:
        xs = [w for w in widths if rows_of(w, k)]
        stats = [summarize(column(rows_of(w, k), "next_token_loss")) for w in xs]
        series[f"K = {k}"] = ([int(rows_of(w, k)[0]["params"]) for w in xs],
                              [s["mean"] for s in stats], [s["std"] for s in stats])
    errorbar_plot(out / "loss_vs_params.png", series, xlabel="parameters (matched across K)",
                  ylabel="next-token validation loss (nats)", logx=True,
                  title="Size scan: next-token loss by K")

    fam, learned, tests = Family(), {}, {}
    inputs = {w: vocab_and_step_tokens(Recorded(by_width[w]), preset) for w in widths}
    for w in widths:
        vocab = inputs[w][0]
        if rows_of(w, 1):
            learned[w] = fam.against(column(rows_of(w, 1), "next_token_loss"), math.log(vocab),
                                     "a uniform guess's loss", "less")
        for k in multi:
            if rows_of(w, k) and rows_of(w, 1):
                tests[w, k] = fam.compare(column(rows_of(w, k), "next_token_loss"),
                                          column(rows_of(w, 1), "next_token_loss"))
    fam.decide()

    table, lines_out, deltas = [], [fam.criterion(), ""], {k: [] for k in multi}
    for w in widths:
        for k, n in keys:
            rs = rows_of(w, k, n)
            if not rs:
                continue
            steps = max(int(r["steps"]) for r in rs)
            table.append([w, rs[0]["params"], rs[0]["head1_depth"],
                          k if n == base_layers else f"{k} (depth control, n_layers {n})",
                          steps, f"{steps * inputs[w][1] / int(rs[0]['params']):.2f}",
                          len(rs), pm(summarize(column(rs, "next_token_loss"))),
                          per_seed(rs, "next_token_loss"),
                          pm(summarize(column(rs, "spec_L")), 2)])
        vocab, per_step, _ = inputs[w]

        def trained(k: int) -> curves.Convergence:
            return curves.convergence(f"K = {k}", curves.of(rows_of(w, k)))

        if w in learned:
            lines_out.append(f"- d = {w}, next-token loss of K = 1 against a uniform guess's "
                             f"loss (ln {vocab}; whether it learned): {learned[w].stat()}: "
                             f"**{learned[w].verdict()}**. {curves.budget(trained(1))}")
        for k in multi:
            if (w, k) not in tests:
                continue
            test = tests[w, k]
            deltas[k].append((w, test.diff))
            scale = Scale(int(rows_of(w, k)[0]["params"]),
                          max(int(r["steps"]) for r in rows_of(w, k)) * per_step, vocab)
            verdict = judged(test, why_untestable("the K = 1 model", learned.get(w)))
            lines_out.append(f"- d = {w}, next-token loss of K = {k} vs K = 1: {test.stat()}: "
                             f"**{verdict}**"
                             ". Paper (at its smallest sizes multi-token prediction scores "
                             "lower): "
                             f"{scale.status(PAPER_SMALL, 'higher', {k: verdict})}. "
                             + curves.budget(trained(k), trained(1)))
    for k, ds in deltas.items():
        if len(ds) > 1:
            shrinks = all(b < a for (_, a), (_, b) in zip(ds, ds[1:]))
            lines_out.append(
                f"- K = {k}, how the difference from K = 1 moves with width (a description, "
                "not a test): " + ", ".join(f"{d:+.3f} at d = {w}" for w, d in ds)
                + (": it shrinks at every step up in width." if shrinks else
                   ": it does not shrink at every step up in width."))
    fallback = next((why for _, _, why in inputs.values() if why), "")
    everything = Recorded([r for w in widths for r in by_width[w]])
    lines = [
        "# Size scan: multi-token prediction across model widths",
        "",
        "Reproduce every number and plot on this page and the per-width pages (`--report-only` "
        "rewrites them from their CSVs):",
        "",
        f"```\n{command}\n```",
        "",
        f"K in {{{', '.join(map(str, ks))}}} at widths {', '.join(map(str, widths))} "
        "(`head_dim` wide attention heads), matched parameters, each width trained for the "
        "steps in the table (tokens per parameter: steps x the tokens of a step / the "
        "parameters). Each width's sweep, with its acceptance, speedups and depth table, and "
        "its settings, is on its own page: "
        + ", ".join(f"[d = {w}](d{w}/README.md)" for w in widths) + ". Cells: mean ± "
        "sample std over seeds, then per-seed values.",
        "",
        settings_line(everything, ["preset", "fit_config", "head_dim", "tokens_per_param",
                                   "resolved.data.source", "resolved.model.vocab_size",
                                   "resolved.data.seq_len", "resolved.data.batch_size"],
                      ignore=("fit.", "resolved.")),
        "",
        *([fallback, ""] if fallback else []),
        markdown_table(["d_model", "params", "head-1 depth", "K", "steps", "tokens/param",
                        "seeds", "next-token loss", "per seed", "L"], table),
        "",
        "![next-token loss vs parameters](loss_vs_params.png)",
        "",
        "## Which findings of the paper reproduce here",
        "",
        *lines_out,
        "",
        provenance_line([r for w in widths for r in by_width[w]]),
        "",
    ]
    text = "\n".join(lines)
    (out / "README.md").write_text(text)
    return text


# -- the paper's scale -------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """Where a finding of the paper was measured: model parameters, training tokens (bytes for
    a byte-level model) in `unit`, and the measure it reports."""

    params: float
    tokens: float
    unit: str
    measure: str


#: Section 3.1: models of 300M to 13B parameters on at least 91B tokens of code, MBPP and
#: HumanEval pass@k; multi-token prediction is behind at the smallest sizes.
PAPER_SMALL = Setting(300e6, 91e9, "tokens of code", "pass@1 on MBPP and HumanEval")
#: Section 3.3: 7B-parameter byte-level models on 314B bytes.
PAPER_BYTES = Setting(7e9, 314e9, "bytes", "pass@1 on MBPP and HumanEval")
#: A study is at a finding's scale where it measures what the paper measured, with at least
#: this share of the paper's parameters and training tokens.
COMPARABLE_SHARE = 0.1


@dataclass(frozen=True)
class Scale:
    """A sweep's scale: its models' parameters, the tokens each trained on, its vocabulary, and
    what it measures."""

    params: int
    tokens: int
    vocab: int
    measure: str = "next-token validation loss"

    @property
    def chance(self) -> float:
        """The loss of a uniform guess over the vocabulary, ln V."""
        return math.log(self.vocab)

    def gap(self, paper: Setting) -> str | None:
        """Why the sweep cannot test a finding measured at `paper`'s setting (both scales and
        measures), or None where it measures the same at `COMPARABLE_SHARE` of its scale."""
        if (self.measure == paper.measure and self.params >= COMPARABLE_SHARE * paper.params
                and self.tokens >= COMPARABLE_SHARE * paper.tokens):
            return None
        unit = "bytes" if self.vocab == BYTE_LEVEL_BASE else "tokens"
        return (f"here {_count(self.params)} parameters trained on {_count(self.tokens)} "
                f"{unit}, measured by {self.measure}; the paper {_count(paper.params)} "
                f"parameters trained on {_count(paper.tokens)} {paper.unit}, measured by "
                f"{paper.measure}")

    def status(self, paper: Setting, predicted: str, verdicts: dict[int, str]) -> str:
        """A finding's status: `not testable at this scale` with both scales where the sweep
        is not at the paper's, else each K's `finding` from its verdict (`predicted`: the
        paper's direction)."""
        gap = self.gap(paper)
        if gap:
            return f"**not testable at this scale** ({gap})"
        return "; ".join(f"K = {k}: **{finding(v, predicted)}**" for k, v in verdicts.items())


def _count(x: float) -> str:
    """0.55M, 300M, 7B, 314B."""
    if x >= 1e9:
        return f"{x / 1e9:.3g}B"
    return f"{x / 1e6:.2g}M" if x < 1e6 else f"{x / 1e6:.3g}M"


def tokens_per_step(sections: dict) -> int:
    """Training tokens of one optimizer step of `mtp fit` sections: batch x sequence length (x
    gradient accumulation and devices)."""
    trainer = sections.get("trainer", {})
    devices = trainer.get("devices", 1)
    return (int(sections["data"]["batch_size"]) * int(sections["data"]["seq_len"])
            * int(trainer.get("accumulate_grad_batches", 1))
            * (devices if isinstance(devices, int) and devices > 1 else 1))

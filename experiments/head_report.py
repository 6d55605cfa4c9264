"""The report of `experiments/k_sweep.py --head-types ...`: head types compared at equal steps and
(nearly) equal parameters, every verdict computed from results.csv with its test beside it."""

from __future__ import annotations

import math
from pathlib import Path

from experiments import curves
from experiments.common import (
    Recorded,
    column,
    errorbar_plot,
    group,
    markdown_table,
    per_seed,
    pm,
    provenance_line,
    settings_line,
    steps_line,
    summarize,
    to_float,
    wall_minutes,
)
from experiments.k_report import SETTINGS, vocab_and_step_tokens
from experiments.stats import Family, judged, why_untestable
from mtp.util.errors import InputError


def report(out: Path, preset: dict, head_types: list[str], command: str, rows: list[dict],
           note: str = "") -> str:
    """Write `<out>/README.md` and `<out>/acceptance.png`; returns the page. The page describes
    the settings the rows recorded (`preset` stands in only for the vocabulary of rows that
    recorded none, and the page says so)."""
    if not rows:
        raise InputError(f"no results in {out / 'results.csv'} (run the study without "
                         "--report-only first)")
    by = group(rows, ["head_type", "K"])
    ks = sorted({int(k) for _, k in by if int(k) > 1})
    base = by.get(("block", "1"), [])
    k_top = max(ks) if ks else 1
    positions = list(range(1, k_top))

    series = {}
    for h in head_types:
        rs = by.get((h, str(k_top)), [])
        if rs:
            stats = [summarize(column(rs, f"accept_pos{i}")) for i in positions]
            series[h] = (positions, [s["mean"] for s in stats], [s["std"] for s in stats])
    if series:
        errorbar_plot(out / "acceptance.png", series, xlabel="draft position (head i + 1)",
                      ylabel="acceptance rate (given the earlier drafts were)",
                      title=f"Per-position acceptance at K = {k_top}, by head type")

    recorded = Recorded(rows)
    vocab, per_step, fallback = vocab_and_step_tokens(recorded, preset)
    groups = [("K = 1 baseline", base)] + [(f"{h} at K = {k}", by.get((h, str(k)), []))
                                           for h in head_types for k in ks]
    conv = {label: curves.convergence(label, curves.of(rs)) for label, rs in groups if rs}
    tpp = {label: max(int(r["steps"]) for r in rs) * per_step / int(rs[0]["params"])
           for label, rs in groups if rs}
    plot = curves.plot(out / "curves.png", {label: curves.of(rs) for label, rs in groups if rs},
                       ylabel="next-token validation loss (nats)",
                       title="Learning curves by head type")

    header = ["head type", "K", "params", "head-1 depth", "tokens/param", "seeds",
              "next-token loss",
              "per seed", "L", *[f"accept {i}" for i in positions], "speedup vs own greedy",
              "speedup vs K = 1 greedy", "self-spec = greedy"]
    table = []
    for (h, k), rs in [((("block", "1")), base)] + [((h, str(k)), by.get((h, str(k)), []))
                                                      for h in head_types for k in ks]:
        if not rs:
            continue
        ident = [r["spec_identical"] for r in rs if r.get("spec_identical", "") != ""]
        table.append([
            h if k != "1" else "K = 1 baseline", k, rs[0]["params"], rs[0]["head1_depth"],
            f"{tpp['K = 1 baseline' if k == '1' else f'{h} at K = {k}']:.2f}", len(rs),
            pm(summarize(column(rs, "next_token_loss"))),
            per_seed(rs, "next_token_loss"), pm(summarize(column(rs, "spec_L")), 2),
            *[pm(summarize(column(rs, f"accept_pos{i}")), 2) if i < int(k) else "–"
              for i in positions],
            pm(summarize(column(rs, "spec_speedup")), 2) if k != "1" else "–",
            pm(summarize(column(rs, "spec_speedup_vs_k1")), 2) if k != "1" else "–",
            f"{sum(int(i) for i in ident)}/{len(ident)}" if ident else "–"])

    findings = _findings(by, head_types, ks, base, vocab, conv)
    fit_min, eval_min = wall_minutes(rows)
    lines = [
        "# Head types: block, linear, Medusa and DeepSeek-V3 MTP heads",
        "",
        "Reproduce every number and plot on this page (`--report-only` rewrites the page from "
        "`results.csv`):",
        "",
        f"```\n{command}\n```",
        "",
        *([note, ""] if note else []),
        "Each run: `mtp fit --config <fit_config>` with the overrides `fit` (both below), the "
        "same data, steps and seeds for every run. Parameters: block and deepseek heads get "
        "`--model.matched_params true` (K − 1 trunk blocks move into the heads; a deepseek "
        "module adds a 2d × d projection and two norm gains); linear and medusa heads hold no "
        "block, so their trunk keeps all `fit.model.n_layers` + 1 blocks and their K d × d "
        "maps are what they add. The `params` column gives each count; `head-1 depth` the "
        "blocks on the next-token path, which differs between head types and is the main "
        "confound of their next-token losses. K = 1 is the next-token baseline (the same model "
        "for block and deepseek heads). Self-speculation: greedy `self-spec` with all heads, "
        "`eval.spec_prompts` prompts of `eval.spec_prompt_tokens` validation tokens, "
        "`eval.spec_new_tokens` new tokens, batch 1, one CPU thread. Timing is interleaved: "
        "for each prompt, `eval.spec_repeat` rounds of greedy, self-spec and the K = 1 model's "
        "greedy in a rotating order, the median round per prompt. `accept i`: the rate at "
        "which draft i (head i + 1's) was accepted in rounds where drafts 1..i − 1 were. "
        "Cells: mean ± sample std over seeds.",
        "",
        settings_line(recorded, SETTINGS) + " " + steps_line(rows, "K"),
        "",
        *([fallback, ""] if fallback else []),
        markdown_table(header, table),
        "",
        *(["![per-position acceptance](acceptance.png)", ""] if series else []),
        *curves.section(list(conv.values()), tpp,
                        curves.FIT_METRIC, [plot] if plot else []),
        "## Findings",
        "",
        *findings,
        "",
        f"Runs: {len(rows)}; {fit_min:.1f} min training + {eval_min:.1f} min evaluation.",
        "",
        provenance_line(rows),
        "",
    ]
    text = "\n".join(lines)
    (out / "README.md").write_text(text)
    return text


def planned_tests(head_types: list[str], ks: list[int]) -> int:
    """The m of the findings for a complete sweep of `head_types` at `ks` (K = 1 included): the
    baseline against chance, each head type and K > 1 against it, and at the largest K each
    draft position's acceptance of deepseek against each other head type."""
    multi = [k for k in ks if k > 1]
    parallel = [h for h in head_types if h != "deepseek"]
    cascaded = "deepseek" in head_types and multi
    return (1 + len(head_types) * len(multi)
            + (len(parallel) * (max(multi) - 1) if cascaded else 0))


def _findings(by: dict, head_types: list[str], ks: list[int], base: list[dict],
              vocab: int | None, conv: dict) -> list[str]:
    """Each finding with its test: every test joins one family first, Holm's correction
    decides them together, then they render. `conv` holds each group's
    `curves.Convergence` by its label (`K = 1 baseline`, `<head type> at K = <k>`): every
    verdict says whether its groups had converged."""
    k_top = max(ks) if ks else 1
    parallel = [h for h in head_types if h != "deepseek"]
    cascaded = by.get(("deepseek", str(k_top)), []) if "deepseek" in head_types else []
    fam = Family()
    learned = (fam.against(column(base, "next_token_loss"), math.log(vocab),
                           "a uniform guess's loss", "less") if base and vocab else None)
    losses = {(h, k): fam.compare(column(by[(h, str(k))], "next_token_loss"),
                                  column(base, "next_token_loss"))
              for h in head_types for k in ks if by.get((h, str(k))) and base}
    acceptance = {(h, i): fam.compare(column(cascaded, f"accept_pos{i}"),
                                      column(by[(h, str(k_top))], f"accept_pos{i}"))
                  for h in parallel if cascaded and by.get((h, str(k_top)))
                  for i in range(1, k_top)}
    fam.decide()

    out = [fam.criterion(), ""]
    if learned is not None:
        out.append(f"- Next-token loss of the K = 1 baseline against a uniform guess's loss "
                   f"(ln {vocab}; whether it learned): {learned.stat()}: "
                   f"**{learned.verdict()}**. {curves.budget(conv['K = 1 baseline'])}")
    why = why_untestable("the K = 1 baseline", learned)
    for (h, k), test in losses.items():
        rs = by[(h, str(k))]
        out.append(f"- Next-token loss, {h} heads at K = {k} vs the K = 1 baseline: "
                   f"{test.stat()}: **{judged(test, why)}** "
                   f"(head-1 depth {rs[0]['head1_depth']} vs {base[0]['head1_depth']} blocks). "
                   + curves.budget(conv[f"{h} at K = {k}"], conv["K = 1 baseline"]))
    for h in head_types:
        rs = by.get((h, str(k_top)), [])
        if not rs or k_top < 3:
            continue
        means = [summarize(column(rs, f"accept_pos{i}"))["mean"] for i in range(1, k_top)]
        falls = sum(all(to_float(r[f"accept_pos{i + 1}"]) < to_float(r[f"accept_pos{i}"])
                        for i in range(1, k_top - 1)) for r in rs)
        # the chance that draft i is accepted at all: the product of the rates up to it
        reach = []
        for r in rs:
            p, seq = 1.0, []
            for i in range(1, k_top):
                p *= to_float(r[f"accept_pos{i}"])
                seq.append(p)
            reach.append(seq)
        reached = [summarize(seq[i] for seq in reach)["mean"] for i in range(k_top - 1)]
        out.append(f"- Acceptance by draft position, {h} heads (K = {k_top}): given the "
                   f"earlier drafts were accepted {' → '.join(f'{v:.2f}' for v in means)}, "
                   f"falling at every position in {falls} of {len(rs)} seeds (a conditional "
                   "rate may rise with depth: only rounds whose earlier drafts were accepted "
                   "count); accepted at all (the product up to each draft) "
                   f"{' → '.join(f'{v:.2f}' for v in reached)}.")
    for (h, i), test in acceptance.items():
        out.append(f"- Acceptance of draft {i}, deepseek vs {h} heads (K = {k_top}): "
                   f"{test.stat()}: deepseek **{test.verdict()}**. "
                   + curves.budget(conv[f"deepseek at K = {k_top}"], conv[f"{h} at K = {k_top}"]))
    if acceptance:
        out.append("  DeepSeek-V3 reports 85–90% acceptance for its first draft (one MTP "
                   "module, 671B parameters); the claim that a chain conditioned on its own "
                   "drafts is accepted more often than independent heads is what the rows "
                   "above test at this scale.")
    ls = {h: summarize(column(by.get((h, str(k_top)), []), "spec_L"))["mean"]
          for h in head_types if by.get((h, str(k_top)))}
    if ls:
        best = max(ls, key=ls.get)
        out.append(f"- L at K = {k_top} (means; a description, not a test): "
                   + ", ".join(f"{h} {v:.2f}" for h, v in ls.items())
                   + f"; the highest mean is {best}'s.")
        sp = {h: summarize(column(by[(h, str(k_top))], "spec_speedup_vs_k1"))["mean"]
              for h in ls}
        own = {h: summarize(column(by[(h, str(k_top))], "spec_speedup"))["mean"] for h in ls}
        out.append("- Wall-clock speedup of self-speculation at K = "
                   f"{k_top} (one CPU thread, batch 1; means, a description, not a test), "
                   "against the model's own greedy / the K = 1 model's greedy (a different model): "
                   + ", ".join(f"{h} {own[h]:.2f}x / {sp[h]:.2f}x" for h in ls) + ".")
    ident = [r["spec_identical"] for h in head_types for k in ks
             for r in by.get((h, str(k)), []) if r.get("spec_identical", "") != ""]
    out.append(f"- Greedy self-speculative output equals plain greedy output in "
               f"{sum(int(i) for i in ident)} of {len(ident)} runs (required: all).")
    return out

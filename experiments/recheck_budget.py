"""Recheck the training budget the committed reports state, from their CSVs and apart from
`experiments/curves.py` (part of `python -m experiments.recheck`).

For each study page this lists the groups of runs from the CSV on its own, and from each run's
`curve` recomputes with numpy what the page's **Learning curves and budget** table prints:
steps, tokens per parameter (training tokens over the run's parameters), seeds, the mean
change over the last 20% of the steps (`numpy.polyfit` slope through the points there, times
that stretch), its standard error, the seed spread of the last values, and whether the group
converged (the change no larger than the spread and than twice its standard error). Every line
that prints a test must end its verdict with `Trained: converged (...)`, naming only groups
that converged, or `Trained: at a fixed budget of N steps (...)`, naming only groups that did
not.
"""

from __future__ import annotations

import csv
import json
import math
import re
from collections import Counter
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
SHARE = 0.2
#: The preset each committed page's runs were planned from (their rows may predate the
#: `settings` column that records the batch and sequence length).
PRESETS = {"k_sweep": "k_sweep_cpu", "bytes": "k_sweep_bytes_cpu",
           "head_types": "k_sweep_heads_cpu", "induction": "induction_cpu",
           "arithmetic": "arithmetic_cpu"}


def groups(study: str, rows: list[dict]) -> dict[str, list[dict]]:
    """The page's groups of runs by the label its table gives them."""
    out: dict[str, list[dict]] = {}
    if study in ("induction", "arithmetic"):
        for r in rows:
            out.setdefault(f"d = {r['d_model']}, K = {r['K']}", []).append(r)
    elif study == "head_types":
        for r in rows:
            label = ("K = 1 baseline" if r["K"] == "1" else
                     f"{r['head_type']} at K = {r['K']}")
            out.setdefault(label, []).append(r)
    else:
        main_n = Counter(r["n_layers"] for r in rows if r["K"] != "1").most_common(1)[0][0]
        for r in rows:
            label = (f"K = {r['K']}" if r["n_layers"] == main_n else
                     f"the control of {r['head1_depth']} blocks")
            out.setdefault(label, []).append(r)
    return out


def step_tokens(study: str, row: dict) -> int:
    """Training tokens of one optimizer step of a run: its recorded settings, else its preset."""
    settings = json.loads(row["settings"]) if row.get("settings") else None
    if study in ("induction", "arithmetic"):
        s = settings or yaml.safe_load(_preset(study).read_text())
        return int(s["batch_size"]) * int(s["seq_len"])
    data = (settings["resolved"]["data"] if settings else
            yaml.safe_load(_preset(study).read_text())["fit"]["data"])
    return int(data["batch_size"]) * int(data["seq_len"])


def _preset(study: str) -> Path:
    return REPO / "experiments" / "presets" / f"{PRESETS[study]}.yaml"


def budget(curves: list[list[list[float]]]) -> dict:
    """A group's closing change, its standard error, seed spread and convergence."""
    changes = []
    for c in curves:
        steps, values = np.array([s for s, _ in c], float), np.array([v for _, v in c])
        start = (1 - SHARE) * steps[-1]
        window = steps >= start
        changes.append(np.polyfit(steps[window], values[window], 1)[0] * (steps[-1] - start)
                       if window.sum() >= 2 else math.nan)
    n = len(curves)
    change = float(np.mean(changes))
    se = float(np.std(changes, ddof=1) / math.sqrt(n)) if n > 1 else math.nan
    spread = float(np.std([c[-1][1] for c in curves], ddof=1)) if n > 1 else math.nan
    known = not (math.isnan(change) or math.isnan(se) or math.isnan(spread))
    return {"change": change, "se": se, "spread": spread,
            "converged": known and abs(change) <= min(spread, 2 * se), "known": known}


def check(study: str, reports: Path) -> list[str]:
    """Every problem of one page's budget (empty: it recomputes)."""
    with open(reports / study / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    page = (reports / study / "README.md").read_text().splitlines()
    if "### Learning curves and budget" not in page:
        return [f"{study}: no learning-curve section"]
    start = page.index("### Learning curves and budget")
    table = [[c.strip() for c in line.strip("|").split("|")] for line in page[start:]
             if line.startswith("| ") and not line.startswith("| group")]
    printed = {cells[0]: cells for cells in table if len(cells) == 8}
    problems, converged = [], {}
    for label, rs in groups(study, rows).items():
        if label not in printed:
            problems.append(f"{study}: group {label!r} is not in the learning-curve table")
            continue
        _, steps, tpp, seeds, change, se, spread, flag = printed[label]
        b = budget([json.loads(r["curve"]) for r in rs])
        converged[label] = b["converged"]
        tokens = int(rs[0]["steps"]) * step_tokens(study, rs[0]) / int(rs[0]["params"])
        want = {"steps": str(max(int(r["steps"]) for r in rs)), "seeds": str(len(rs)),
                "converged": "yes" if b["converged"] else "no" if b["known"] else "not judged"}
        got = {"steps": steps, "seeds": seeds, "converged": flag}
        problems += [f"{study}: {label}: {key} {got[key]!r} printed, {v!r} recomputed"
                     for key, v in want.items() if got[key] != v]
        for key, shown, value, tol in (("tokens/param", tpp, tokens, 0.006),
                                       ("change", change, b["change"], 6e-4),
                                       ("its std error", se, b["se"], 6e-4),
                                       ("seed spread", spread, b["spread"], 6e-4)):
            if not math.isclose(float(shown), value, abs_tol=tol):
                problems.append(f"{study}: {label}: {key} {shown} printed, {value:.4f} "
                                "recomputed")
    labels = sorted(converged, key=len, reverse=True)
    for line in page:
        if "Holm-adjusted p = " not in line and "(n = " not in line:
            continue
        if "Trained: " not in line:
            problems.append(f"{study}: a verdict without its budget: {line[:90]}")
            continue
        clause = line[line.index("Trained: "):]
        named = [g for g in labels if re.search(r"(?:\(|; )" + re.escape(g)
                                                 + r" (?:[+-]\d|still moving|not judged)",
                                                 clause)]
        if clause.startswith("Trained: converged ("):
            bad = [g for g in named if not converged[g]]
        elif clause.startswith("Trained: at a fixed budget of "):
            bad = [g for g in named if converged[g]]
        else:
            bad = ["(neither converged nor a fixed budget)"]
        if not named or bad:
            problems.append(f"{study}: budget {clause[:60]!r} names {named or 'no group'}, "
                            f"wrongly {bad}")
    return problems

"""Learning curves and what they say about a study's budget (`experiments/curves.py`):
convergence against numpy's least-squares fit, the verdict's sentence, the generated-task
pages' curve section and compute statement."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
from experiments_helpers import PROV, write_csv

from experiments import arithmetic, curves, induction
from experiments.common import load_preset


def test_closing_change_is_the_least_squares_slope_over_the_last_fifth():
    rng = np.random.default_rng(0)
    steps = np.arange(50, 1001, 50)
    values = 3.0 - np.log(steps) * 0.2 + rng.normal(0, 0.01, len(steps))
    curve = [[int(s), float(v)] for s, v in zip(steps, values)]
    window = steps >= 800
    slope = np.polyfit(steps[window], values[window], 1)[0]
    assert curves.closing_change(curve) == pytest.approx(slope * 200, rel=1e-9)
    assert math.isnan(curves.closing_change([[100, 1.0], [1000, 0.5]]))  # one point in the fifth
    assert math.isnan(curves.closing_change([]))


def test_a_group_converges_when_its_closing_change_is_within_its_spread_and_error():
    flat = [[[s, 1.0 + 0.1 * seed + 0.0001 * (s % 2)] for s in range(100, 1001, 100)]
            for seed in range(5)]
    falling = [[[s, 5.0 - s / 200 + 0.01 * seed] for s in range(100, 1001, 100)]
               for seed in range(5)]
    g = curves.convergence("flat", flat)
    assert g.converged and g.seeds == 5 and g.steps == 1000
    assert g.spread == pytest.approx(np.std([c[-1][1] for c in flat], ddof=1))
    f = curves.convergence("falling", falling)
    # every seed falls by 1.0 over the last 200 steps; the seeds end 0.016 apart
    assert f.change == pytest.approx(-1.0) and f.change_se == pytest.approx(0, abs=1e-9)
    assert not f.converged
    assert curves.budget(g) == ("Trained: converged (flat +0.000 ± 0.000 over the last 20% of "
                                "its steps, seed spread 0.158).")
    text = curves.budget(g, f)
    assert text.startswith("Trained: at a fixed budget of 1000 steps (falling still moving "
                           "(-1.000 ± 0.000") and "flat" not in text
    # within the seed spread, but every seed still falling alike: not converged
    slow = [[[s, 2.0 - s / 20_000 + 0.1 * seed] for s in range(100, 1001, 100)]
            for seed in range(5)]
    w = curves.convergence("slow", slow)
    assert abs(w.change) < w.spread and not w.converged
    # noisy probes that move by less than the seeds differ, and cannot be told from flat
    rng = np.random.default_rng(1)
    noisy = [[[s, 0.5 + 0.1 * seed + rng.normal(0, 0.02)] for s in range(100, 1001, 100)]
             for seed in range(5)]
    n = curves.convergence("noisy", noisy)
    assert abs(n.change) <= 2 * n.change_se and n.converged
    # every seed at the same bound still creeping up: no spread to be flat within
    ceiling = [[[s, 1.0 if s == 1000 or seed < 3 else 0.999] for s in range(100, 1001, 100)]
               for seed in range(5)]
    c = curves.convergence("ceiling", ceiling)
    assert c.spread == 0 and c.change > 0 and not c.converged
    one = curves.convergence("one seed", flat[:1])
    assert not one.known and not one.converged and "not judged" in curves.budget(one)


def _rows(study: str) -> list[dict]:
    rows = []
    for k in (1, 2):
        for s in range(5):
            rising = k == 2  # K = 2 still climbing at its last step, K = 1 flat
            curve = [[t, 0.3 + (0.0004 * t if rising else 0.2) + 0.01 * s]
                     for t in range(100, 1001, 100)]
            acc = curve[-1][1]
            common = {"d_model": 32, "K": k, "seed": s, "params": 1000 * (1 + k),
                      "head1_depth": 3, "steps": 1000, "curve": json.dumps(curve),
                      "train_s": 10.0 * k, **PROV}
            if study == "induction":
                rows.append(common | {"copy_acc": acc, "floor": 0.1, "chance": 0.03})
            else:
                rows.append(common | {"acc_in": acc, "acc_out": acc / 2, "coef_acc_in": acc,
                                      "coef_acc_out": acc, "acc_by_ops": json.dumps({1: acc}),
                                      "floor_in": 0.1, "floor_out": 0.05})
    return rows


@pytest.mark.parametrize("study", ["induction", "arithmetic"])
def test_generated_task_pages_give_curves_budget_and_compute(tmp_path, study):
    module = {"induction": induction, "arithmetic": arithmetic}[study]
    write_csv(tmp_path / "results.csv", module.COLUMNS, _rows(study))
    preset = {"_path": "experiments/presets/x.yaml", "task": {}, "n_layers": 2, "head_dim": 16,
              "seq_len": 64, "batch_size": 8}
    preset["task"] = load_preset(study, "cpu")["task"]
    page = module.report(tmp_path, "cmd", preset)
    assert "### Learning curves and budget" in page
    # tokens per parameter: 1000 steps x 8 x 64 tokens over each group's parameters
    assert "| d = 32, K = 1 | 1000 | 256.00 | 5 |" in page
    assert "| d = 32, K = 2 | 1000 | 170.67 | 5 |" in page
    assert "read from `experiments/presets/x.yaml` as it is today" in page
    compared = next(line for line in page.splitlines() if "K = 2 vs K = 1" in line)
    assert "Trained: at a fixed budget of 1000 steps (d = 32, K = 2 still moving (+0.080" \
        in compared
    compute = next(line for line in page.splitlines() if "compute of K = 2" in line)
    assert "1.50x the parameters" in compute and "2.00x the training wall time" in compute
    assert "**not compute-matched**" in compute and "training FLOPs per token" in compute
    verdicts = [line for line in page.splitlines() if "; n = " in line]
    assert verdicts and all("Trained: " in line for line in verdicts)
    # without settings in the rows or a preset: no tokens per parameter, no FLOPs
    bare = module.report(tmp_path, "cmd")
    assert "| d = 32, K = 1 | 1000 | not recorded |" in bare
    assert "training FLOPs" not in next(line for line in bare.splitlines()
                                        if "compute of K = 2" in line)


@pytest.mark.parametrize("study", ["k_sweep", "bytes", "head_types", "induction", "arithmetic"])
def test_every_committed_page_states_a_budget_that_recomputes(study):
    from experiments import recheck_budget

    assert recheck_budget.check(study, recheck_budget.REPO / "experiments" / "reports") == []


def test_the_budget_recheck_catches_a_wrong_table_or_clause(tmp_path):
    from experiments import recheck_budget

    shutil.copytree(recheck_budget.REPO / "experiments" / "reports" / "induction",
                    tmp_path / "induction")
    page = tmp_path / "induction" / "README.md"
    text = page.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| d = 32, K = 1 |"))
    flipped = row.replace("| yes |", "| no |") if "| yes |" in row else row.replace("| no |",
                                                                                 "| yes |")
    page.write_text(text.replace(row, flipped))
    problems = recheck_budget.check("induction", tmp_path)
    assert any("d = 32, K = 1: converged" in p for p in problems), problems
    # a verdict that calls a group converged when it is not, or that drops its budget
    moving = next(line for line in text.splitlines() if "Trained: at a fixed budget" in line)
    page.write_text(text.replace(moving, moving.replace("Trained: at a fixed budget of 2000 steps",
                                                        "Trained: converged")))
    assert any("wrongly" in p for p in recheck_budget.check("induction", tmp_path))
    page.write_text(text.replace(moving, moving[:moving.index(" Trained: ")]))
    assert any("without its budget" in p for p in recheck_budget.check("induction", tmp_path))

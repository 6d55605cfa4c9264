"""Recheck the verdicts of the committed reports from their CSVs, apart from the code that wrote
them.

    python -m experiments.recheck

For each page under `experiments/reports/` that a study writes, this script lists the page's
tests from the CSV rows on its own (which groups, which column, which floor, ceiling or
reference), computes each p with scipy (Welch's statistic from
`scipy.stats.ttest_ind(equal_var=False)` on min(n_a, n_b) - 1 degrees of freedom,
`scipy.stats.ttest_1samp`), applies Holm's step-down correction as written out here, and checks
the page against the result:

- the page prints m tests, one line each, and those lines are exactly the tests listed here;
- each line's Holm-adjusted p and verdict (higher / lower / faster / slower / above or below a
  reference / not distinguishable) are the ones recomputed here;
- a comparison gives a verdict only where its baseline is above its floor and below its ceiling
  on the same split (each a decided test), and says `not testable` otherwise;
- each `reproduced` / `contradicted` follows from such a verdict, and the K sweeps' findings,
  measured far below the paper's scale and on another measure, are `not testable at this
  scale`;
- no bold higher / lower / faster / slower / reproduced / contradicted stands on a line left
  unchecked;
- the learning-curve table (steps, tokens per parameter, each group's closing change, its
  standard error, seed spread and convergence) recomputes from the runs' curves, and every
  test's line says whether its groups had converged, truthfully (`experiments/recheck_budget.py`).

Exit status 1 lists every problem; 0 prints one line per page.
"""

from __future__ import annotations

import csv
import math
import re
import sys
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from scipy import stats

REPO = Path(__file__).resolve().parents[1]
REPORTS = REPO / "experiments" / "reports"
ALPHA = 0.05
MIN_SEEDS = 5


@dataclass
class Expect:
    """One test a page must print: where its line is, its p, and what decides its verdict."""

    where: str  # a substring found on the test's line and on no other test line
    p: float
    sign: float  # the sign of mean(a) - mean(b), or of mean(a) - reference
    words: tuple[str, str, str]  # verdict if significant and up, significant and down, neither
    gates: list[Expect] = field(default_factory=list)  # must be significant for a verdict
    finding: str | None = None  # the paper's direction (`higher` / `lower`), where it has one
    adjusted: float = math.nan

    @property
    def significant(self) -> bool:
        return self.adjusted <= ALPHA

    @property
    def testable(self) -> bool:
        return all(g.significant for g in self.gates)

    def verdict(self) -> str:
        up, down, neither = self.words
        return neither if not self.significant else up if self.sign > 0 else down


def two_sided(where: str, a: list[float], b: list[float], gates: list[Expect] | None = None,
              words: tuple[str, str] = ("higher", "lower"),
              finding: str | None = None) -> Expect:
    """Welch's test of mean(a) - mean(b); `gates`: the baseline's floor and ceiling tests."""
    _enough(a, b)
    t = float(_quiet(stats.ttest_ind, a, b, equal_var=False).statistic)
    p = float(2 * stats.t.sf(abs(t), min(len(a), len(b)) - 1))
    return Expect(where, p, _mean(a) - _mean(b), (*words, "not distinguishable"), gates or [],
                  finding)


def one_sample(where: str, a: list[float], ref: float, name: str, side: str) -> Expect:
    """One-sided (`greater`: above the reference, `less`: below) or two-sided against 1 (a
    speedup)."""
    _enough(a)
    res = _quiet(stats.ttest_1samp, a, ref, alternative=side)
    if side == "two-sided":
        words = ("faster", "slower", "not distinguishable")
    else:
        word = "above" if side == "greater" else "below"
        words = (f"{word} {name}", f"{word} {name}", f"not shown {word} {name}")
    return Expect(where, float(res.pvalue), _mean(a) - ref, words)


def holm(tests: list[Expect]) -> None:
    """Holm-adjusted p: sort the p; the j-th smallest (from 0) becomes the running maximum of
    (m - j) p, capped at 1."""
    running = 0.0
    for j, t in enumerate(sorted(tests, key=lambda t: t.p)):
        running = max(running, min(1.0, (len(tests) - j) * t.p))
        t.adjusted = running


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _quiet(test, *args, **kwargs):
    with warnings.catch_warnings():
        # seeds at a ceiling agree to the last digits: scipy warns of lost precision, and the
        # p it gives stays within the tolerance the page is checked to
        warnings.simplefilter("ignore", RuntimeWarning)
        return test(*args, **kwargs)


def _enough(*groups: list[float]) -> None:
    # a page gives groups of fewer seeds no test; the committed pages have none
    if min(len(g) for g in groups) < MIN_SEEDS:
        raise ValueError(f"a group of fewer than {MIN_SEEDS} seeds: recheck it by hand")


def _rows(study: str) -> list[dict]:
    with open(REPORTS / study / "results.csv", newline="") as f:
        return list(csv.DictReader(f))


def _values(rows: list[dict], col: str) -> list[float]:
    return [float(r[col]) for r in rows if r.get(col, "") != ""]


def _vocab(preset: str) -> int:
    path = REPO / "experiments" / "presets" / f"k_sweep_{preset}.yaml"
    return int(yaml.safe_load(path.read_text())["fit"]["model"]["vocab_size"])


# -- each study's tests, listed from its CSV --------------------------------------------------


def k_sweep_tests(study: str, preset: str) -> tuple[list[Expect], dict[int, Expect]]:
    """The K sweep's tests, and each K's next-token test against its depth-matched control."""
    rows = [r for r in _rows(study) if r.get("head_type", "block") == "block"]
    # the sweep proper: every K at the n_layers of its K > 1 runs; the other K = 1 runs are
    # depth-matched controls, one group per next-token depth
    main_n = Counter(r["n_layers"] for r in rows if r["K"] != "1").most_common(1)[0][0]
    by: dict[int, list[dict]] = {}
    controls: dict[str, list[dict]] = {}
    for r in rows:
        if r["n_layers"] == main_n:
            by.setdefault(int(r["K"]), []).append(r)
        elif r["K"] == "1":
            controls.setdefault(r["head1_depth"], []).append(r)
    ks, chance = sorted(by), math.log(_vocab(preset))
    guess = "a uniform guess's loss"
    base = _values(by[1], "next_token_loss")
    learned = one_sample("Next-token loss of the K = 1 model against", base, chance, guess,
                         "less")
    tests, objective = [learned], {}
    for k in (k for k in ks if k > 1):
        loss = _values(by[k], "next_token_loss")
        tests.append(two_sided(f"Next-token loss, K = {k} vs K = 1 at equal parameters", loss,
                               base, [learned]))
        depth = by[k][0]["head1_depth"]
        if depth in controls:
            ctl = _values(controls[depth], "next_token_loss")
            gate = one_sample(f"control of head 1's depth ({depth} blocks) against", ctl,
                              chance, guess, "less")
            objective[k] = two_sided(f"K = {k} against the K = 1 control of head 1's depth",
                                     loss, ctl, [gate])
            tests += [gate, objective[k],
                      two_sided(f"the control of {depth} blocks against the full K = 1 model",
                                ctl, base, [learned])]
    for a, b in zip(ks, ks[1:]):
        tests.append(two_sided(f"L, K = {b} vs K = {a}:", _values(by[b], "spec_L"),
                               _values(by[a], "spec_L")))
    for col, what in (("spec_speedup", "its own greedy"),
                      ("spec_speedup_vs_k1", "the K = 1 model's greedy")):
        for k in (k for k in ks if k > 1):
            v = _values(by[k], col)
            if v:
                tests.append(one_sample(f"speedup of K = {k} against {what}", v, 1.0, "",
                                        "two-sided"))
    return tests, objective


def head_types_tests() -> list[Expect]:
    rows = _rows("head_types")
    by: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        by.setdefault((r["head_type"], int(r["K"])), []).append(r)
    base = _values(by["block", 1], "next_token_loss")
    learned = one_sample("Next-token loss of the K = 1 baseline against", base,
                         math.log(_vocab("heads_cpu")), "a uniform guess's loss", "less")
    tests = [learned]
    k_top = max(k for _, k in by)
    types = [h for h, k in by if k == k_top]
    for h in types:
        tests.append(two_sided(f"Next-token loss, {h} heads at K = {k_top} vs the K = 1",
                               _values(by[h, k_top], "next_token_loss"), base, [learned]))
    for h in (h for h in types if h != "deepseek"):
        for i in range(1, k_top):
            cascaded = _values(by["deepseek", k_top], f"accept_pos{i}")
            other = _values(by[h, k_top], f"accept_pos{i}")
            # acceptance has a floor of 0 and a ceiling of 1: neither group may sit there
            if not 0 < min(_mean(cascaded), _mean(other)) <= max(_mean(cascaded),
                                                                _mean(other)) < 1:
                raise ValueError(f"acceptance of draft {i} at 0 or 1: no comparison there")
            tests.append(two_sided(f"Acceptance of draft {i}, deepseek vs {h} heads", cascaded,
                                   other))
    return tests


def synthetic_tests(study: str, col_of: dict[str, str], floor_of: dict[str, str],
                    floor_name: str, ceiling_name: str, where_of: dict[str, str],
                    compare: str) -> list[Expect]:
    """Induction and arithmetic: every group above the floor per split, the baseline below a
    perfect score per split, each K against K = 1 per split, gated by the baseline's two."""
    rows = _rows(study)
    by: dict[tuple[int, int], list[dict]] = {}
    for r in rows:
        by.setdefault((int(r["d_model"]), int(r["K"])), []).append(r)
    tests = []
    for d in sorted({d for d, _ in by}):
        ks = sorted(k for dd, k in by if dd == d)
        gates: dict[str, list[Expect]] = {}
        for split, col in col_of.items():
            floor = float(rows[0][floor_of[split]])
            for k in ks:
                who = "the K = 1 baseline" if k == 1 else f"K = {k}"
                t = one_sample(f"d = {d}, {who}{where_of[split]}:",
                               _values(by[d, k], col), floor, floor_name, "greater")
                tests.append(t)
                if k == 1:
                    gates[split] = [t]
            t = one_sample(f"d = {d}, the K = 1 baseline{where_of[split]} against",
                           _values(by[d, 1], col), 1.0, ceiling_name, "less")
            tests.append(t)
            gates[split].append(t)
        for k in (k for k in ks if k > 1):
            for split, col in col_of.items():
                tests.append(two_sided(compare.format(d=d, k=k, where=where_of[split]),
                                       _values(by[d, k], col), _values(by[d, 1], col),
                                       gates[split], finding="higher"))
    return tests


def pages() -> dict[str, tuple[list[Expect], dict[int, Expect] | None]]:
    """Every committed study page: its tests, and for a K sweep each K's objective test."""
    inside = {"in": " in distribution", "out": " out of distribution"}
    return {
        "k_sweep": k_sweep_tests("k_sweep", "cpu"),
        "bytes": k_sweep_tests("bytes", "bytes_cpu"),
        "head_types": (head_types_tests(), None),
        "induction": (synthetic_tests(
            "induction", {"": "copy_acc"}, {"": "floor"}, "the context-bag floor",
            "perfect copying", {"": ""}, "d = {d}, K = {k} vs K = 1:"), None),
        "arithmetic": (synthetic_tests(
            "arithmetic", {"in": "acc_in", "out": "acc_out"},
            {"in": "floor_in", "out": "floor_out"}, "the majority-answer floor",
            "a perfect score", inside, "d = {d}, K = {k} vs K = 1,{where}:"), None),
    }


# -- the page against the tests ----------------------------------------------------------------

_STAT_END = re.compile(r"; n = \d+(?: vs \d+)?\)")
_CLAIM = re.compile(r"\*\*(?:deepseek )?(higher|lower|faster|slower|reproduced|contradicted)"
                    r"\*\*|\): (higher|lower)\. Paper")


def _printed(line: str) -> tuple[float, str | None, str | None]:
    """A test line's Holm-adjusted p, its verdict (None where it gives none) and the status of
    the paper's finding it states (None where none)."""
    adjusted = float(re.search(r"Holm-adjusted p = ([0-9.e+-]+);", line).group(1))
    rest = line[_STAT_END.search(line).end():]
    verdict = None
    if rest.startswith(": "):
        verdict = re.match(r": (?:deepseek )?\**([^*]+?)\**(?:[.;]|$| \()", rest).group(1)
    status = re.search(r"Paper: [^*]*\*\*(.+?)\*\*", rest)
    return adjusted, verdict, status.group(1) if status else None


def check_page(name: str, tests: list[Expect], objective: dict[int, Expect] | None) -> list[str]:
    """Every problem of one page (empty: every verdict recomputes)."""
    page = (REPORTS / name / "README.md").read_text().splitlines()
    holm(tests)
    problems, checked = [], set()
    printed_m = re.search(r"over all m = (\d+) tests", "\n".join(page))
    if not printed_m or int(printed_m.group(1)) != len(tests):
        problems.append(f"{name}: the page's m is {printed_m and printed_m.group(1)}, its "
                        f"tests here {len(tests)}")
    test_lines = [i for i, x in enumerate(page) if "Holm-adjusted p = " in x
                  and _STAT_END.search(x)]
    if len(test_lines) != len(tests):
        problems.append(f"{name}: {len(test_lines)} test lines on the page, {len(tests)} here")
    for t in tests:
        found = [i for i in test_lines if t.where in page[i]]
        if len(found) != 1:
            problems.append(f"{name}: {len(found)} test lines hold {t.where!r}")
            continue
        checked.add(found[0])
        adjusted, verdict, status = _printed(page[found[0]])
        if not math.isclose(adjusted, t.adjusted, rel_tol=0.06, abs_tol=6e-4):
            problems.append(f"{name}: {t.where!r}: Holm-adjusted p {adjusted} printed, "
                            f"{t.adjusted:.3g} recomputed")
        if not t.testable:
            if verdict is not None and not verdict.startswith("not testable"):
                problems.append(f"{name}: {t.where!r}: verdict {verdict!r} where the baseline "
                                "is not above its floor or not below its ceiling")
        elif verdict != t.verdict():
            problems.append(f"{name}: {t.where!r}: verdict {verdict!r} printed, "
                            f"{t.verdict()!r} recomputed")
        if t.finding is not None:
            want = ("not testable" if not t.testable else "not resolved by the criterion"
                    if not t.significant else "reproduced" if t.verdict() == t.finding
                    else "contradicted")
            if status is None or not status.startswith(want):
                problems.append(f"{name}: {t.where!r}: finding {status!r} printed, {want!r} "
                                "recomputed")
    if objective is not None:
        for i, line in enumerate(page):
            if line.startswith("- Gloeckle et al.:"):
                checked.add(i)
                if "**not testable at this scale** (here " not in line or \
                        re.search(r"reproduced|contradicted", line):
                    problems.append(f"{name}: a finding of the paper at another scale is not "
                                    f"stated as not testable at this scale: {line[:80]}")
                for k, test in objective.items():
                    want = (f"K = {k}: {test.verdict()} (against its depth-matched control)"
                            if test.testable else f"K = {k}: not testable")
                    if want not in line:
                        problems.append(f"{name}: finding line lacks {want!r}")
    for i, line in enumerate(page):
        if _CLAIM.search(line) and i not in checked:
            problems.append(f"{name}: an unchecked verdict: {line[:100]}")
    return problems


def check_all() -> dict[str, list[str]]:
    """Every committed study page -> its problems."""
    from experiments import recheck_budget

    return {name: check_page(name, tests, objective) + recheck_budget.check(name, REPORTS)
            for name, (tests, objective) in pages().items()}


def main() -> int:
    results = check_all()
    for name, problems in results.items():
        print(f"{name}: " + (f"{len(problems)} problems" if problems else "every verdict "
                             "recomputes from results.csv"))
        for p in problems:
            print(f"  {p}")
    return int(any(results.values()))


if __name__ == "__main__":
    sys.exit(main())

"""The statistics of the studies' reports.

A report first adds every test it makes to one `Family`: each comparison of two groups (`welch`),
each group against its floor or ceiling and each speedup against 1 (`one_sample`). `Family.decide`
then runs Holm's step-down correction over all of them (`holm`), and only then does the report
render each test with its verdict. `tests/experiments/test_experiments.py` simulates the rule under
the null, and `experiments/recheck.py` recomputes every committed verdict apart from this file.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from experiments.common import summarize

ALPHA = 0.05
"""Family-wise error rate of a report: the chance that any of its verdicts is a false positive."""
#: Groups smaller than this get no test: a Holm-corrected t-test of fewer values detects only
#: differences of many standard deviations, and nothing checks the normality it assumes.
MIN_SEEDS = 5


def _finite(values: Iterable[float]) -> list[float]:
    return [float(v) for v in values if not math.isnan(float(v))]


def _signed_inf(x: float) -> float:
    """The t of a difference x between values without spread."""
    return math.copysign(math.inf, x) if x else 0.0


def _p_value(t: float, df: float, side: str) -> float:
    """The p of a t statistic with df degrees of freedom; `side` is `two-sided`, `greater`
    (the mean exceeds the reference) or `less`."""
    from scipy.special import stdtr  # Student's t CDF

    if side == "two-sided":
        return float(2 * stdtr(df, -abs(t)))
    return float(stdtr(df, -t) if side == "greater" else stdtr(df, t))


def welch(a: Sequence[float], b: Sequence[float]) -> tuple[float, float, float, float]:
    """Welch's t-test of mean(a) - mean(b), two-sided: (difference, t, degrees of freedom, p).

    The statistic is Welch's, the difference over the root of the two groups' own variances of the
    mean; its degrees of freedom are min(len(a), len(b)) - 1 (Hsu's choice), under which the test
    keeps its level whatever the ratio of the two spreads. The Welch-Satterthwaite degrees of
    freedom, estimated from the sample variances, make it reject too often in the tails that Holm's
    correction uses when a group has a few seeds and the spreads differ
    (tests/experiments/test_experiments.py simulates both). Groups without spread differ for certain
    or not at all: p is 0 or 1.
    """
    a, b = _finite(a), _finite(b)
    sa, sb = summarize(a), summarize(b)
    diff = sa["mean"] - sb["mean"]
    va, vb = sa["std"] ** 2 / len(a), sb["std"] ** 2 / len(b)
    df = min(len(a), len(b)) - 1
    if va + vb == 0:
        return diff, _signed_inf(diff), df, 1.0 if diff == 0 else 0.0
    t = diff / math.sqrt(va + vb)
    return diff, t, df, _p_value(t, df, "two-sided")


def one_sample(a: Sequence[float], ref: float,
               side: str = "two-sided") -> tuple[float, float, float, float]:
    """The one-sample t-test of mean(a) against `ref`: (mean - ref, t, n - 1, p), `side` as in
    `_p_value`. A group without spread is on the tested side of `ref` for certain or not."""
    a = _finite(a)
    s = summarize(a)
    diff = s["mean"] - ref
    if s["std"] == 0:
        beyond = diff != 0 and (side == "two-sided" or (diff > 0) == (side == "greater"))
        return diff, _signed_inf(diff), len(a) - 1, 0.0 if beyond else 1.0
    t = diff / (s["std"] / math.sqrt(len(a)))
    return diff, t, len(a) - 1, _p_value(t, len(a) - 1, side)


def holm(ps: Sequence[float], alpha: float = ALPHA) -> list[float]:
    """Holm-adjusted p-values: the i-th smallest of m p-values becomes the largest of
    (m - j) p_(j) over j <= i (capped at 1), and a test is rejected at family-wise level alpha
    where its adjusted p <= alpha. That rejects the smallest p while p <= alpha / m, the next
    while p <= alpha / (m - 1), and so on, stopping at the first that fails. A nan (no test)
    stays nan and does not count in m."""
    order = sorted((p, i) for i, p in enumerate(ps) if not math.isnan(p))
    m, out, running = len(order), [float("nan")] * len(ps), 0.0
    for j, (p, i) in enumerate(order):
        running = max(running, min(1.0, (m - j) * p))
        out[i] = running
    return out


def detectable_difference(n: int, m: int, alpha: float = ALPHA, power: float = 0.8) -> float:
    """The true difference of means, in standard deviations of the groups (equal in both), that
    `welch` on n vs n values detects with probability `power` at level alpha / m (Holm's
    strictest step over m tests; m = 1 for its last): its statistic is then noncentral t with
    2n - 2 degrees of freedom, its critical value that of t with n - 1."""
    from scipy import optimize, stats

    c = stats.t.ppf(1 - alpha / m / 2, n - 1)

    def short(delta: float) -> float:
        nc = delta * math.sqrt(n / 2)
        wrong_way = stats.nct.cdf(-c, 2 * n - 2, nc)  # nan where it underflows
        return (stats.nct.sf(c, 2 * n - 2, nc) + (0.0 if math.isnan(wrong_way) else wrong_way)
                - power)

    return float(optimize.brentq(short, 0.0, 100.0))


def fmt_p(p: float) -> str:
    """A p-value for a report: three decimals, or two significant digits below 0.001."""
    return f"{p:.3f}" if p >= 0.001 or p == 0 else f"{p:.1e}"


class Test:
    """One test of a report: Welch's two-sided t-test of mean(a) - mean(b) (`b` given), or a
    one-sample t-test of mean(a) against `ref` (`side`: `two-sided`, or one-sided `greater` /
    `less`); `ref_name` names the reference in the text ("its floor"). `adjusted` is its
    Holm-adjusted p once its `Family` has decided; a group of fewer than MIN_SEEDS values gets
    no test (p nan)."""

    def __init__(self, a: Sequence[float], b: Sequence[float] | None = None, *,
                 ref: float = 0.0, side: str = "two-sided", ref_name: str = "",
                 digits: int = 3) -> None:
        self.a, self.b = _finite(a), None if b is None else _finite(b)
        self.ref, self.side, self.ref_name, self.digits = ref, side, ref_name, digits
        self.mean = summarize(self.a)["mean"]
        self.adjusted: float | None = None
        if min(len(self.a), MIN_SEEDS if self.b is None else len(self.b)) < MIN_SEEDS:
            other = ref if self.b is None else summarize(self.b)["mean"]
            self.diff, self.t, self.df, self.p = self.mean - other, math.nan, math.nan, math.nan
        elif self.b is not None:
            self.diff, self.t, self.df, self.p = welch(self.a, self.b)
        else:
            self.diff, self.t, self.df, self.p = one_sample(self.a, ref, side)

    @property
    def tested(self) -> bool:
        return not math.isnan(self.p)

    @property
    def rejected(self) -> bool:
        """Whether Holm's correction rejects the null hypothesis at family-wise ALPHA."""
        if self.adjusted is None:
            raise RuntimeError("the family of this test has not decided yet (Family.decide)")
        return self.tested and self.adjusted <= ALPHA

    def stat(self) -> str:
        """The test's numbers: difference, t, degrees of freedom, p, Holm-adjusted p, n."""
        d = self.digits
        if self.b is not None:
            head = f"Δ = {self.diff:+.{d}f}"
            sizes, name = f"n = {len(self.a)} vs {len(self.b)}", "Welch t"
        else:
            head = f"mean {self.mean:.{d}f} against {self.ref_name} of {self.ref:.{d}f}"
            sizes = f"n = {len(self.a)}"
            name = "t" if self.side == "two-sided" else "one-sided t"
        if not self.tested:
            return f"{head} ({sizes}: too few seeds for a test, fewer than {MIN_SEEDS})"
        return (f"{head} ({name} = {self.t:.2f}, df = {self.df:g}, p = {fmt_p(self.p)}; "
                f"Holm-adjusted p = {fmt_p(self.adjusted)}; {sizes})")

    def verdict(self, up: str = "higher", down: str = "lower",
                neither: str = "not distinguishable") -> str:
        """A two-sided test: `up` where the mean is significantly above the other group or the
        reference, `down` where below, `neither` otherwise. A one-sided test: `above <its
        reference>` (`below` for `less`) where significant, else `not shown above` (`below`)."""
        if not self.tested:
            return f"too few seeds for a verdict (fewer than {MIN_SEEDS})"
        if self.side != "two-sided":
            side = "above" if self.side == "greater" else "below"
            return f"{side if self.rejected else 'not shown ' + side} {self.ref_name}"
        if not self.rejected:
            return neither
        return up if self.diff > 0 else down


class Family:
    """Every test of one report, decided together by Holm's step-down correction at
    family-wise ALPHA (`holm`). A report adds all its tests, calls `decide`, then renders."""

    def __init__(self) -> None:
        self.tests: list[Test] = []

    def add(self, test: Test) -> Test:
        self.tests.append(test)
        return test

    def compare(self, a: Sequence[float], b: Sequence[float], digits: int = 3) -> Test:
        """Welch's two-sided test of mean(a) - mean(b), in the family."""
        return self.add(Test(a, b, digits=digits))

    def against(self, a: Sequence[float], ref: float, ref_name: str, side: str = "two-sided",
                digits: int = 3) -> Test:
        """The one-sample test of mean(a) against `ref`, in the family."""
        return self.add(Test(a, ref=ref, side=side, ref_name=ref_name, digits=digits))

    def floor(self, a: Sequence[float], floor: float, name: str = "its floor",
              digits: int = 3) -> Test:
        """Whether a group rose above its floor (the score of a model that learned nothing):
        one-sided, in the family."""
        return self.against(a, floor, name, "greater", digits)

    def ceiling(self, a: Sequence[float], ceiling: float, name: str = "its ceiling",
                digits: int = 3) -> Test:
        """Whether a group stayed below its ceiling (the best score there is): one-sided, in the
        family."""
        return self.against(a, ceiling, name, "less", digits)

    @property
    def m(self) -> int:
        """The number of tests Holm's correction spans (groups too small for a test do not
        count)."""
        return sum(t.tested for t in self.tests)

    def decide(self) -> None:
        """Holm's correction over every test of the family."""
        for test, adjusted in zip(self.tests, holm([t.p for t in self.tests])):
            test.adjusted = adjusted

    def criterion(self) -> str:
        """The sentence that states how the report's verdicts are decided, and their power."""
        tested = [t for t in self.tests if t.tested]
        kinds = []
        if any(t.b is not None for t in tested):
            kinds.append("Welch's t-test of the difference of two groups' means (two-sided, "
                         "with min(n₁, n₂) − 1 degrees of freedom, which keep its level whatever "
                         "the two groups' spreads)")
        for sides, how in ((("greater", "less"), "one-sided"), (("two-sided",), "two-sided")):
            # a two-sided reference is one value (a speedup of 1); floors vary by split
            refs = list(dict.fromkeys(
                t.ref_name + (f" of {t.ref:g}" if how == "two-sided" else "")
                for t in tested if t.b is None and t.side in sides))
            if refs:
                names = refs[0] if len(refs) == 1 else f"{', '.join(refs[:-1])} or {refs[-1]}"
                kinds.append(f"a one-sample t-test of a group against {names} ({how})")
        sizes = [min(len(t.a), len(t.b)) for t in tested if t.b is not None]
        m, n = self.m, min(sizes, default=0)
        power = "" if not n else (
            f" Power: with {n} seeds per group, a comparison detects a true difference of "
            f"{detectable_difference(n, m):.1f} pooled standard deviations with 80% "
            f"probability where Holm tests it at {ALPHA} / {m} (its strictest step), and of "
            f"{detectable_difference(n, 1):.1f} where at {ALPHA} (its last; equal spreads, "
            "noncentral t); smaller true differences are mostly not distinguishable here.")
        return ("Criterion of every verdict: " + "; ".join(kinds or ["no test"]) + ", each "
                "assuming roughly normal per-seed values; Holm's step-down correction over all "
                f"m = {m} tests on this page at family-wise α = {ALPHA}: a test decides where "
                f"its Holm-adjusted p ≤ {ALPHA}. Groups of fewer than {MIN_SEEDS} seeds get no "
                f"test.{power} Per-seed values are in the tables.")


def why_untestable(who: str, *bounds: Test | None, digits: int = 3) -> str | None:
    """Why a comparison against the baseline `who` cannot test a finding, or None. `bounds` are
    the baseline's decided one-sided tests on the comparison's split: above its floor (the score
    of a model that learned nothing), below its ceiling (the best score there is); where one
    fails, a difference from the baseline measures where the floor or ceiling sits. A bound
    too small to test leaves the comparison to say so itself."""
    for test in bounds:
        if test is not None and test.tested and not test.rejected:
            side = "above" if test.side == "greater" else "below"
            return (f"{who} is not shown {side} {test.ref_name} of {test.ref:.{digits}f} (mean "
                    f"{test.mean:.{digits}f}, Holm-adjusted p = {fmt_p(test.adjusted)})")
    return None


def judged(test: Test, why_not: str | None) -> str:
    """A comparison's verdict, or why it cannot give one (`why_untestable`)."""
    return f"not testable: {why_not}" if why_not else test.verdict()


def finding(verdict: str, predicted: str, why_not: str | None = None) -> str:
    """A paper finding's status from a comparison's verdict, `predicted` being the direction
    the paper reports (`higher` or `lower`); `why_not` says why the comparison cannot test it
    (a baseline at its floor or ceiling, another scale than the paper's)."""
    if why_not:
        return f"not testable: {why_not}"
    if verdict == predicted:
        return "reproduced"
    if verdict in ("higher", "lower"):
        return "contradicted"
    if verdict == "not distinguishable":
        return "not resolved by the criterion"
    return verdict if verdict.startswith("not testable") else "not testable: " + verdict



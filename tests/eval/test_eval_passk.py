"""pass@k against exact integer arithmetic, and the ``evaluate`` module against the function."""

from __future__ import annotations

import math
import os
from fractions import Fraction

import pytest
from mtp.eval import pass_at_k
from mtp.eval.passk import METRIC_PATH, pass_at_k_table

# Every (n, c, k) with n in a spread up to 200, all c, and a spread of k <= n.
TABLE = [(n, c, k) for n in (1, 2, 3, 5, 10, 20, 37, 100, 200)
         for c in range(n + 1) for k in sorted({1, 2, 5, 10, 50, 100, n}) if k <= n]


def exact(n: int, c: int, k: int) -> Fraction:
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


def test_matches_exact_binomials():
    for n, c, k in TABLE:
        assert pass_at_k(n, c, k) == pytest.approx(float(exact(n, c, k)), rel=1e-12, abs=1e-15), \
            (n, c, k)


def test_edge_values():
    assert pass_at_k(200, 0, 100) == 0.0
    assert pass_at_k(200, 200, 1) == 1.0
    assert pass_at_k(200, 101, 100) == 1.0  # fewer than k failures: some draw must pass
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    # Numerically stable where the naive binomial ratio overflows a float.
    assert pass_at_k(2000, 1, 1000) == pytest.approx(0.5)


@pytest.mark.parametrize("n, c, k", [(5, 1, 6), (5, 6, 1), (5, -1, 1), (5, 1, 0)])
def test_rejects_out_of_range(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_table_reports_only_k_up_to_n():
    table = pass_at_k_table([10, 20], [3, 0], [1, 10, 20, 100])
    assert set(table) == {"pass@1", "pass@10"}
    assert table["pass@1"] == pytest.approx((0.3 + 0.0) / 2)
    assert table["pass@10"] == pytest.approx((1.0 + 0.0) / 2)


def test_evaluate_module_offline_gives_identical_numbers(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    import evaluate

    metric = evaluate.load(str(METRIC_PATH))
    ns = [n for n, _, _ in TABLE if n == 200]
    cs = [c for n, c, _ in TABLE if n == 200]
    ks = [1, 2, 5, 10, 50, 100, 200]
    got = metric.compute(num_samples=ns, num_correct=cs, k=ks)
    assert got == pass_at_k_table(ns, cs, ks)  # the same floats, not merely close
    for k in ks:
        mean_exact = sum(exact(n, c, k) for n, c in zip(ns, cs)) / len(ns)
        assert got[f"pass@{k}"] == pytest.approx(float(mean_exact), rel=1e-12, abs=1e-15)
    assert "HF_HUB_OFFLINE" in os.environ

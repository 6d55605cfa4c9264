"""The unbiased pass@k estimator of Chen et al. (2021)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = ["METRIC_PATH", "pass_at_k", "pass_at_k_table"]

METRIC_PATH = Path(__file__).parent / "metrics" / "pass_at_k.py"
"""The same computation as an ``evaluate`` module: ``evaluate.load(str(METRIC_PATH))``."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples, drawn without replacement from n, is correct.

    Computes ``1 - C(n - c, k) / C(n, k)`` as ``1 - prod(1 - k / i for i in n-c+1..n)``, which
    never forms the huge binomials and stays accurate for n in the thousands.

    Args:
        n: Samples generated for the task.
        c: How many of them passed.
        k: The k of pass@k; must satisfy 1 <= k <= n.

    Raises:
        ValueError: If the arguments are out of range (k > n has no unbiased estimate).
    """
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n (got n={n}, c={c})")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n (got n={n}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_at_k_table(
    num_samples: Sequence[int], num_correct: Sequence[int], ks: Iterable[int]
) -> dict[str, float]:
    """Mean pass@k over tasks, for each k that every task has enough samples for.

    Args:
        num_samples: Samples per task.
        num_correct: Passing samples per task.
        ks: Requested k values; those above the smallest ``num_samples`` are left out.

    Returns:
        ``{"pass@k": value}`` with values in [0, 1].
    """
    if len(num_samples) != len(num_correct):
        raise ValueError("num_samples and num_correct differ in length")
    if not num_samples:
        return {}
    smallest = min(num_samples)
    return {
        f"pass@{k}": math.fsum(pass_at_k(n, c, k) for n, c in zip(num_samples, num_correct))
        / len(num_samples)
        for k in sorted(set(ks))
        if k <= smallest
    }

"""The plain PyTorch linear cross-entropy that materialises the ``[N, V]`` logits.

The unfused baseline that tests and benchmarks share; the fused implementations of the same
contract are the entry points of :mod:`mtp.kernels.dispatch`.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

# The reductions every implementation accepts.
Reduction = Literal["mean", "sum", "none"]


def linear_cross_entropy_reference(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
) -> Tensor:
    """Plain PyTorch linear cross-entropy that materialises the ``[N, V]`` logits.

    The usual unfused recipe: the matmul in the input dtype (tensor cores for bf16), the
    cross-entropy in ``promote(input dtype, float32)`` on the upcast logits. For bf16 inputs the
    logits are therefore rounded to bf16, which the fused kernels avoid (fp32 logits). Follows the
    same convention as :func:`linear_cross_entropy` for an all-ignored batch with
    ``reduction="mean"``: the loss is 0 (torch's ``cross_entropy`` would return NaN).

    Args:
        hidden: ``[N, d]`` activations.
        weight: ``[V, d]`` unembedding.
        targets: ``[N]`` int64 token ids; ``ignore_index`` marks positions without a loss.
        ignore_index: Target value whose positions contribute neither loss nor gradient.
        reduction: ``"mean"`` over non-ignored positions, ``"sum"``, or ``"none"`` (``[N]``).

    Returns:
        The loss in fp32 (fp64 for fp64 inputs): a scalar, or ``[N]`` for ``reduction="none"``.
    """
    compute_dtype = torch.promote_types(hidden.dtype, torch.float32)
    logits = (hidden @ weight.T).to(compute_dtype)  # (N, V)
    loss = F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="none")  # (N,)
    if reduction == "none":
        return loss
    total = loss.sum()
    if reduction == "sum":
        return total
    count = (targets != ignore_index).sum().clamp(min=1)
    return total / count

"""The multi-token-prediction loss: sum over heads of w_i * CE_i.

Head i (1-based) at position t is trained on token t + i of the window. `mtp_targets` cuts the
K target rows out of a window of T + K tokens; `naive_mtp_loss` is the reference that holds all
K heads' logits at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mtp.model import MTPTransformer

IGNORE_INDEX = -100


@dataclass
class MTPLossOutput:
    """The weighted total and each head's detached mean loss and top-1 accuracy."""

    loss: torch.Tensor
    head_losses: torch.Tensor  # (K,)
    head_accuracies: torch.Tensor | None = None  # (K,)


def mtp_inputs_targets(window: torch.Tensor, n_future: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split windows (B, T + K) into inputs (B, T) and targets (K, B, T).

    targets[i - 1, b, t] = window[b, t + i]: head i sees the token i positions ahead.
    """
    T = window.shape[1] - n_future
    if T < 1:
        raise ValueError(f"windows of {window.shape[1]} tokens are too short for K = {n_future}")
    targets = window.unfold(1, T, 1)[:, 1:n_future + 1]  # (B, K, T)
    return window[:, :T], targets.transpose(0, 1)


def _head_weights(weights: list[float] | None, k: int, device: torch.device) -> torch.Tensor:
    return torch.ones(k, device=device) if weights is None else torch.tensor(weights,
                                                                             device=device)


def naive_mtp_loss(
    model: MTPTransformer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    head_weights: list[float] | None = None,
) -> MTPLossOutput:
    """Reference MTP loss: all heads' logits (K, B, T, V) are materialised together."""
    logits = model(inputs)  # (K, B, T, V)
    K = logits.shape[0]
    # at least fp32 (bf16 logits would round the loss), but keep fp64 when testing in fp64
    dtype = torch.promote_types(logits.dtype, torch.float32)
    ce = F.cross_entropy(
        logits.flatten(1, 2).transpose(1, 2).to(dtype),  # (K, V, B*T)
        targets.flatten(1), ignore_index=IGNORE_INDEX, reduction="none",
    )  # (K, B*T)
    valid = targets.flatten(1) != IGNORE_INDEX
    head_losses = (ce * valid).sum(1) / valid.sum(1).clamp(min=1)  # (K,)
    loss = (_head_weights(head_weights, K, logits.device) * head_losses).sum()
    with torch.no_grad():
        hits = (logits.argmax(-1).flatten(1) == targets.flatten(1)) & valid
        acc = hits.sum(1) / valid.sum(1).clamp(min=1)
    return MTPLossOutput(loss, head_losses.detach(), acc)

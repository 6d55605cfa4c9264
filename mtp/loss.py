"""The multi-token-prediction loss: sum over heads of w_i * CE_i.

Head i (1-based) at position t is trained on token t + i of the window. `mtp_inputs_targets` cuts
the K target rows out of a window of T + K tokens. `naive_mtp_loss` is the reference that holds
all K heads' logits at once; `sequential_mtp_loss` runs the heads one at a time through the fused
linear-cross-entropy kernel, so no [N, V] logits buffer is ever held; `head_metrics` evaluates.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from mtp.kernels import linear_cross_entropy, linear_cross_entropy_fwd_bwd
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
    return model(inputs, heads_fn=functools.partial(naive_heads_loss, model, targets=targets,
                                                    head_weights=head_weights))


def naive_heads_loss(
    model: MTPTransformer,
    h: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    targets: torch.Tensor,
    head_weights: list[float] | None = None,
) -> MTPLossOutput:
    """The heads' part of `naive_mtp_loss`, from the trunk output h (B, T, d)."""
    K = model.cfg.n_future
    logits = torch.stack([model.unembed(model.head_hidden(i, h, rope))
                          for i in range(K)])  # (K, B, T, V)
    # at least fp32 (bf16 logits would round the loss), but keep fp64 when testing in fp64
    dtype = torch.promote_types(logits.dtype, torch.float32)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).to(dtype), targets.reshape(-1),
                         ignore_index=IGNORE_INDEX, reduction="none").view(K, -1)  # (K, B*T)
    valid = targets.flatten(1) != IGNORE_INDEX
    head_losses = (ce * valid).sum(1) / valid.sum(1).clamp(min=1)  # (K,)
    loss = (_head_weights(head_weights, K, logits.device) * head_losses).sum()
    with torch.no_grad():
        hits = (logits.argmax(-1).flatten(1) == targets.flatten(1)) & valid
        acc = hits.sum(1) / valid.sum(1).clamp(min=1)
    return MTPLossOutput(loss, head_losses.detach(), acc)


class _SharedWeightGrad:
    """The one fp32 gradient buffer of the shared unembedding W, filled by every head's loss."""

    def __init__(self) -> None:
        self.dweight: torch.Tensor | None = None

    def buffer(self, weight: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        if self.dweight is None:
            dtype = torch.promote_types(hidden.dtype, torch.float32)
            if torch.is_autocast_enabled(hidden.device.type) and dtype != torch.float64:
                dtype = torch.float32
            self.dweight = torch.zeros_like(weight, dtype=dtype)
        return self.dweight


class _FusedHeadLoss(torch.autograd.Function):
    """One head's loss w * CE(z @ W.T, t), with its gradients computed in the forward.

    The fused linear-cross-entropy forward and backward run together (6 N d V FLOPs, no [N, V]
    buffer): dL/dz is kept for the backward, and dL/dW is added into the step's one shared
    buffer rather than held per head. The first of the K heads' backward calls hands that buffer
    over as W's gradient (scaled by the incoming gradient, which is the same for every head: the
    weighted losses are summed) and the others return none, so W's gradient exists once.
    """

    @staticmethod
    def forward(ctx, z, weight, targets, scale, shared, fwd_bwd):
        loss, dz = fwd_bwd(z, weight, targets, shared.buffer(weight, z), scale=scale,
                           ignore_index=IGNORE_INDEX)
        # Plain attributes, not save_for_backward: backward scales them in place and hands them
        # over instead of allocating scaled copies.
        ctx.dz, ctx.shared, ctx.weight_dtype = dz, shared, weight.dtype
        ctx.mark_non_differentiable(loss)
        return loss * scale, loss

    @staticmethod
    def backward(ctx, grad_weighted, _grad_loss):
        if not hasattr(ctx, "dz"):
            raise RuntimeError("the sequential MTP loss supports a single backward pass "
                               "(its gradients were computed in the forward and handed over)")
        dz, shared = ctx.dz, ctx.shared
        del ctx.dz, ctx.shared
        # grad_weighted is 1, or 1 / accumulate_grad_batches, or a loss scale: a scalar
        unit = bool((grad_weighted == 1).all())
        if not unit:
            dz.mul_(grad_weighted.to(dz.dtype))
        dweight = None
        if shared.dweight is not None and ctx.needs_input_grad[1]:
            dweight, shared.dweight = shared.dweight, None
            if not unit:
                dweight.mul_(grad_weighted.to(dweight.dtype))
            dweight = dweight.to(ctx.weight_dtype)
        return dz, dweight, None, None, None, None


def fwd_bwd_from_loss(loss_fn: Callable[..., torch.Tensor]) -> Callable:
    """Adapt a differentiable `loss_fn(hidden, weight, targets, ignore_index=...)` (an unfused
    cross-entropy, or another library's fused one) to the interface of
    `mtp.kernels.linear_cross_entropy_fwd_bwd`, through autograd; benchmarks compare with it."""

    def fwd_bwd(hidden, weight, targets, dweight_acc, *, scale=1.0, ignore_index=IGNORE_INDEX):
        with torch.enable_grad():
            hidden = hidden.detach().requires_grad_()
            weight = weight.detach().requires_grad_()
            loss = loss_fn(hidden, weight, targets, ignore_index=ignore_index)
            dh, dw = torch.autograd.grad(loss * scale, [hidden, weight])
        dweight_acc.add_(dw)
        return loss.detach().float(), dh

    return fwd_bwd


def sequential_mtp_loss(
    model: MTPTransformer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    head_weights: list[float] | None = None,
    *,
    with_accuracy: bool = False,
) -> MTPLossOutput:
    """The MTP loss with the loss path's peak memory independent of K.

    Trunk forward once; the heads run one at a time, each with the fused linear-cross-entropy
    kernel (`sequential_heads_loss`); the trunk backward runs once, with dL/dh summed over heads.
    Gradients equal those of `naive_mtp_loss`. Top-1 accuracy costs one more unembedding
    matmul per head (chunked, no gradient), so it is computed only when asked for.
    """
    if not torch.is_grad_enabled():
        return head_metrics(model, inputs, targets, head_weights)
    return model(inputs, heads_fn=functools.partial(
        sequential_heads_loss, model, targets=targets, head_weights=head_weights,
        with_accuracy=with_accuracy))


def sequential_heads_loss(
    model: MTPTransformer,
    h: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    targets: torch.Tensor,
    head_weights: list[float] | None = None,
    *,
    with_accuracy: bool = False,
    fwd_bwd: Callable = linear_cross_entropy_fwd_bwd,
) -> MTPLossOutput:
    """The heads' part of `sequential_mtp_loss`, from the trunk output h (B, T, d).

    Each head runs under activation checkpointing: its block's activations are recomputed in the
    backward, so between forward and backward a head keeps only dL/dz (N x d) and the trunk
    output h is the one activation all heads share. Everything stays in the ordinary autograd
    graph, so gradient accumulation, loss scaling, DDP and FSDP (one sharded unit per head) see
    a plain forward and backward.

    `fwd_bwd` is the loss-and-gradients function (`mtp.kernels.linear_cross_entropy_fwd_bwd`);
    benchmarks swap in `fwd_bwd_from_loss(unfused_ce)` to separate what the sequential order
    saves from what the fused kernel saves.
    """
    # NOTE: design. Measured on the `cpu` model (K = 4, matched parameters, fp32, 2 threads,
    # interleaved, median of 5), this pass against the earlier one that ran every head's backward
    # inside one autograd node during the forward (which FSDP cannot shard, as its parameter
    # gradients bypass the sharded parameters' hooks): ~1.0x the time. Recomputing the loss in
    # the backward instead of keeping dL/dz (so that only h is kept) cost 1.5x the time.
    W = model.unembed.weight
    weights = head_weights or [1.0] * model.cfg.n_future
    shared = _SharedWeightGrad()
    weighted, head_losses, head_accs = [], [], []
    for i in range(model.cfg.n_future):
        z = checkpoint(model.head_hidden, i, h, rope, use_reentrant=False,
                       preserve_rng_state=False)  # (B, T, d)
        t = targets[i].flatten()
        w_loss, loss = _FusedHeadLoss.apply(z.flatten(0, 1), W, t, weights[i], shared, fwd_bwd)
        weighted.append(w_loss)
        head_losses.append(loss)
        if with_accuracy:
            head_accs.append(_accuracy(z.detach().flatten(0, 1), W, t))
        del z  # the head's activations are gone until its backward recomputes them
    return MTPLossOutput(torch.stack(weighted).sum(), torch.stack(head_losses),
                         torch.stack(head_accs) if with_accuracy else None)


@torch.no_grad()
def head_metrics(
    model: MTPTransformer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    head_weights: list[float] | None = None,
    chunk: int = 1024,
) -> MTPLossOutput:
    """Per-head loss and top-1 accuracy without gradients, holding chunk x V logits at most."""
    return model(inputs, heads_fn=functools.partial(_heads_metrics, model, targets=targets,
                                                    head_weights=head_weights, chunk=chunk))


def _heads_metrics(model: MTPTransformer, h: torch.Tensor, rope: tuple[torch.Tensor, ...],
                   targets: torch.Tensor, head_weights: list[float] | None,
                   chunk: int) -> MTPLossOutput:
    W = model.unembed.weight
    losses, accs = [], []
    for i in range(model.cfg.n_future):
        z = model.head_hidden(i, h, rope).flatten(0, 1)  # (N, d)
        t = targets[i].flatten()
        losses.append(linear_cross_entropy(z, W, t, ignore_index=IGNORE_INDEX))
        accs.append(_accuracy(z, W, t, chunk))
    losses = torch.stack(losses)
    weights = _head_weights(head_weights, len(losses), h.device)
    return MTPLossOutput((weights * losses).sum(), losses, torch.stack(accs))


@torch.no_grad()
def _accuracy(z: torch.Tensor, W: torch.Tensor, t: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """Top-1 accuracy of z @ W.T (z is (N, d)) over non-ignored targets, chunk x V at a time."""
    hits = z.new_zeros((), dtype=torch.long)
    for a in range(0, len(t), chunk):
        pred = (z[a:a + chunk] @ W.T).argmax(-1)  # (chunk,)
        hits += (pred == t[a:a + chunk]).sum()  # an ignored target (-100) never matches
    return hits / (t != IGNORE_INDEX).sum().clamp(min=1)

"""The ``torch.autograd.Function`` of each implementation, and the reduction they share.

``_LinearCrossEntropyTorch`` wraps the chunked PyTorch pass of :mod:`mtp.kernels.torch_path`
(gradients computed in the forward); ``_LinearCrossEntropyTriton`` wraps the launchers of
:mod:`mtp.kernels.launch` (online log-sum-exp forward, backward that recomputes the logits).
Both take validated inputs: :mod:`mtp.kernels.dispatch` checks them first.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .launch import _triton_backward, _triton_forward
from .torch_path import _torch_chunked_pass


def _reduce(loss: Tensor, valid: Tensor, reduction: str) -> tuple[Tensor, Tensor]:
    """Reduced loss and the per-row factor d(reduced)/d(loss_i) (0 on ignored rows)."""
    if reduction == "none":
        return loss, valid.to(loss.dtype)
    if reduction == "sum":
        return loss.sum(), valid.to(loss.dtype)
    count = valid.sum().clamp(min=1).to(loss.dtype)
    return loss.sum() / count, valid.to(loss.dtype) / count


class _LinearCrossEntropyTorch(torch.autograd.Function):
    """Chunked PyTorch linear cross-entropy; gradients computed in the forward when possible."""

    # NOTE: for mean/sum the gradients are computed in the forward pass from each chunk's logits
    # and stashed (Liger-Kernel style); the backward only scales them by the incoming grad. The
    # alternative (save lse, recompute the logits in backward) does one more [chunk, d] x [d, V]
    # matmul per chunk: 4 instead of 3. Measured on a 2-core CPU, fp32, OMP_NUM_THREADS=1,
    # (N, d, V) = (2048, 256, 8192), default chunk (256), forward + backward, interleaved, min of
    # 7: stash 168 ms, recompute 232 ms (1.38x), the materialising reference 277 ms.
    # The cost is holding dhidden [N, d] and dweight [V, d] (fp32) from forward to backward, which
    # the sequential MTP pass frees at once. reduction="none" has a per-row incoming grad that
    # cannot be applied to a stashed dweight, so it recomputes in the backward.

    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, reduction, chunk, track):
        valid = targets != ignore_index
        stash = track and reduction != "none"
        grad_scale = None
        if stash:
            # d(reduced)/d(loss_i) is known before the loss itself: 1/count or 1 on valid rows.
            count = valid.sum().clamp(min=1)
            acc_dtype = torch.promote_types(hidden.dtype, torch.float32)
            grad_scale = valid.to(acc_dtype) / (count if reduction == "mean" else 1)
        loss, dhidden, dweight = _torch_chunked_pass(
            hidden, weight, targets, ignore_index, chunk, grad_scale
        )
        out, _ = _reduce(loss, valid, reduction)
        ctx.reduction, ctx.ignore_index, ctx.chunk = reduction, ignore_index, chunk
        ctx.dtypes = (hidden.dtype, weight.dtype)
        if stash:
            # attributes, not saved tensors: backward scales them in place and hands them over,
            # rather than holding a scaled copy next to each (2 x [V, d] fp32 at the peak)
            ctx.stashed = (dhidden, dweight)
        else:
            ctx.save_for_backward(hidden, weight, targets)
        ctx.mark_non_differentiable(targets)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.reduction != "none":
            if not hasattr(ctx, "stashed"):
                raise RuntimeError("linear_cross_entropy supports one backward per forward "
                                   "(its gradients were computed in the forward)")
            dhidden, dweight = ctx.stashed
            del ctx.stashed
            if not (grad_out == 1).all():
                g = grad_out.to(dhidden.dtype)
                dhidden.mul_(g)
                dweight.mul_(g)
        else:
            hidden, weight, targets = ctx.saved_tensors
            valid = targets != ctx.ignore_index
            scale = grad_out.to(torch.promote_types(hidden.dtype, torch.float32)) * valid
            _, dhidden, dweight = _torch_chunked_pass(
                hidden, weight, targets, ctx.ignore_index, ctx.chunk, scale
            )
        hidden_dtype, weight_dtype = ctx.dtypes
        dh = dhidden.to(hidden_dtype) if ctx.needs_input_grad[0] else None
        dw = dweight.to(weight_dtype) if ctx.needs_input_grad[1] else None
        return dh, dw, None, None, None, None, None


class _LinearCrossEntropyTriton(torch.autograd.Function):
    """Fused forward (online log-sum-exp) and chunked backward (recomputed logit tiles)."""

    # NOTE: the backward recomputes the logits, so a training step costs 8 N d V FLOPs (forward
    # 2, recompute 2, dhidden 2, dweight 2) against 6 for an unfused matmul + cross-entropy; the
    # project's target (50% of peak on the 6 N d V basis) then needs 67% of peak on the FLOPs done.
    # In exchange nothing is stashed between forward and backward beyond lse [N], which keeps the
    # naive "sum K head losses, then one backward" usage at O(N d + V d) memory too. The
    # alternative, Liger-style (write each chunk's fp32 logits in the forward, compute both
    # gradients there, 6 N d V), is not measured on a GPU yet; scripts/gpu_check.sh measures
    # this version against Liger-Kernel and cut-cross-entropy.

    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, reduction, chunk, cfg):
        lse, loss = _triton_forward(hidden, weight, targets, ignore_index, cfg)
        valid = targets != ignore_index
        out, row_factor = _reduce(loss, valid, reduction)
        ctx.save_for_backward(hidden, weight, targets, lse, row_factor)
        ctx.chunk, ctx.cfg = chunk, cfg
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, targets, lse, row_factor = ctx.saved_tensors
        scale = (row_factor * grad_out.to(row_factor.dtype)).contiguous()
        dhidden, dweight = _triton_backward(
            hidden,
            weight,
            targets,
            lse,
            scale,
            ctx.chunk,
            ctx.cfg,
            ctx.needs_input_grad[0],
            ctx.needs_input_grad[1],
        )
        return dhidden, dweight, None, None, None, None, None

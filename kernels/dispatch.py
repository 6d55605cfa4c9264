"""Fused linear + cross-entropy: the loss of ``hidden @ weight.T`` without the ``[N, V]`` logits.

The unembedding of a language model produces the largest buffers of a training step: ``N x V``
logits (and their gradient) for ``N`` tokens and a vocabulary of ``V``. This op computes

    loss_i = logsumexp_v(h_i . w_v) - h_i . w_{t_i}

and its gradients with respect to ``hidden`` (``[N, d]``) and ``weight`` (``[V, d]``) while holding
at most a chunk of the logits at a time.

Two implementations share one contract:

* **Triton** (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1`` for tests). The forward
  kernel tiles tokens x vocabulary, computes logit tiles with ``tl.dot`` and keeps an online
  log-sum-exp per row, so the forward never writes a logit to memory. The backward walks chunks of
  tokens: one kernel recomputes the logit tiles of a chunk and writes ``dlogits = (softmax -
  onehot) * scale`` for that chunk (``chunk x V``), then two matmul kernels accumulate ``dhidden``
  (loop over V) and ``dweight`` (loop over the chunk's tokens, into an fp32 buffer that persists
  across chunks).
* **Torch** (the CPU path, or any device with ``impl="torch"``): the same chunking in plain
  PyTorch, with the gradients computed in the forward pass from the chunk's logits (Liger-Kernel
  style) when they are needed; half-precision weights are cast to fp32 one row slice at a time,
  never as a whole.

``linear_cross_entropy_reference`` materialises the logits; tests and benchmarks share it.

This module holds the public entry points and the autograd Functions, on the primitives of
:mod:`~mtp.kernels.forward` (``triton_forward``, ``torch_forward``) and
:mod:`~mtp.kernels.backward` (``triton_backward``, ``torch_forward_backward``). Each entry point
checks its inputs once (:func:`~mtp.kernels.validate.check_inputs`) and picks the chunk and the
tiles in one place (``_plan``); the per-row gradient scale (``_row_factor``) and the reduction
(``_reduce``) serve every Function and :func:`linear_cross_entropy_fwd_bwd` alike.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from .backward import torch_forward_backward, triton_backward
from .forward import TritonConfig, default_config, torch_forward, triton_forward
from .reference import Reduction
from .validate import Impl, check_inputs

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------------------------
# Chunk and tiles; gradient scale and reduction
# ----------------------------------------------------------------------------------------------

# Peak size of the per-chunk [chunk, V] buffers. On the GPU the dweight kernel reads and writes
# the fp32 [V, d] accumulator once per chunk, i.e. 8 V d bytes per chunk against 8 chunk V d
# FLOPs, so its memory traffic costs about (H200: 989 TFLOP/s / 4.8 TB/s ~ 200 FLOP/byte)
# 200 / chunk of the run time: 5% at chunk = 4096 tokens. 1 GiB of bf16 dlogits is 4096 tokens at
# V = 128256; the token cap keeps small vocabularies from turning the chunk into all of N.
_CUDA_CHUNK_BYTES = 1 << 30
_CUDA_MAX_CHUNK_TOKENS = 4096
# On CPU a chunk whose fp32 logits stay near the cache (8 MiB) keeps the softmax passes from
# running at DRAM speed, while 64+ tokens keep the matmuls efficient; 8 MiB is 256 tokens at
# V = 8192 (`mtp bench kernel` times the CPU path at that vocabulary).
_CPU_CHUNK_BYTES = 8 << 20
_CPU_MIN_CHUNK_TOKENS = 64


def _default_chunk(n: int, vocab: int, impl: str, itemsize: int) -> int:
    """Tokens per chunk when the caller gives none: the byte budget of ``impl``'s device."""
    if impl == "triton":
        by_bytes = _CUDA_CHUNK_BYTES // (vocab * itemsize)
        return max(1, min(n, _CUDA_MAX_CHUNK_TOKENS, max(128, by_bytes)))
    return max(1, min(n, max(_CPU_MIN_CHUNK_TOKENS, _CPU_CHUNK_BYTES // (vocab * 4))))


def _plan(
    hidden: Tensor,
    weight: Tensor,
    impl: str,
    chunk_size: int | None,
    config: TritonConfig | None,
) -> tuple[str, int, TritonConfig | None]:
    """The implementation that runs, its tokens per chunk and (Triton) its tiles: the caller's,
    else the defaults for the device. An empty batch runs the torch path: the kernels cannot
    launch an empty grid, and the torch path gives loss 0 and zero gradients."""
    n, vocab = hidden.shape[0], weight.shape[0]
    if impl == "triton" and n > 0:
        _announce("triton", hidden)
        chunk = chunk_size or _default_chunk(n, vocab, "triton", hidden.element_size())
        return "triton", chunk, config or default_config(hidden.dtype, hidden.device)
    _announce("torch", hidden)
    return "torch", chunk_size or _default_chunk(n, vocab, "torch", 4), None


_announced: set[tuple[str, str, torch.dtype]] = set()


def _announce(impl: str, hidden: Tensor) -> None:
    """Log at INFO, once per process for each implementation, device type and dtype, which
    implementation runs: a run can then show that its loss took the Triton kernels rather than
    the torch path (`scripts/gpu_check.sh` asserts it of `mtp fit` on CUDA)."""
    key = (impl, hidden.device.type, hidden.dtype)
    if key not in _announced:
        _announced.add(key)
        log.info("linear cross-entropy: %s implementation on %s %s tensors", impl,
                 hidden.device.type, str(hidden.dtype).removeprefix("torch."))


def _row_factor(
    valid: Tensor, reduction: str, dtype: torch.dtype
) -> tuple[Tensor, Tensor | None]:
    """The gradient scale of each row, d(reduced)/d(loss_i) (0 on ignored rows), in ``dtype``,
    and the number of rows the mean divides by (``None`` unless ``reduction="mean"``)."""
    factor = valid.to(dtype)
    if reduction != "mean":
        return factor, None
    count = valid.sum().clamp(min=1).to(dtype)
    return factor / count, count


def _reduce(loss: Tensor, reduction: str, count: Tensor | None) -> Tensor:
    """The per-row ``loss`` reduced; ``count`` is :func:`_row_factor`'s divisor of the mean."""
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / count


def _autocast_inputs(hidden: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """Autocast's rule for a matmul: fp16/bf16/fp32 operands go to the autocast dtype, fp64
    operands are left alone."""
    if torch.is_autocast_enabled(hidden.device.type):
        dtype = torch.get_autocast_dtype(hidden.device.type)
        eligible = (torch.float16, torch.bfloat16, torch.float32)
        if hidden.dtype in eligible and weight.dtype in eligible:
            return hidden.to(dtype), weight.to(dtype)
    return hidden, weight


# ----------------------------------------------------------------------------------------------
# The autograd Functions
# ----------------------------------------------------------------------------------------------


class _LinearCrossEntropyTorch(torch.autograd.Function):
    """Chunked PyTorch linear cross-entropy; gradients computed in the forward when possible."""

    # NOTE: for mean/sum the gradients are computed in the forward pass from each chunk's logits
    # and stashed (Liger-Kernel style); the backward only scales them by the incoming grad. The
    # alternative (save lse, recompute the logits in backward) does one more [chunk, d] x [d, V]
    # matmul per chunk, 4 instead of 3, and runs slower on CPU than stashing (`mtp bench kernel`
    # on CPU times this path against the materialising reference).
    # The cost is holding dhidden [N, d] and dweight [V, d] (fp32) from forward to backward, which
    # the sequential MTP pass frees at once. reduction="none" has a per-row incoming grad that
    # cannot be applied to a stashed dweight, so it recomputes in the backward.

    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, reduction, chunk, track):
        acc_dtype = torch.promote_types(hidden.dtype, torch.float32)
        # d(reduced)/d(loss_i) is known before the loss itself: 1/count or 1 on valid rows.
        row_factor, count = _row_factor(targets != ignore_index, reduction, acc_dtype)
        ctx.reduction, ctx.ignore_index, ctx.chunk = reduction, ignore_index, chunk
        ctx.dtypes = (hidden.dtype, weight.dtype)
        if track and reduction != "none":
            loss, dhidden, dweight = torch_forward_backward(
                hidden, weight, targets, ignore_index, chunk, row_factor
            )
            # attributes, not saved tensors: backward scales them in place and hands them over,
            # rather than holding a scaled copy next to each (2 x [V, d] fp32 at the peak)
            ctx.stashed = (dhidden, dweight)
        else:
            loss = torch_forward(hidden, weight, targets, ignore_index, chunk)
            ctx.save_for_backward(hidden, weight, targets, row_factor)
        ctx.mark_non_differentiable(targets)
        return _reduce(loss, reduction, count)

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
            hidden, weight, targets, row_factor = ctx.saved_tensors
            grad_scale = row_factor * grad_out.to(row_factor.dtype)
            _, dhidden, dweight = torch_forward_backward(
                hidden, weight, targets, ctx.ignore_index, ctx.chunk, grad_scale
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
    # gradients there, 6 N d V), trades that memory for the recompute; scripts/gpu_check.sh
    # measures this version against Liger-Kernel and cut-cross-entropy.

    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, reduction, chunk, cfg):
        lse, loss = triton_forward(hidden, weight, targets, ignore_index, cfg)
        row_factor, count = _row_factor(targets != ignore_index, reduction, loss.dtype)
        ctx.save_for_backward(hidden, weight, targets, lse, row_factor)
        ctx.chunk, ctx.cfg = chunk, cfg
        return _reduce(loss, reduction, count)

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, targets, lse, row_factor = ctx.saved_tensors
        scale = (row_factor * grad_out.to(row_factor.dtype)).contiguous()
        dhidden, dweight = triton_backward(
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


def _loss(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    ignore_index: int,
    reduction: str,
    impl: str,
    chunk_size: int | None,
    config: TritonConfig | None,
) -> Tensor:
    """The loss through the autograd Function of ``impl``, on validated inputs (targets int64)."""
    hidden, weight = hidden.contiguous(), weight.contiguous()
    impl, chunk, cfg = _plan(hidden, weight, impl, chunk_size, config)
    if impl == "triton":
        return _LinearCrossEntropyTriton.apply(
            hidden, weight, targets.contiguous(), ignore_index, reduction, chunk, cfg
        )
    # Inside Function.forward needs_input_grad stays True under torch.no_grad, so whether a
    # backward can happen is decided here: evaluation must not pay for stashed gradients.
    track = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _LinearCrossEntropyTorch.apply(
        hidden, weight, targets, ignore_index, reduction, chunk, track
    )


# ----------------------------------------------------------------------------------------------
# The public entry points
# ----------------------------------------------------------------------------------------------


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    impl: Impl = "auto",
    chunk_size: int | None = None,
) -> Tensor:
    """Cross-entropy of ``hidden @ weight.T`` against ``targets``, never materialising the logits.

    Differentiable with respect to ``hidden`` and ``weight``; gradients come back in the inputs'
    dtypes and are accumulated in fp32 (fp64 for fp64 inputs). Under ``torch.autocast`` both inputs
    are cast to the autocast dtype first, as a matmul would be.

    Args:
        hidden: ``[N, d]`` activations (fp16, bf16, fp32 or fp64).
        weight: ``[V, d]`` unembedding, same dtype as ``hidden``.
        targets: ``[N]`` int64 token ids in ``[0, V)`` or ``ignore_index``.
        ignore_index: Target value whose positions contribute neither loss nor gradient.
        reduction: ``"mean"`` over non-ignored positions, ``"sum"``, or ``"none"`` (``[N]``).
        impl: ``"triton"`` (CUDA, or CPU under ``TRITON_INTERPRET=1``), ``"torch"`` (chunked
            PyTorch, any device), or ``"auto"``: Triton for CUDA tensors (an error if triton is
            not installed, never a silent fallback), torch otherwise.
        chunk_size: Tokens per chunk (peak extra memory is about ``chunk_size x V``); ``None``
            picks a size from the vocabulary and the device.

    Returns:
        The loss in fp32 (fp64 for fp64 inputs): a scalar, or ``[N]`` for ``reduction="none"``.
        With ``reduction="mean"`` and every target ignored the loss is 0 with zero gradients.

    Raises:
        ValueError: On a wrong shape, dtype, device, reduction, impl, or an out-of-range target.
        ImportError: When the Triton kernels are to run (CUDA tensors with ``impl="auto"``, or
            ``impl="triton"``) and triton is not installed.
    """
    # NOTE: an all-ignored batch gives loss 0 (torch.nn.functional.cross_entropy gives NaN), so that
    # the sequential multi-token loss stays finite when one head has no valid target (the last K-1
    # positions of a short window, or a fully padded micro-batch); 0/1 instead of 0/0.
    hidden, weight = _autocast_inputs(hidden, weight)
    impl = check_inputs(hidden, weight, targets, ignore_index, reduction, impl, chunk_size)
    targets = targets.long()
    with torch.autocast(hidden.device.type, enabled=False):
        return _loss(hidden, weight, targets, ignore_index, reduction, impl, chunk_size, None)


def linear_cross_entropy_fwd_bwd(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    dweight_acc: Tensor,
    *,
    scale: float | Tensor = 1.0,
    ignore_index: int = -100,
    impl: Impl = "auto",
    chunk_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Mean cross-entropy of ``hidden @ weight.T`` and its gradients in one call, no autograd.

    For a caller that sums several such losses over one shared ``weight`` (the sequential
    multi-token pass): ``scale * dloss/dweight`` is added straight into ``dweight_acc``, so the
    weight gradient exists once, however many losses share it.

    Args:
        hidden: ``[N, d]`` activations (under autocast, cast as in :func:`linear_cross_entropy`).
        weight: ``[V, d]`` weight.
        targets: ``[N]`` token ids or ``ignore_index``.
        dweight_acc: ``[V, d]`` fp32 (fp64 for fp64 inputs) contiguous buffer to add into.
        scale: Factor of the loss whose gradients are taken (e.g. a head weight).
        ignore_index: Target value without loss or gradient.
        impl: As in :func:`linear_cross_entropy`.
        chunk_size: As in :func:`linear_cross_entropy`.

    Returns:
        ``(loss, dhidden)``: the mean loss (fp32, unscaled) and ``scale * dloss/dhidden`` in
        ``hidden``'s dtype.
    """
    hidden, weight = _autocast_inputs(hidden, weight)
    impl = check_inputs(hidden, weight, targets, ignore_index, "mean", impl, chunk_size,
                        dweight_acc)
    hidden, weight, targets = hidden.contiguous(), weight.contiguous(), targets.long()
    impl, chunk, cfg = _plan(hidden, weight, impl, chunk_size, None)
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
        # the Functions' primitives, forward then backward, with `scale` as the incoming grad
        row_factor, count = _row_factor(targets != ignore_index, "mean", dweight_acc.dtype)
        grad_scale = (row_factor * scale).contiguous()
        if impl == "triton":
            lse, loss = triton_forward(hidden, weight, targets, ignore_index, cfg)
            dhidden, _ = triton_backward(hidden, weight, targets, lse, grad_scale, chunk, cfg,
                                         True, True, dweight_out=dweight_acc)
        else:
            loss, dhidden, _ = torch_forward_backward(hidden, weight, targets, ignore_index,
                                                      chunk, grad_scale, dweight_out=dweight_acc)
            dhidden = dhidden.to(hidden.dtype)
        return _reduce(loss, "mean", count), dhidden


def linear_cross_entropy_triton(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    chunk_size: int | None = None,
    config: TritonConfig | None = None,
) -> Tensor:
    """The Triton implementation of :func:`linear_cross_entropy`, with tunable tiles.

    Runs on CUDA tensors, or on CPU tensors when ``TRITON_INTERPRET=1`` was set before
    ``mtp.kernels`` was imported (tests).

    Args:
        hidden: ``[N, d]`` activations.
        weight: ``[V, d]`` unembedding, same dtype as ``hidden``.
        targets: ``[N]`` int64 token ids in ``[0, V)`` or ``ignore_index``.
        ignore_index: Target value whose positions contribute neither loss nor gradient.
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.
        chunk_size: Tokens per backward chunk (the ``[chunk, V]`` dlogits buffer); ``None``
            picks one.
        config: Tile sizes; ``None`` picks defaults for the dtype and device.

    Returns:
        The loss in fp32 (fp64 for fp64 inputs).
    """
    check_inputs(hidden, weight, targets, ignore_index, reduction, "triton", chunk_size)
    return _loss(hidden, weight, targets.long(), ignore_index, reduction, "triton", chunk_size,
                 config)

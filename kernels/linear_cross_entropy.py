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
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - triton is an optional dependency on CPU-only installs
    HAS_TRITON = False

Reduction = Literal["mean", "sum", "none"]
Impl = Literal["auto", "triton", "torch"]
_REDUCTIONS = ("mean", "sum", "none")
_IMPLS = ("auto", "triton", "torch")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# Peak size of the per-chunk [chunk, V] buffers. On the GPU the dweight kernel reads and writes
# the fp32 [V, d] accumulator once per chunk, i.e. 8 V d bytes per chunk against 8 chunk V d
# FLOPs, so its memory traffic costs about (H200: 989 TFLOP/s / 4.8 TB/s ~ 200 FLOP/byte)
# 200 / chunk of the run time: 5% at chunk = 4096 tokens. 1 GiB of bf16 dlogits is 4096 tokens at
# V = 128256; the token cap keeps small vocabularies from turning the chunk into all of N.
_CUDA_CHUNK_BYTES = 1 << 30
_CUDA_MAX_CHUNK_TOKENS = 4096
# On CPU a chunk whose fp32 logits stay near the cache (8 MiB) keeps the softmax passes from
# running at DRAM speed, while 64+ tokens keep the matmuls efficient. Measured, (N, d, V) =
# (2048, 256, 8192), fp32, 1 thread, forward + backward, interleaved runs, min of 5: chunk 32:
# 442 ms, 128: 373 ms, 512: 404 ms, 2048: 378 ms (a noisy shared machine: +-20%); forward only:
# 126, 71, 83, 94 ms. 8 MiB is 256 tokens at V = 8192.
_CPU_CHUNK_BYTES = 8 << 20
_CPU_MIN_CHUNK_TOKENS = 64
# NOTE: the torch path computes in fp32 from half-precision inputs (fp32 logits, gradients
# accumulated in fp32, as the Triton kernels do), but never holds an fp32 copy of the whole
# [V, d] weight (2 GiB at V = 128256, d = 4096): it casts row slices of this size as it reaches
# them, twice per token chunk (logits, dhidden), each small enough to stay in cache for the
# matmul that reads it. Measured on a 2-core CPU, bf16, forward + backward, interleaved, min of
# 9, the former full fp32 copy against slices of 2 / 8 / 32 MiB: (N, d, V) = (2048, 256, 8192):
# 1 thread 452 ms against 409 / 455 / 474, 2 threads 313 against 265 / 350 / 337;
# (1024, 128, 32000): 1 thread 593 against 592 / 656 / 726, 2 threads 379 against
# 353 / 429 / 593. The loss and dweight are bit-identical, dhidden within 2e-6 (the sum over V
# runs slice by slice); fp32 and fp64 weights are used as they are, unsliced.
_TORCH_WEIGHT_SLICE_BYTES = 2 << 20


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Validation and dispatch
# --------------------------------------------------------------------------------------------


def _validate(
    hidden: Tensor, weight: Tensor, targets: Tensor, ignore_index: int, reduction: str
) -> None:
    """Raise ``ValueError`` naming the argument for every input that would give a wrong loss."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS} (got {reduction!r})")
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be 2-D [N, d] (got shape {tuple(hidden.shape)})")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [V, d] (got shape {tuple(weight.shape)})")
    if targets.dim() != 1:
        raise ValueError(f"targets must be 1-D [N] (got shape {tuple(targets.shape)})")
    if hidden.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"hidden must be a floating tensor in {_FLOAT_DTYPES} (got {hidden.dtype})"
        )
    if weight.dtype != hidden.dtype:
        raise ValueError(
            f"weight dtype must match hidden dtype {hidden.dtype} (got {weight.dtype}); cast one, "
            "or run under torch.autocast"
        )
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets must be int64 or int32 (got {targets.dtype})")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"weight must be [V, d] with d = hidden.shape[1] = {hidden.shape[1]} "
            f"(got weight shape {tuple(weight.shape)})"
        )
    if targets.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"targets must have N = hidden.shape[0] = {hidden.shape[0]} entries "
            f"(got targets shape {tuple(targets.shape)})"
        )
    if weight.shape[0] == 0 or hidden.shape[1] == 0:
        raise ValueError(f"weight must be non-empty (got shape {tuple(weight.shape)})")
    if not (hidden.device == weight.device == targets.device):
        raise ValueError(
            f"hidden, weight and targets must be on one device (got {hidden.device}, "
            f"{weight.device}, {targets.device})"
        )
    if targets.numel() > 0:
        # One min/max reduction (one host sync on CUDA): an out-of-range target would otherwise
        # be read as a silent wrong loss (the kernels never find its logit) or a crash.
        vocab = weight.shape[0]
        checked = targets.masked_fill(targets == ignore_index, 0)
        lo, hi = torch.aminmax(checked)
        lo, hi = int(lo), int(hi)
        if lo < 0 or hi >= vocab:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"targets must be in [0, V={vocab}) or equal ignore_index={ignore_index} "
                f"(got {bad})"
            )


def _triton_is_interpreted() -> bool:
    """Whether the Triton kernels of this module were built by the CPU interpreter."""
    if not HAS_TRITON:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_linear_cross_entropy_fwd_kernel, InterpretedFunction)


def _resolve_impl(impl: str, device: torch.device) -> str:
    """The implementation that runs: ``auto`` is Triton on CUDA and torch elsewhere.

    Never a silent fallback: on CUDA without an importable triton, ``auto`` raises rather than
    running the chunked torch path (fp32 matmuls, no tensor cores, for half-precision inputs);
    ``impl="torch"`` asks for that path explicitly.
    """
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS} (got {impl!r})")
    if impl == "auto":
        impl = "triton" if device.type == "cuda" else "torch"
    if impl == "triton":
        if not HAS_TRITON:
            raise ImportError(
                f"linear_cross_entropy on {device.type} tensors runs the Triton kernels, but "
                "triton is not importable: `pip install triton`, or pass impl='torch' to run "
                "the chunked PyTorch path instead"
            )
        if device.type != "cuda" and not _triton_is_interpreted():
            raise ValueError(
                f"impl='triton' on {device.type} tensors needs TRITON_INTERPRET=1 set before "
                "mtp.kernels is imported"
            )
    return impl


def _default_chunk(n: int, vocab: int, impl: str, itemsize: int) -> int:
    if impl == "triton":
        by_bytes = _CUDA_CHUNK_BYTES // (vocab * itemsize)
        return max(1, min(n, _CUDA_MAX_CHUNK_TOKENS, max(128, by_bytes)))
    return max(1, min(n, max(_CPU_MIN_CHUNK_TOKENS, _CPU_CHUNK_BYTES // (vocab * 4))))


def _autocast_inputs(hidden: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """Autocast's rule for a matmul: fp16/bf16/fp32 operands go to the autocast dtype, fp64
    operands are left alone."""
    if torch.is_autocast_enabled(hidden.device.type):
        dtype = torch.get_autocast_dtype(hidden.device.type)
        eligible = (torch.float16, torch.bfloat16, torch.float32)
        if hidden.dtype in eligible and weight.dtype in eligible:
            return hidden.to(dtype), weight.to(dtype)
    return hidden, weight


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
    _validate(hidden, weight, targets, ignore_index, reduction)
    impl = _resolve_impl(impl, hidden.device)
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 (got {chunk_size})")
    targets = targets.long()
    with torch.autocast(hidden.device.type, enabled=False):
        if impl == "triton":
            return linear_cross_entropy_triton(
                hidden,
                weight,
                targets,
                ignore_index=ignore_index,
                reduction=reduction,
                chunk_size=chunk_size,
                _validated=True,
            )
        chunk = chunk_size or _default_chunk(hidden.shape[0], weight.shape[0], "torch", 4)
        # Inside Function.forward needs_input_grad stays True under torch.no_grad, so whether a
        # backward can happen is decided here: evaluation must not pay for stashed gradients.
        track = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
        return _LinearCrossEntropyTorch.apply(
            hidden.contiguous(), weight.contiguous(), targets, ignore_index, reduction, chunk, track
        )


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
    _validate(hidden, weight, targets, ignore_index, "mean")
    acc_dtype = torch.promote_types(hidden.dtype, torch.float32)
    if (dweight_acc.shape != weight.shape or dweight_acc.dtype != acc_dtype
            or not dweight_acc.is_contiguous() or dweight_acc.device != weight.device):
        raise ValueError(f"dweight_acc must be a contiguous {acc_dtype} tensor of shape "
                         f"{tuple(weight.shape)} on {weight.device} (got {dweight_acc.dtype} "
                         f"{tuple(dweight_acc.shape)} on {dweight_acc.device})")
    impl = _resolve_impl(impl, hidden.device)
    hidden, weight, targets = hidden.contiguous(), weight.contiguous(), targets.long()
    valid = targets != ignore_index
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
        if impl == "triton" and hidden.shape[0] > 0:
            n, vocab = hidden.shape[0], weight.shape[0]
            chunk = chunk_size or _default_chunk(n, vocab, "triton", hidden.element_size())
            cfg = _default_config(hidden.dtype, hidden.device)
            lse, loss = _triton_forward(hidden, weight, targets, ignore_index, cfg)
            out, row_factor = _reduce(loss, valid, "mean")
            dhidden, _ = _triton_backward(hidden, weight, targets, lse,
                                          (row_factor * scale).contiguous(), chunk, cfg,
                                          True, True, dweight_out=dweight_acc)
            return out, dhidden
        chunk = chunk_size or _default_chunk(hidden.shape[0], weight.shape[0], "torch", 4)
        count = valid.sum().clamp(min=1)
        grad_scale = valid.to(acc_dtype) * scale / count
        loss, dhidden, _ = _torch_chunked_pass(hidden, weight, targets, ignore_index, chunk,
                                               grad_scale, dweight_out=dweight_acc)
        out, _ = _reduce(loss, valid, "mean")
        return out, dhidden.to(hidden.dtype)


# --------------------------------------------------------------------------------------------
# Torch (CPU) path
# --------------------------------------------------------------------------------------------


def _weight_slices(weight: Tensor, acc_dtype: torch.dtype) -> Iterator[tuple[int, int, Tensor]]:
    """``(v0, v1, weight[v0:v1])`` in ``acc_dtype``: the whole weight when it already has that
    dtype, else row slices of at most ``_TORCH_WEIGHT_SLICE_BYTES``, each cast when reached."""
    vocab, d = weight.shape
    if weight.dtype == acc_dtype:
        yield 0, vocab, weight
        return
    rows = max(1, _TORCH_WEIGHT_SLICE_BYTES // (d * acc_dtype.itemsize))
    for v0 in range(0, vocab, rows):
        v1 = min(v0 + rows, vocab)
        yield v0, v1, weight[v0:v1].to(acc_dtype)


def _torch_chunked_pass(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    ignore_index: int,
    chunk: int,
    grad_scale: Tensor | None,
    dweight_out: Tensor | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Per-row losses and, if ``grad_scale`` is given, the gradients of ``sum_i scale_i loss_i``.

    Args:
        hidden: ``[N, d]``.
        weight: ``[V, d]``.
        targets: ``[N]`` int64.
        ignore_index: Ignored target value.
        chunk: Tokens per chunk.
        grad_scale: ``[N]`` per-row factor of the gradient (0 on ignored rows), or ``None`` for a
            forward-only pass.
        dweight_out: ``[V, d]`` buffer in the accumulation dtype that dweight is added into
            (and returned), instead of a new one.

    Returns:
        ``(loss [N], dhidden [N, d], dweight [V, d])`` in the accumulation dtype (fp32, or fp64 for
        fp64 inputs); the gradients are ``None`` when ``grad_scale`` is ``None``.
    """
    acc_dtype = torch.promote_types(hidden.dtype, torch.float32)
    n, vocab = hidden.shape[0], weight.shape[0]
    valid = targets != ignore_index  # (N,)
    safe_targets = targets.masked_fill(~valid, 0)
    loss = torch.empty(n, dtype=acc_dtype, device=hidden.device)
    dhidden = dweight = None
    if grad_scale is not None:
        dhidden = torch.empty(n, hidden.shape[1], dtype=acc_dtype, device=hidden.device)
        dweight = dweight_out if dweight_out is not None else torch.zeros(
            vocab, hidden.shape[1], dtype=acc_dtype, device=hidden.device)
    logits_buf = torch.empty(min(chunk, n), vocab, dtype=acc_dtype, device=hidden.device)
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        h = hidden[start:end].to(acc_dtype)  # (C, d)
        logits = logits_buf[:end - start]  # (C, V)
        for v0, v1, w in _weight_slices(weight, acc_dtype):
            torch.mm(h, w.T, out=logits[:, v0:v1])
        tgt = safe_targets[start:end, None]  # (C, 1)
        target_logit = logits.gather(1, tgt)  # (C, 1)
        # One exp pass serves both the log-sum-exp and the softmax: exp(z - max) in place.
        row_max = logits.amax(dim=1, keepdim=True)  # (C, 1)
        exps = logits.sub_(row_max).exp_()  # (C, V)
        row_sum = exps.sum(dim=1, keepdim=True)  # (C, 1)
        lse = row_max + row_sum.log()
        loss[start:end] = torch.where(valid[start:end], (lse - target_logit).squeeze(1), 0.0)
        if grad_scale is None:
            continue
        # dlogits = (softmax - onehot) * scale, in place: the softmax division and the per-row
        # scale share one pass over the chunk.
        scale = grad_scale[start:end, None]  # (C, 1)
        dlogits = exps.mul_(scale / row_sum)
        dlogits.scatter_add_(1, tgt, -scale)
        dh = dhidden[start:end]  # (C, d)
        for v0, v1, w in _weight_slices(weight, acc_dtype):
            if v0 == 0:
                torch.mm(dlogits[:, :v1], w, out=dh)
            else:
                dh.addmm_(dlogits[:, v0:v1], w)
        dweight.addmm_(dlogits.T, h)
    return loss, dhidden, dweight


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


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _grouped_program_id(num_m, num_n, GROUP: tl.constexpr):
        """This program's (m, n) tile, ordered so that programs running together share inputs.

        A 2-D grid launches row after row of tiles, so the ~132 programs resident at once would
        each need a distinct tile of one operand and evict each other from L2; walking GROUP rows
        of tiles per column (the Triton matmul tutorial's ordering) keeps both operands' tiles of
        the resident programs in L2.
        """
        pid = tl.program_id(0)
        per_group = GROUP * num_n
        first_m = (pid // per_group) * GROUP
        group_size = tl.minimum(num_m - first_m, GROUP)
        pid_m = first_m + (pid % per_group) % group_size
        pid_n = (pid % per_group) // group_size
        return pid_m, pid_n

    @triton.jit
    def _linear_cross_entropy_fwd_kernel(
        hidden_ptr,  # (N, d)
        weight_ptr,  # (V, d)
        targets_ptr,  # (N,)
        lse_ptr,  # (SPLITS, N): log-sum-exp of each row over this split's vocabulary range
        target_logit_ptr,  # (SPLITS, N): the target's logit if it lies in this split, else 0
        N,
        V,
        D,
        stride_h,
        stride_w,
        ignore_index,
        n_splits,
        tiles_per_split,
        BLOCK_N: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_D: tl.constexpr,
        GROUP: tl.constexpr,
        ACC_DTYPE: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
    ):
        # Row offsets are widened to int64 before the stride multiply: V x d reaches 2^31 elements
        # at V = 256k, d = 8192, and chunk x V at 16k x 128k (the same in every kernel below).
        pid_n, split = _grouped_program_id(tl.cdiv(N, BLOCK_N), n_splits, GROUP)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        tgt = tl.load(targets_ptr + offs_n, mask=mask_n, other=ignore_index)
        v_begin = split * tiles_per_split * BLOCK_V
        v_end = tl.minimum(v_begin + tiles_per_split * BLOCK_V, V)

        row_max = tl.full((BLOCK_N,), float("-inf"), dtype=ACC_DTYPE)
        row_sum = tl.zeros((BLOCK_N,), dtype=ACC_DTYPE)
        target_logit = tl.zeros((BLOCK_N,), dtype=ACC_DTYPE)
        for v0 in range(v_begin, v_end, BLOCK_V):
            offs_v = v0 + tl.arange(0, BLOCK_V)
            mask_v = offs_v < v_end
            logits = tl.zeros((BLOCK_N, BLOCK_V), dtype=ACC_DTYPE)
            for d0 in range(0, D, BLOCK_D):
                offs_d = d0 + tl.arange(0, BLOCK_D)
                mask_d = offs_d < D
                h = tl.load(
                    hidden_ptr + offs_n[:, None].to(tl.int64) * stride_h + offs_d[None, :],
                    mask=mask_n[:, None] & mask_d[None, :],
                    other=0.0,
                )
                w = tl.load(
                    weight_ptr + offs_v[:, None].to(tl.int64) * stride_w + offs_d[None, :],
                    mask=mask_v[:, None] & mask_d[None, :],
                    other=0.0,
                )
                logits = tl.dot(
                    h, tl.trans(w), logits, input_precision=INPUT_PRECISION, out_dtype=ACC_DTYPE
                )
            logits = tl.where(mask_v[None, :], logits, float("-inf"))
            # Online log-sum-exp: rescale the running sum to the new running max.
            new_max = tl.maximum(row_max, tl.max(logits, axis=1))
            row_sum = row_sum * tl.exp(row_max - new_max) + tl.sum(
                tl.exp(logits - new_max[:, None]), axis=1
            )
            row_max = new_max
            is_target = offs_v[None, :] == tgt[:, None]
            target_logit += tl.sum(tl.where(is_target, logits, 0.0), axis=1)

        lse = row_max + tl.log(row_sum)
        tl.store(lse_ptr + split * N + offs_n, lse, mask=mask_n)
        tl.store(target_logit_ptr + split * N + offs_n, target_logit, mask=mask_n)

    @triton.jit
    def _linear_cross_entropy_dlogits_kernel(
        hidden_ptr,  # (C, d): one chunk of tokens
        weight_ptr,  # (V, d)
        targets_ptr,  # (C,)
        lse_ptr,  # (C,)
        scale_ptr,  # (C,): d(loss)/d(loss_i), 0 on ignored rows
        dlogits_ptr,  # (C, V) out, in the input dtype
        C,
        V,
        D,
        stride_h,
        stride_w,
        stride_g,
        BLOCK_N: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_D: tl.constexpr,
        GROUP: tl.constexpr,
        ACC_DTYPE: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
    ):
        pid_n, pid_v = _grouped_program_id(tl.cdiv(C, BLOCK_N), tl.cdiv(V, BLOCK_V), GROUP)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        mask_n = offs_n < C
        mask_v = offs_v < V
        logits = tl.zeros((BLOCK_N, BLOCK_V), dtype=ACC_DTYPE)
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            mask_d = offs_d < D
            h = tl.load(
                hidden_ptr + offs_n[:, None].to(tl.int64) * stride_h + offs_d[None, :],
                mask=mask_n[:, None] & mask_d[None, :],
                other=0.0,
            )
            w = tl.load(
                weight_ptr + offs_v[:, None].to(tl.int64) * stride_w + offs_d[None, :],
                mask=mask_v[:, None] & mask_d[None, :],
                other=0.0,
            )
            logits = tl.dot(
                h, tl.trans(w), logits, input_precision=INPUT_PRECISION, out_dtype=ACC_DTYPE
            )
        tgt = tl.load(targets_ptr + offs_n, mask=mask_n, other=-1)
        lse = tl.load(lse_ptr + offs_n, mask=mask_n, other=0.0)
        scale = tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)
        probs = tl.exp(logits - lse[:, None])
        dlogits = probs - tl.where(offs_v[None, :] == tgt[:, None], 1.0, 0.0)
        dlogits = dlogits * scale[:, None]
        tl.store(
            dlogits_ptr + offs_n[:, None].to(tl.int64) * stride_g + offs_v[None, :],
            dlogits.to(dlogits_ptr.dtype.element_ty),
            mask=mask_n[:, None] & mask_v[None, :],
        )

    @triton.jit
    def _linear_cross_entropy_dhidden_kernel(
        dlogits_ptr,  # (C, V)
        weight_ptr,  # (V, d)
        dhidden_ptr,  # (C, d) out, in the input dtype
        C,
        V,
        D,
        stride_g,
        stride_w,
        stride_dh,
        BLOCK_N: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_D: tl.constexpr,
        GROUP: tl.constexpr,
        ACC_DTYPE: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
    ):
        pid_n, pid_d = _grouped_program_id(tl.cdiv(C, BLOCK_N), tl.cdiv(D, BLOCK_D), GROUP)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
        mask_n = offs_n < C
        mask_d = offs_d < D
        acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=ACC_DTYPE)
        for v0 in range(0, V, BLOCK_V):
            offs_v = v0 + tl.arange(0, BLOCK_V)
            mask_v = offs_v < V
            g = tl.load(
                dlogits_ptr + offs_n[:, None].to(tl.int64) * stride_g + offs_v[None, :],
                mask=mask_n[:, None] & mask_v[None, :],
                other=0.0,
            )
            w = tl.load(
                weight_ptr + offs_v[:, None].to(tl.int64) * stride_w + offs_d[None, :],
                mask=mask_v[:, None] & mask_d[None, :],
                other=0.0,
            )
            acc = tl.dot(g, w, acc, input_precision=INPUT_PRECISION, out_dtype=ACC_DTYPE)
        tl.store(
            dhidden_ptr + offs_n[:, None].to(tl.int64) * stride_dh + offs_d[None, :],
            acc.to(dhidden_ptr.dtype.element_ty),
            mask=mask_n[:, None] & mask_d[None, :],
        )

    @triton.jit
    def _linear_cross_entropy_dweight_kernel(
        dlogits_ptr,  # (C, V)
        hidden_ptr,  # (C, d)
        dweight_ptr,  # (V, d) accumulator in ACC_DTYPE, read-modify-written once per chunk
        C,
        V,
        D,
        stride_g,
        stride_h,
        stride_dw,
        BLOCK_N: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_D: tl.constexpr,
        GROUP: tl.constexpr,
        ACC_DTYPE: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
    ):
        pid_v, pid_d = _grouped_program_id(tl.cdiv(V, BLOCK_V), tl.cdiv(D, BLOCK_D), GROUP)
        offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
        mask_v = offs_v < V
        mask_d = offs_d < D
        acc = tl.zeros((BLOCK_V, BLOCK_D), dtype=ACC_DTYPE)
        for n0 in range(0, C, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < C
            g = tl.load(
                dlogits_ptr + offs_n[:, None].to(tl.int64) * stride_g + offs_v[None, :],
                mask=mask_n[:, None] & mask_v[None, :],
                other=0.0,
            )
            h = tl.load(
                hidden_ptr + offs_n[:, None].to(tl.int64) * stride_h + offs_d[None, :],
                mask=mask_n[:, None] & mask_d[None, :],
                other=0.0,
            )
            acc = tl.dot(tl.trans(g), h, acc, input_precision=INPUT_PRECISION, out_dtype=ACC_DTYPE)
        # Each program owns its [BLOCK_V, BLOCK_D] tile, so the cross-chunk sum needs no atomics.
        dw_ptrs = dweight_ptr + offs_v[:, None].to(tl.int64) * stride_dw + offs_d[None, :]
        mask = mask_v[:, None] & mask_d[None, :]
        tl.store(dw_ptrs, tl.load(dw_ptrs, mask=mask, other=0.0) + acc, mask=mask)


@dataclass(frozen=True)
class TritonConfig:
    """Tile sizes and launch parameters shared by the four kernels.

    The forward and dlogits kernels tile (tokens x vocabulary) with a K-loop over d; dhidden tiles
    (tokens x d) with a K-loop over V; dweight tiles (vocabulary x d) with a K-loop over tokens.
    """

    block_n: int = 128
    block_v: int = 128
    block_d: int = 64
    num_warps: int = 8
    num_stages: int = 3
    group: int = 8
    """Rows of tiles per column in the launch order (L2 reuse, see _grouped_program_id)."""
    v_splits: int | None = None
    """Vocabulary splits of the forward grid; ``None`` picks enough to fill the GPU."""


def _default_config(dtype: torch.dtype, device: torch.device) -> TritonConfig:
    # NOTE: unmeasured on a GPU as of this commit (no device in the authoring session); the sizes
    # follow the Triton matmul tutorial's H100 configs. bf16/fp16, 3 stages: the forward and
    # dlogits kernels (128 x 128 tiles, K step 64 over d) hold 3 x (128 + 128) x 64 x 2 B = 96 KiB
    # of shared memory, dhidden and dweight (128 x 64 tiles, K step 128) 3 x 48 KiB = 144 KiB. fp32
    # (IEEE, no tensor cores unless torch allows TF32) and fp64 double the bytes per element, so
    # their tiles shrink to stay within the 228 KiB of an SM. scripts/gpu_check.sh sweeps these.
    if device.type != "cuda":
        # The interpreter runs numpy on whole tiles: small tiles keep test shapes multi-tile.
        return TritonConfig(block_n=16, block_v=16, block_d=16, num_warps=1, num_stages=1)
    if dtype in (torch.bfloat16, torch.float16):
        return TritonConfig()
    if dtype == torch.float32:
        return TritonConfig(block_n=64, block_v=64, block_d=32, num_warps=4, num_stages=3)
    return TritonConfig(block_n=32, block_v=32, block_d=32, num_warps=4, num_stages=2)


def _triton_dtypes(dtype: torch.dtype) -> tuple:
    acc = tl.float64 if dtype == torch.float64 else tl.float32
    if dtype == torch.float32:
        # Follow torch's own fp32 matmul setting: TF32 only where the user opted in.
        precision = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    elif dtype == torch.float64:
        precision = "ieee"
    else:
        precision = "tf32"  # Triton's default; it only affects fp32 operands, i.e. none here
    return acc, precision


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def _triton_forward(
    hidden: Tensor, weight: Tensor, targets: Tensor, ignore_index: int, cfg: TritonConfig
) -> tuple[Tensor, Tensor]:
    """Per-row ``lse`` and loss (0 on ignored rows), in the accumulation dtype."""
    n, d = hidden.shape
    vocab = weight.shape[0]
    acc_dtype = torch.promote_types(hidden.dtype, torch.float32)
    tl_acc, precision = _triton_dtypes(hidden.dtype)
    n_blocks = triton.cdiv(n, cfg.block_n)
    v_tiles = triton.cdiv(vocab, cfg.block_v)
    # Few token blocks (N = 8192 is 64 blocks of 128 on a 132-SM H100) would leave SMs idle, so the
    # vocabulary is split across programs too and the partial log-sum-exps merged afterwards.
    splits = cfg.v_splits or max(1, triton.cdiv(4 * _sm_count(hidden.device), n_blocks))
    splits = min(splits, v_tiles)
    tiles_per_split = triton.cdiv(v_tiles, splits)
    splits = triton.cdiv(v_tiles, tiles_per_split)  # no empty split
    lse_parts = torch.empty(splits, n, dtype=acc_dtype, device=hidden.device)
    target_parts = torch.empty(splits, n, dtype=acc_dtype, device=hidden.device)
    _linear_cross_entropy_fwd_kernel[(n_blocks * splits,)](
        hidden,
        weight,
        targets,
        lse_parts,
        target_parts,
        n,
        vocab,
        d,
        hidden.stride(0),
        weight.stride(0),
        ignore_index,
        splits,
        tiles_per_split,
        BLOCK_N=cfg.block_n,
        BLOCK_V=cfg.block_v,
        BLOCK_D=cfg.block_d,
        GROUP=cfg.group,
        ACC_DTYPE=tl_acc,
        INPUT_PRECISION=precision,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    lse = torch.logsumexp(lse_parts, dim=0) if splits > 1 else lse_parts[0]
    target_logit = target_parts.sum(dim=0)
    loss = torch.where(targets != ignore_index, lse - target_logit, 0.0)
    return lse, loss


def _triton_backward(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    lse: Tensor,
    scale: Tensor,
    chunk: int,
    cfg: TritonConfig,
    need_dhidden: bool,
    need_dweight: bool,
    dweight_out: Tensor | None = None,
) -> tuple[Tensor | None, Tensor | None]:
    """Gradients of ``sum_i scale_i loss_i``; dhidden in hidden's dtype, dweight in weight's
    (or added into ``dweight_out``, an accumulation-dtype buffer, which is returned as it is)."""
    n, d = hidden.shape
    vocab = weight.shape[0]
    acc_dtype = torch.promote_types(hidden.dtype, torch.float32)
    tl_acc, precision = _triton_dtypes(hidden.dtype)
    dhidden = torch.empty_like(hidden) if need_dhidden else None
    dweight = dweight_out
    if dweight is None and need_dweight:
        dweight = torch.zeros(vocab, d, dtype=acc_dtype, device=weight.device)
    # NOTE: dlogits are stored in the input dtype (bf16 for bf16 runs) so that the two gradient
    # matmuls run on tensor cores; they are the same bf16 dlogits that torch's own autograd feeds to
    # its matmul backward. Every sum (over V for dhidden, over tokens and chunks for dweight) is
    # accumulated in ACC_DTYPE.
    dlogits = torch.empty(min(chunk, n), vocab, dtype=hidden.dtype, device=hidden.device)
    launch = dict(
        BLOCK_N=cfg.block_n,
        BLOCK_V=cfg.block_v,
        BLOCK_D=cfg.block_d,
        GROUP=cfg.group,
        ACC_DTYPE=tl_acc,
        INPUT_PRECISION=precision,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        c = end - start
        h = hidden[start:end]
        g = dlogits[:c]
        grid = (triton.cdiv(c, cfg.block_n) * triton.cdiv(vocab, cfg.block_v),)
        _linear_cross_entropy_dlogits_kernel[grid](
            h,
            weight,
            targets[start:end],
            lse[start:end],
            scale[start:end],
            g,
            c,
            vocab,
            d,
            h.stride(0),
            weight.stride(0),
            g.stride(0),
            **launch,
        )
        if dhidden is not None:
            dh = dhidden[start:end]
            grid = (triton.cdiv(c, cfg.block_n) * triton.cdiv(d, cfg.block_d),)
            _linear_cross_entropy_dhidden_kernel[grid](
                g, weight, dh, c, vocab, d, g.stride(0), weight.stride(0), dh.stride(0), **launch
            )
        if dweight is not None:
            grid = (triton.cdiv(vocab, cfg.block_v) * triton.cdiv(d, cfg.block_d),)
            _linear_cross_entropy_dweight_kernel[grid](
                g, h, dweight, c, vocab, d, g.stride(0), h.stride(0), dweight.stride(0), **launch
            )
    if dweight is not None and dweight_out is None:
        dweight = dweight.to(weight.dtype)
    return dhidden, dweight


class _LinearCrossEntropyTriton(torch.autograd.Function):
    """Fused forward (online log-sum-exp) and chunked backward (recomputed logit tiles)."""

    # NOTE: the backward recomputes the logits, so a training step costs 8 N d V FLOPs (forward
    # 2, recompute 2, dhidden 2, dweight 2) against 6 for an unfused matmul + cross-entropy; the
    # project's target (50% of peak on the 6 N d V basis) then needs 67% of peak on the FLOPs done.
    # In exchange nothing is stashed between forward and backward beyond lse [N], which keeps the
    # naive "sum K head losses, then one backward" usage at O(N d + V d) memory too. The
    # alternative, Liger-style (write each chunk's fp32 logits in the forward, compute both
    # gradients there, 6 N d V), is unmeasured: no GPU was available when this was written;
    # scripts/gpu_check.sh measures this version against Liger-Kernel and cut-cross-entropy.

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


def linear_cross_entropy_triton(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    chunk_size: int | None = None,
    config: TritonConfig | None = None,
    _validated: bool = False,
) -> Tensor:
    """The Triton implementation of :func:`linear_cross_entropy`, with tunable tiles.

    Runs on CUDA tensors, or on CPU tensors when ``TRITON_INTERPRET=1`` was set before this module
    was imported (tests).

    Args:
        hidden: ``[N, d]`` activations.
        weight: ``[V, d]`` unembedding, same dtype as ``hidden``.
        targets: ``[N]`` int64 token ids in ``[0, V)`` or ``ignore_index``.
        ignore_index: Target value whose positions contribute neither loss nor gradient.
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.
        chunk_size: Tokens per backward chunk (the ``[chunk, V]`` dlogits buffer); ``None``
            picks one.
        config: Tile sizes; ``None`` picks defaults for the dtype and device.
        _validated: Internal: the public wrapper has already validated the inputs.

    Returns:
        The loss in fp32 (fp64 for fp64 inputs).
    """
    if not _validated:
        _validate(hidden, weight, targets, ignore_index, reduction)
        _resolve_impl("triton", hidden.device)
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1 (got {chunk_size})")
        targets = targets.long()
    n, vocab = hidden.shape[0], weight.shape[0]
    chunk = chunk_size or _default_chunk(n, vocab, "triton", hidden.element_size())
    cfg = config or _default_config(hidden.dtype, hidden.device)
    if n == 0:
        # An empty grid cannot be launched; the torch path handles N = 0 (loss 0, zero grads).
        return _LinearCrossEntropyTorch.apply(
            hidden, weight, targets, ignore_index, reduction, 1, torch.is_grad_enabled()
        )
    return _LinearCrossEntropyTriton.apply(
        hidden.contiguous(),
        weight.contiguous(),
        targets.contiguous(),
        ignore_index,
        reduction,
        chunk,
        cfg,
    )


__all__ = [
    "TritonConfig",
    "linear_cross_entropy",
    "linear_cross_entropy_reference",
    "linear_cross_entropy_triton",
]

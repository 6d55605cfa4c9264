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

This module holds the public entry points. Each checks its inputs once
(:mod:`~mtp.kernels.validate`), picks the implementation and the chunk size, and calls internals
that trust their inputs: the autograd Functions of :mod:`~mtp.kernels.autograd`, or for
:func:`linear_cross_entropy_fwd_bwd` the passes themselves (:mod:`~mtp.kernels.torch_path`,
:mod:`~mtp.kernels.launch`, which launches the kernels of :mod:`~mtp.kernels.triton_kernels`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .autograd import _LinearCrossEntropyTorch, _LinearCrossEntropyTriton, _reduce
from .launch import TritonConfig, _default_config, _triton_backward, _triton_forward
from .reference import Reduction
from .torch_path import _torch_chunked_pass
from .validate import Impl, _resolve_impl, _validate, _validate_chunk_size

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


def _default_chunk(n: int, vocab: int, impl: str, itemsize: int) -> int:
    """Tokens per chunk when the caller gives none: the byte budget of ``impl``'s device."""
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


def _torch_loss(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    ignore_index: int,
    reduction: str,
    chunk_size: int | None,
) -> Tensor:
    """The chunked PyTorch path on validated inputs (``targets`` int64)."""
    chunk = chunk_size or _default_chunk(hidden.shape[0], weight.shape[0], "torch", 4)
    # Inside Function.forward needs_input_grad stays True under torch.no_grad, so whether a
    # backward can happen is decided here: evaluation must not pay for stashed gradients.
    track = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _LinearCrossEntropyTorch.apply(
        hidden.contiguous(), weight.contiguous(), targets, ignore_index, reduction, chunk, track
    )


def _triton_loss(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    ignore_index: int,
    reduction: str,
    chunk_size: int | None,
    config: TritonConfig | None = None,
) -> Tensor:
    """The Triton path on validated inputs (``targets`` int64) on a device it can run on."""
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
    _validate_chunk_size(chunk_size)
    targets = targets.long()
    with torch.autocast(hidden.device.type, enabled=False):
        if impl == "triton":
            return _triton_loss(hidden, weight, targets, ignore_index, reduction, chunk_size)
        return _torch_loss(hidden, weight, targets, ignore_index, reduction, chunk_size)


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
    _validate_chunk_size(chunk_size)
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
    _validate(hidden, weight, targets, ignore_index, reduction)
    _resolve_impl("triton", hidden.device)
    _validate_chunk_size(chunk_size)
    return _triton_loss(hidden, weight, targets.long(), ignore_index, reduction, chunk_size, config)

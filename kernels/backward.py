"""The backward of the fused linear cross-entropy: the gradients of ``sum_i scale_i loss_i``.

``dlogits = (softmax - onehot) * scale`` per row, then ``dhidden = dlogits @ weight`` and
``dweight = dlogits.T @ hidden``, a chunk of tokens at a time (peak extra memory ``chunk x V``):

* **Triton**: :func:`triton_backward` walks the chunks. Per chunk,
  ``_linear_cross_entropy_dlogits_kernel`` recomputes the logit tiles, takes the softmax from the
  forward's ``lse`` and writes the chunk's dlogits; ``_linear_cross_entropy_dhidden_kernel``
  (loop over V) and ``_linear_cross_entropy_dweight_kernel`` (loop over the chunk's tokens, into
  an accumulation buffer that persists across chunks) then take the two gradient matmuls. The
  tile helpers and :class:`~mtp.kernels.forward.TritonConfig` are the forward's.
* **Torch**: :func:`torch_forward_backward` takes each chunk's gradients from the logits of
  :func:`~mtp.kernels.forward.torch_forward_chunks` as the forward leaves them (Liger-Kernel
  style), so the loss and the gradients come from one pass.

Both take validated, contiguous inputs (:mod:`mtp.kernels.dispatch` checks them).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .forward import (
    HAS_TRITON,
    TritonConfig,
    launch_options,
    torch_forward_chunks,
    weight_slices,
)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .forward import grouped_program_id, load_tile, logits_tile


# ----------------------------------------------------------------------------------------------
# Triton: the kernels and their launcher
# ----------------------------------------------------------------------------------------------

if HAS_TRITON:

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
        pid_n, pid_v = grouped_program_id(tl.cdiv(C, BLOCK_N), tl.cdiv(V, BLOCK_V), GROUP)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        mask_n = offs_n < C
        mask_v = offs_v < V
        logits = logits_tile(hidden_ptr, weight_ptr, offs_n, offs_v, mask_n, mask_v, D, stride_h,
                             stride_w, BLOCK_N, BLOCK_V, BLOCK_D, ACC_DTYPE, INPUT_PRECISION)
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
        pid_n, pid_d = grouped_program_id(tl.cdiv(C, BLOCK_N), tl.cdiv(D, BLOCK_D), GROUP)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
        mask_n = offs_n < C
        mask_d = offs_d < D
        acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=ACC_DTYPE)
        for v0 in range(0, V, BLOCK_V):
            offs_v = v0 + tl.arange(0, BLOCK_V)
            mask_v = offs_v < V
            g = load_tile(dlogits_ptr, offs_n, offs_v, stride_g, mask_n, mask_v)
            w = load_tile(weight_ptr, offs_v, offs_d, stride_w, mask_v, mask_d)
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
        pid_v, pid_d = grouped_program_id(tl.cdiv(V, BLOCK_V), tl.cdiv(D, BLOCK_D), GROUP)
        offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
        mask_v = offs_v < V
        mask_d = offs_d < D
        acc = tl.zeros((BLOCK_V, BLOCK_D), dtype=ACC_DTYPE)
        for n0 in range(0, C, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < C
            g = load_tile(dlogits_ptr, offs_n, offs_v, stride_g, mask_n, mask_v)
            h = load_tile(hidden_ptr, offs_n, offs_d, stride_h, mask_n, mask_d)
            acc = tl.dot(tl.trans(g), h, acc, input_precision=INPUT_PRECISION, out_dtype=ACC_DTYPE)
        # Each program owns its [BLOCK_V, BLOCK_D] tile, so the cross-chunk sum needs no atomics.
        dw_ptrs = dweight_ptr + offs_v[:, None].to(tl.int64) * stride_dw + offs_d[None, :]
        mask = mask_v[:, None] & mask_d[None, :]
        tl.store(dw_ptrs, tl.load(dw_ptrs, mask=mask, other=0.0) + acc, mask=mask)

    #: The kernels of this module by name, for ahead-of-time compilation (:mod:`mtp.kernels.aot`).
    TRITON_KERNELS = {
        "_linear_cross_entropy_dlogits_kernel": _linear_cross_entropy_dlogits_kernel,
        "_linear_cross_entropy_dhidden_kernel": _linear_cross_entropy_dhidden_kernel,
        "_linear_cross_entropy_dweight_kernel": _linear_cross_entropy_dweight_kernel,
    }
else:  # pragma: no cover
    TRITON_KERNELS = {}


def triton_backward(
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
    """Gradients of ``sum_i scale_i loss_i`` from the forward's per-row ``lse``.

    ``scale`` is ``[N]``, contiguous, in the accumulation dtype (0 on ignored rows). dhidden comes
    back in hidden's dtype, dweight in weight's, or added into ``dweight_out`` (an accumulation-
    dtype buffer, returned as it is).
    """
    n, d = hidden.shape
    vocab = weight.shape[0]
    acc_dtype = torch.promote_types(hidden.dtype, torch.float32)
    dhidden = torch.empty_like(hidden) if need_dhidden else None
    dweight = dweight_out
    if dweight is None and need_dweight:
        dweight = torch.zeros(vocab, d, dtype=acc_dtype, device=weight.device)
    # NOTE: dlogits are stored in the input dtype (bf16 for bf16 runs) so that the two gradient
    # matmuls run on tensor cores; they are the same bf16 dlogits that torch's own autograd feeds to
    # its matmul backward. Every sum (over V for dhidden, over tokens and chunks for dweight) is
    # accumulated in ACC_DTYPE.
    dlogits = torch.empty(min(chunk, n), vocab, dtype=hidden.dtype, device=hidden.device)
    launch = launch_options(cfg, hidden.dtype)
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


# ----------------------------------------------------------------------------------------------
# Torch: the chunked twin
# ----------------------------------------------------------------------------------------------


def torch_forward_backward(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    ignore_index: int,
    chunk: int,
    grad_scale: Tensor,
    dweight_out: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row losses and the gradients of ``sum_i grad_scale_i loss_i``, from one chunked pass.

    Args:
        hidden: ``[N, d]``.
        weight: ``[V, d]``.
        targets: ``[N]`` int64.
        ignore_index: Ignored target value.
        chunk: Tokens per chunk.
        grad_scale: ``[N]`` per-row factor of the gradient (0 on ignored rows), in the
            accumulation dtype.
        dweight_out: ``[V, d]`` buffer in the accumulation dtype that dweight is added into
            (and returned), instead of a new one.

    Returns:
        ``(loss [N], dhidden [N, d], dweight [V, d])`` in the accumulation dtype (fp32, or fp64 for
        fp64 inputs).
    """
    acc_dtype = torch.promote_types(hidden.dtype, torch.float32)
    (n, d), vocab = hidden.shape, weight.shape[0]
    loss = torch.empty(n, dtype=acc_dtype, device=hidden.device)
    dhidden = torch.empty(n, d, dtype=acc_dtype, device=hidden.device)
    dweight = dweight_out if dweight_out is not None else torch.zeros(
        vocab, d, dtype=acc_dtype, device=hidden.device)
    chunks = torch_forward_chunks(hidden, weight, targets, ignore_index, chunk, loss)
    for start, end, h, tgt, exps, row_sum in chunks:
        # dlogits = (softmax - onehot) * scale, in place: the softmax division and the per-row
        # scale share one pass over the chunk.
        scale = grad_scale[start:end, None]  # (C, 1)
        dlogits = exps.mul_(scale / row_sum)  # (C, V)
        dlogits.scatter_add_(1, tgt, -scale)
        dh = dhidden[start:end]  # (C, d)
        for v0, v1, w in weight_slices(weight, acc_dtype):
            if v0 == 0:
                torch.mm(dlogits[:, :v1], w, out=dh)
            else:
                dh.addmm_(dlogits[:, v0:v1], w)
        dweight.addmm_(dlogits.T, h)
    return loss, dhidden, dweight

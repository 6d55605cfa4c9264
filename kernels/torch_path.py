"""The chunked PyTorch linear cross-entropy: the CPU path, and any device with ``impl="torch"``.

One pass over chunks of tokens computes each chunk's logits in the accumulation dtype (fp32, fp64
for fp64 inputs), its losses and, when asked, the chunk's gradients from the same logits.
Half-precision weights are cast one row slice at a time, never as a whole.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

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

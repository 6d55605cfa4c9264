"""Launching the Triton kernels: tile configuration, the forward and the chunked backward.

``TritonConfig`` holds the tiles, ``_default_config`` picks them for a dtype and device, and
``_triton_forward`` / ``_triton_backward`` allocate the buffers, size the grids and launch the
kernels of :mod:`mtp.kernels.triton_kernels`. Importable without triton; the launchers then
cannot be called.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .triton_kernels import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .triton_kernels import (
        _linear_cross_entropy_dhidden_kernel,
        _linear_cross_entropy_dlogits_kernel,
        _linear_cross_entropy_dweight_kernel,
        _linear_cross_entropy_fwd_kernel,
    )


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
    # NOTE: not measured on a GPU yet; the sizes follow the Triton matmul tutorial's H100 configs.
    # bf16/fp16, 3 stages: the forward and dlogits kernels (128 x 128 tiles, K step 64 over d)
    # hold 3 x (128 + 128) x 64 x 2 B = 96 KiB of shared memory, dhidden and dweight (128 x 64
    # tiles, K step 128) 3 x 48 KiB = 144 KiB. fp32 (IEEE, no tensor cores unless torch allows
    # TF32) and fp64 double the bytes per element, so their tiles shrink to stay within the
    # 228 KiB of an SM. scripts/gpu_check.sh sweeps these.
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


def _triton_is_interpreted() -> bool:
    """Whether the kernels of :mod:`mtp.kernels.triton_kernels` were built by the CPU
    interpreter (``TRITON_INTERPRET=1`` at import)."""
    if not HAS_TRITON:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_linear_cross_entropy_fwd_kernel, InterpretedFunction)


def _launch_options(cfg: TritonConfig, dtype: torch.dtype) -> dict:
    """The compile-time constants and launch settings every kernel takes."""
    tl_acc, precision = _triton_dtypes(dtype)
    return dict(BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_D=cfg.block_d, GROUP=cfg.group,
                ACC_DTYPE=tl_acc, INPUT_PRECISION=precision, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages)


def _triton_forward(
    hidden: Tensor, weight: Tensor, targets: Tensor, ignore_index: int, cfg: TritonConfig
) -> tuple[Tensor, Tensor]:
    """Per-row ``lse`` and loss (0 on ignored rows), in the accumulation dtype."""
    n, d = hidden.shape
    vocab = weight.shape[0]
    acc_dtype = torch.promote_types(hidden.dtype, torch.float32)
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
        **_launch_options(cfg, hidden.dtype),
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
    dhidden = torch.empty_like(hidden) if need_dhidden else None
    dweight = dweight_out
    if dweight is None and need_dweight:
        dweight = torch.zeros(vocab, d, dtype=acc_dtype, device=weight.device)
    # NOTE: dlogits are stored in the input dtype (bf16 for bf16 runs) so that the two gradient
    # matmuls run on tensor cores; they are the same bf16 dlogits that torch's own autograd feeds to
    # its matmul backward. Every sum (over V for dhidden, over tokens and chunks for dweight) is
    # accumulated in ACC_DTYPE.
    dlogits = torch.empty(min(chunk, n), vocab, dtype=hidden.dtype, device=hidden.device)
    launch = _launch_options(cfg, hidden.dtype)
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

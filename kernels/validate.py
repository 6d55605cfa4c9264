"""Input checks and the choice of implementation for the fused linear cross-entropy.

Each public entry point of :mod:`mtp.kernels.dispatch` runs :func:`check_inputs` once, then calls
internals that trust their inputs.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from .forward import HAS_TRITON, triton_is_interpreted

Impl = Literal["auto", "triton", "torch"]

_REDUCTIONS = ("mean", "sum", "none")
_IMPLS = ("auto", "triton", "torch")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_inputs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    ignore_index: int,
    reduction: str,
    impl: str,
    chunk_size: int | None,
    dweight_acc: Tensor | None = None,
) -> str:
    """Raise on every input that would give a wrong loss, naming the argument; return the
    implementation that runs (``"triton"`` or ``"torch"``).

    Raises:
        ValueError: On a wrong shape, dtype, device, reduction, impl, chunk size, an
            out-of-range target, or (when given) a ``dweight_acc`` that does not fit ``weight``.
        ImportError: When the Triton kernels are to run and triton is not installed.
    """
    _validate(hidden, weight, targets, ignore_index, reduction)
    if dweight_acc is not None:
        _validate_dweight_acc(dweight_acc, hidden, weight)
    impl = _resolve_impl(impl, hidden.device)
    _validate_chunk_size(chunk_size)
    return impl


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


def _validate_dweight_acc(dweight_acc: Tensor, hidden: Tensor, weight: Tensor) -> None:
    """Raise ``ValueError`` unless ``dweight_acc`` is a contiguous accumulation-dtype buffer
    shaped and placed like ``weight``."""
    acc_dtype = torch.promote_types(hidden.dtype, torch.float32)
    if (dweight_acc.shape != weight.shape or dweight_acc.dtype != acc_dtype
            or not dweight_acc.is_contiguous() or dweight_acc.device != weight.device):
        raise ValueError(f"dweight_acc must be a contiguous {acc_dtype} tensor of shape "
                         f"{tuple(weight.shape)} on {weight.device} (got {dweight_acc.dtype} "
                         f"{tuple(dweight_acc.shape)} on {dweight_acc.device})")


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
        if device.type != "cuda" and not triton_is_interpreted():
            raise ValueError(
                f"impl='triton' on {device.type} tensors needs TRITON_INTERPRET=1 set before "
                "mtp.kernels is imported"
            )
    return impl


def _validate_chunk_size(chunk_size: int | None) -> None:
    """Raise ``ValueError`` unless ``chunk_size`` is ``None`` (pick one) or positive."""
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 (got {chunk_size})")

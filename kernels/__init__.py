"""Triton kernels, each beside its PyTorch reference (imported as ``mtp.kernels``)."""

from mtp.kernels.linear_cross_entropy import (
    TritonConfig,
    linear_cross_entropy,
    linear_cross_entropy_fwd_bwd,
    linear_cross_entropy_reference,
    linear_cross_entropy_triton,
)

__all__ = [
    "TritonConfig",
    "linear_cross_entropy",
    "linear_cross_entropy_fwd_bwd",
    "linear_cross_entropy_reference",
    "linear_cross_entropy_triton",
]

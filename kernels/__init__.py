"""Triton kernels, each beside its PyTorch reference (imported as ``mtp.kernels``).

The fused linear cross-entropy, one concern per module:

* ``dispatch``: the public entry points (:func:`linear_cross_entropy`,
  :func:`linear_cross_entropy_fwd_bwd`, :func:`linear_cross_entropy_triton`);
* ``validate``: input checks and the choice of implementation;
* ``autograd``: the ``torch.autograd.Function`` of each implementation;
* ``torch_path``: the chunked PyTorch pass;
* ``triton_kernels``: the ``@triton.jit`` kernels;
* ``launch``: :class:`TritonConfig` and the launchers of those kernels;
* ``reference``: :func:`linear_cross_entropy_reference`, which materialises the logits;
* ``aot``: ahead-of-time compilation of the kernels for GPU targets (``python -m mtp.kernels.aot``).
"""

from .dispatch import (
    linear_cross_entropy,
    linear_cross_entropy_fwd_bwd,
    linear_cross_entropy_triton,
)
from .launch import TritonConfig
from .reference import linear_cross_entropy_reference

__all__ = [
    "TritonConfig",
    "linear_cross_entropy",
    "linear_cross_entropy_fwd_bwd",
    "linear_cross_entropy_reference",
    "linear_cross_entropy_triton",
]

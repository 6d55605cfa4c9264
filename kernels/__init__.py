"""Triton kernels, each beside its PyTorch twin and its reference (imported as ``mtp.kernels``).

The fused linear cross-entropy, read in two files per pass:

* ``forward``: the forward kernel, its launcher (``triton_forward``) and its chunked PyTorch twin
  (``torch_forward``), with what the backward shares: :class:`TritonConfig`, the default tiles,
  the tile helpers and the weight slicing of the torch path;
* ``backward``: the dlogits, dhidden and dweight kernels, their launcher (``triton_backward``)
  and the PyTorch twin (``torch_forward_backward``, gradients from the forward's logits);
* ``dispatch``: the public entry points (:func:`linear_cross_entropy`,
  :func:`linear_cross_entropy_fwd_bwd`, :func:`linear_cross_entropy_triton`), the autograd
  Function of each implementation, and the one choice of chunk, tiles and gradient scale they
  share;
* ``validate``: input checks and the choice of implementation;
* ``reference``: :func:`linear_cross_entropy_reference`, which materialises the logits;
* ``aot``: ahead-of-time compilation of the kernels for GPU targets (``python -m mtp.kernels.aot``).
"""

from .dispatch import (
    linear_cross_entropy,
    linear_cross_entropy_fwd_bwd,
    linear_cross_entropy_triton,
)
from .forward import TritonConfig
from .reference import linear_cross_entropy_reference

__all__ = [
    "TritonConfig",
    "linear_cross_entropy",
    "linear_cross_entropy_fwd_bwd",
    "linear_cross_entropy_reference",
    "linear_cross_entropy_triton",
]

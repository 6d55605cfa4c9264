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

if __name__ == "kernels":
    # Run from the repository root, Python finds this folder first under the bare name `kernels`,
    # which is Hugging Face's package (transformers imports it): hand over to that one, or report
    # `kernels` absent so that callers probing for it fall back.
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    _path = [p for p in sys.path if os.path.realpath(p or os.curdir) != _root]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _path)
    if _spec is None:
        del sys.modules["kernels"]
        raise ModuleNotFoundError("No module named 'kernels'", name="kernels")
    sys.modules["kernels"] = _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
else:
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

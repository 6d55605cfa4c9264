"""Prepacked weights for decoding on a CPU: a forward over a few tokens at the cost of one.

A decode forward multiplies 1 to 16 token vectors by every weight matrix of the model. On a CPU,
`torch.nn.functional.linear` does that through a general matrix product that re-lays out
(packs) the whole weight matrix on every call; with so few rows, packing and a kernel blocked
for large products cost more than reading the weights, so a forward over 4 tokens costs much
more than one over 1 token, and a speculative round must accept that many more tokens to pay.
oneDNN's linear over a weight packed once (`torch.ops.mkldnn._reorder_linear_weight`, the
weight prepacking inductor applies to frozen CPU models) reads the packed weight once per call
whatever the number of rows up to about 8, and is faster than the unpacked product even for one
row.

:func:`packed_linears` gives every `nn.Linear` of a model that packed product for the duration
of a block. The packed copies are made once and kept beside each module (keyed by the weight's
storage and version, so a weight changed in place is packed again); they cost as much memory as
the weights they mirror. The product is fp32 throughout: its rounding differs from
`F.linear`'s by a few ulps (the order of the sums), and the same packed product serves every
decoder, so greedy and speculative rounds see one arithmetic.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from weakref import WeakKeyDictionary

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["can_pack", "packed_linears"]

#: Rows the packed layout is chosen for (oneDNN's hint; any number of rows works).
_ROWS_HINT = 4
# module -> ((weight storage, version, shape), packed weight); weak, so it goes with the module.
_CACHE: WeakKeyDictionary[nn.Linear, tuple[tuple, torch.Tensor]] = WeakKeyDictionary()


def can_pack(module: nn.Linear) -> bool:
    """Whether `module`'s product can run on a packed weight: an fp32 CPU weight in an ordinary
    strided tensor, oneDNN built in, and no per-instance `forward` already installed (a hook
    library's, or an enclosing `packed_linears`)."""
    w = module.weight
    return (torch.backends.mkldnn.is_available() and w.device.type == "cpu"
            and w.dtype == torch.float32 and w.layout == torch.strided
            and type(w.data) is torch.Tensor and "forward" not in vars(module))


def _packed(module: nn.Linear) -> torch.Tensor:
    w = module.weight
    key = (w.data_ptr(), w._version, tuple(w.shape))
    cached = _CACHE.get(module)
    if cached is None or cached[0] != key:
        with torch.no_grad():
            cached = (key, torch.ops.mkldnn._reorder_linear_weight(w.detach(), _ROWS_HINT))
        _CACHE[module] = cached
    return cached[1]


def _forward(module: nn.Linear, packed: torch.Tensor):
    bias = None if module.bias is None else module.bias.detach()

    def forward(x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or x.dtype != torch.float32 or x.device.type != "cpu":
            return F.linear(x, module.weight, module.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")

    return forward


@contextmanager
def packed_linears(*models: nn.Module | None) -> Iterator[None]:
    """Within the block, every `nn.Linear` of `models` that :func:`can_pack` multiplies by its
    packed weight wherever gradients are off and its input is fp32 on the CPU (elsewhere it runs
    as before). On exit the modules are as they were. Models on another device, in another
    dtype, or None are left alone.

    Compiled modules (`--compile.enabled`) run eagerly within the block: inductor cannot compile
    the packed product, whose weight is an input rather than a constant, and the decode loop is
    not compiled anyway (`mtp.decoding.engine`)."""
    with ExitStack() as stack:
        stack.enter_context(torch.compiler.set_stance("force_eager"))
        for model in models:
            if model is None:
                continue
            for module in model.modules():
                if isinstance(module, nn.Linear) and can_pack(module):
                    module.forward = _forward(module, _packed(module))
                    stack.callback(delattr, module, "forward")
        yield

"""The chunked PyTorch path (``impl="torch"``: ``mtp.kernels.forward.torch_forward`` and
``mtp.kernels.backward.torch_forward_backward``) against an independent float64 reference, and its
memory contract: no fp32 copy of a half-precision weight."""

import math

import pytest
import torch
import torch.nn.functional as F
from lce_helpers import RTOL, SHAPES, check_against_reference, make_inputs
from mtp.kernels import forward as torch_path  # holds the torch path's weight slicing
from mtp.kernels import linear_cross_entropy, linear_cross_entropy_fwd_bwd
from torch.utils._python_dispatch import TorchDispatchMode


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("shape", list(SHAPES), ids=str)
def test_torch_path_matches_float64_reference(shape, dtype, reduction):
    n, d, vocab = shape

    def run(h, w, t, red):
        return linear_cross_entropy(h, w, t, reduction=red, impl="torch", chunk_size=n // 3 + 1)

    hidden, weight, targets = make_inputs(n, d, vocab, dtype)
    check_against_reference(run, hidden, weight, targets, reduction, RTOL[dtype], RTOL[dtype])


def test_torch_path_bf16_gradients_in_input_dtype():
    """bf16 inputs: fp32 loss, bf16 gradients accumulated in fp32. The loss is computed in fp32
    from the bf16 values (error ~1e-7 relative); each gradient element is rounded once to bf16
    (unit roundoff 2^-9 ~ 2e-3), so 4e-3 norm-wise is two units, far below a wrong-formula error."""
    hidden, weight, targets = make_inputs(37, 31, 123, torch.bfloat16)
    check_against_reference(
        lambda h, w, t, r: linear_cross_entropy(h, w, t, reduction=r, impl="torch", chunk_size=8),
        hidden, weight, targets, "mean", 1e-5, 4e-3,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# No fp32 copy of the whole weight
# ----------------------------------------------------------------------------------------------


class _Fp32Conversions(TorchDispatchMode):
    """Records the shape of every fp32 tensor a dtype conversion produces while active."""

    CONVERSIONS = (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.CONVERSIONS and out.dtype == torch.float32:
            src = args[1] if func is torch.ops.aten.copy_.default else args[0]
            if src.dtype != torch.float32:
                self.shapes.append(tuple(out.shape))
        return out


def _bf16_inputs(n=64, d=32, vocab=200):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, d, generator=gen, dtype=torch.float64)
    weight = torch.randn(vocab, d, generator=gen, dtype=torch.float64) * (3.0 / d**0.5)
    targets = torch.randint(0, vocab, (n,), generator=gen)
    targets[::7] = -100
    return (hidden.bfloat16().requires_grad_(), weight.bfloat16().requires_grad_(), targets)


@pytest.mark.parametrize("entry", ["linear_cross_entropy", "fwd_bwd"])
def test_torch_path_never_upcasts_the_whole_weight(entry, monkeypatch):
    hidden, weight, targets = _bf16_inputs()
    vocab, d = weight.shape
    # 48-row slices, 5 of them
    monkeypatch.setattr(torch_path, "_TORCH_WEIGHT_SLICE_BYTES", 48 * d * 4)
    with _Fp32Conversions() as probe:
        if entry == "fwd_bwd":
            acc = torch.zeros(vocab, d)  # the caller's fp32 dW buffer
            linear_cross_entropy_fwd_bwd(hidden.detach(), weight.detach(), targets, acc,
                                         impl="torch", chunk_size=16)
        else:
            linear_cross_entropy(hidden, weight, targets, impl="torch",
                                 chunk_size=16).backward()
    assert probe.shapes, "the probe saw no conversion at all"
    assert (vocab, d) not in probe.shapes
    # nothing larger than one weight slice or one token chunk of hidden is ever upcast
    assert max(math.prod(shape) for shape in probe.shapes) <= 48 * d

    with _Fp32Conversions() as probe:  # the probe catches a whole-weight upcast
        weight.detach().float()
    assert probe.shapes == [(vocab, d)]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_torch_path_sliced_weight_matches_float64_reference(reduction, monkeypatch):
    """Ragged weight slices (7 rows: 29 slices, the last of 4) and token chunks give the loss
    and gradients of one fp32 computation on the bf16 values: loss error ~1e-7 relative; each
    gradient element is rounded once to bf16 (unit roundoff 2^-9 ~ 2e-3), hence 4e-3 norm-wise,
    the bound of the unsliced bf16 test above."""
    hidden, weight, targets = _bf16_inputs()
    monkeypatch.setattr(torch_path, "_TORCH_WEIGHT_SLICE_BYTES", 7 * weight.shape[1] * 4)
    loss = linear_cross_entropy(hidden, weight, targets, reduction=reduction,
                                impl="torch", chunk_size=24)
    grad_out = torch.randn(loss.shape, generator=torch.Generator().manual_seed(1))
    (loss * grad_out).sum().backward()

    ref_h = hidden.detach().double().requires_grad_()
    ref_w = weight.detach().double().requires_grad_()
    ref = F.cross_entropy(ref_h @ ref_w.T, targets, ignore_index=-100, reduction=reduction)
    (ref * grad_out.double()).sum().backward()

    def rel(a, b):
        return ((a.double() - b).norm() / b.norm()).item()

    assert loss.dtype == torch.float32 and weight.grad.dtype == torch.bfloat16
    assert rel(loss.detach(), ref.detach()) <= 1e-5
    assert rel(hidden.grad, ref_h.grad) <= 4e-3
    assert rel(weight.grad, ref_w.grad) <= 4e-3

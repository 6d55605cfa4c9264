"""The materialising reference (``mtp.kernels.reference``) that benchmarks compare with, against
torch's cross-entropy on float64 logits."""

import pytest
import torch
from lce_helpers import IGNORE, make_inputs, reference_f64, rel_err
from mtp.kernels import linear_cross_entropy_reference


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_reference_matches_float64_cross_entropy(dtype, reduction):
    """fp64 inputs give the same computation (bound 1e-10, as for the fused paths); fp32 rounds
    each logit once in a length-d fp32 dot product, the fused paths' fp32 bound (1e-5) holds."""
    hidden, weight, targets = make_inputs(37, 31, 123, dtype)
    loss = linear_cross_entropy_reference(hidden, weight, targets, reduction=reduction)
    (loss.sum() if reduction == "none" else loss).backward()

    ref_h = hidden.detach().double().requires_grad_()
    ref_w = weight.detach().double().requires_grad_()
    ref = reference_f64(ref_h, ref_w, targets, reduction)
    (ref.sum() if reduction == "none" else ref).backward()

    tol = 1e-10 if dtype == torch.float64 else 1e-5
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert loss.shape == ref.shape
    assert rel_err(loss.detach(), ref.detach()) <= tol
    assert rel_err(hidden.grad, ref_h.grad) <= tol
    assert rel_err(weight.grad, ref_w.grad) <= tol


def test_reference_bf16_logits_are_rounded_to_bf16():
    """The unfused recipe: the bf16 matmul rounds the logits to bf16 before the fp32
    cross-entropy, which is what the fused paths' fp32 logits avoid. Both sides compute in fp32
    from the same bf16 logits and differ only in the order of their sums (~1e-7 relative)."""
    hidden, weight, targets = make_inputs(37, 31, 123, torch.bfloat16)
    loss = linear_cross_entropy_reference(hidden, weight, targets)
    rounded = (hidden @ weight.T).float()  # (N, V) bf16 logits, upcast
    expected = torch.nn.functional.cross_entropy(rounded, targets, ignore_index=IGNORE)
    assert loss.dtype == torch.float32
    assert rel_err(loss.detach(), expected.detach()) <= 1e-6


def test_reference_all_ignored_mean_is_zero():
    """The fused paths' convention: 0, not torch's NaN, for a mean over no target."""
    hidden, weight, _ = make_inputs(20, 17, 33, torch.float32)
    targets = torch.full((20,), IGNORE)
    loss = linear_cross_entropy_reference(hidden, weight, targets)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.all(hidden.grad == 0) and torch.all(weight.grad == 0)

"""What the fused linear cross-entropy tests share: inputs, the float64 reference, tolerances.

The kernels' own reference (``mtp.kernels.linear_cross_entropy_reference``) is under test too, so
the tests compare against ``reference_f64``, torch's ``cross_entropy`` on float64 logits.
"""

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # also when run without the repo's conftest

from mtp.kernels import TritonConfig  # noqa: E402
from mtp.kernels.forward import triton_is_interpreted as _triton_is_interpreted  # noqa: E402

IGNORE = -100
# Small tiles so that the awkward shapes span several tiles in every dimension, with ragged edges,
# several vocabulary splits in the forward and several backward chunks; the interpreter's cost
# grows with the number of tiles, hence two sizes. group=2 gives several launch-order groups and a
# ragged last one.
SMALL_TILES = TritonConfig(block_n=16, block_v=16, block_d=16, num_warps=1, group=2, v_splits=3)
LARGE_TILES = TritonConfig(block_n=64, block_v=64, block_d=64, num_warps=1, group=2, v_splits=3)
SHAPES = {(37, 31, 123): SMALL_TILES, (252, 123, 507): LARGE_TILES}  # (N, d, V) -> tiles
# Norm-wise relative error bounds. fp32: every logit is a length-d fp32 dot product and the
# gradients sum N or V terms; measured worst case over these tests 1e-7 (loss) and 5e-7
# (gradients), so 1e-5 is 20x headroom, while any formula error is >= 1e-3. fp64: measured
# <= 1e-15.
RTOL = {torch.float32: 1e-5, torch.float64: 1e-10}

interpreted = pytest.mark.skipif(
    not _triton_is_interpreted(),
    reason="the Triton interpreter is off (a CUDA machine); the GPU tests cover Triton there",
)
IMPLS = [pytest.param("triton", marks=interpreted), "torch"]


def reference_f64(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, reduction: str
) -> torch.Tensor:
    """torch's cross_entropy on float64 logits, with this project's all-ignored mean = 0."""
    logits = hidden.double() @ weight.double().T
    losses = F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="none")
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (targets != IGNORE).sum().clamp(min=1)


def make_inputs(n: int, d: int, vocab: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    """Inputs whose logits have a realistic spread (std ~3), targets hitting 0 and V-1, and ignored
    positions: scattered ones plus the whole first 16-token block (a tile of all-ignored rows)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=gen, dtype=torch.float64)
    weight = torch.randn(vocab, d, generator=gen, dtype=torch.float64) * (3.0 / d**0.5)
    targets = torch.randint(0, vocab, (n,), generator=gen)
    targets[:16] = IGNORE
    targets[16::7] = IGNORE
    targets[17] = 0
    targets[18] = vocab - 1
    return (
        hidden.to(device=device, dtype=dtype).requires_grad_(),
        weight.to(device=device, dtype=dtype).requires_grad_(),
        targets.to(device),
    )


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double()
    return ((actual.double() - expected).norm() / expected.norm().clamp(min=1e-300)).item()


def check_against_reference(run, hidden, weight, targets, reduction, rtol_loss, rtol_grad):
    """Loss and both gradients of ``run`` versus the float64 reference on the same inputs."""
    loss = run(hidden, weight, targets, reduction)
    # A random upstream gradient checks that backward scales by it (per row for "none").
    grad_out = torch.randn(loss.shape, generator=torch.Generator().manual_seed(1)).to(loss)
    (loss * grad_out).sum().backward()

    ref_h = hidden.detach().double().requires_grad_()
    ref_w = weight.detach().double().requires_grad_()
    ref = reference_f64(ref_h, ref_w, targets, reduction)
    (ref * grad_out.double()).sum().backward()

    expected_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    assert loss.dtype == expected_dtype
    assert loss.shape == ref.shape
    assert hidden.grad.dtype == hidden.dtype and weight.grad.dtype == weight.dtype
    assert rel_err(loss.detach(), ref.detach()) <= rtol_loss
    assert rel_err(hidden.grad, ref_h.grad) <= rtol_grad
    assert rel_err(weight.grad, ref_w.grad) <= rtol_grad
    ignored = targets == IGNORE
    assert torch.all(hidden.grad[ignored] == 0), "ignored rows must get no gradient"


def call_with_bad_input(fn, override: dict) -> None:
    """`fn(hidden, weight, targets, **kwargs)` on valid small inputs with `override` replacing
    an input or adding a keyword argument (a bad-input case)."""
    args = dict(hidden=torch.zeros(37, 31), weight=torch.zeros(123, 31),
                targets=torch.zeros(37, dtype=torch.long))
    kwargs = {}
    for key, value in override.items():
        (args if key in args else kwargs)[key] = value
    fn(args["hidden"], args["weight"], args["targets"], **kwargs)

"""The public entry points (``mtp.kernels.dispatch``): one contract for both implementations,
input validation that names the argument, the fused forward + backward, and the choice of
implementation (no silent fallback on CUDA).

Each behaviour runs on both implementations: Triton under ``TRITON_INTERPRET=1`` on CPU (set by
``tests/conftest.py`` before ``mtp.kernels`` is imported), and the chunked PyTorch path.
"""

import os

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # also when run without the repo's conftest

from lce_helpers import (  # noqa: E402
    IGNORE,
    IMPLS,
    SHAPES,
    call_with_bad_input,
    make_inputs,
    reference_f64,
    rel_err,
)
from mtp.kernels import (  # noqa: E402
    linear_cross_entropy,
    linear_cross_entropy_fwd_bwd,
    linear_cross_entropy_reference,
    validate,
)

# ----------------------------------------------------------------------------------------------
# Shared behaviour
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_all_ignored_gives_zero_loss_and_zero_grads(impl, reduction):
    # NOTE: torch's cross_entropy returns NaN for an all-ignored mean; we return 0 by design.
    hidden, weight, _ = make_inputs(20, 17, 33, torch.float32)
    targets = torch.full((20,), IGNORE)
    loss = linear_cross_entropy(hidden, weight, targets, reduction=reduction, impl=impl)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.all(hidden.grad == 0) and torch.all(weight.grad == 0)


@pytest.mark.parametrize("impl", IMPLS)
def test_custom_ignore_index_and_empty_batch(impl):
    hidden, weight, targets = make_inputs(37, 31, 123, torch.float64)
    targets = torch.where(targets == IGNORE, 5, targets)  # 5 is now the ignored id
    loss = linear_cross_entropy(hidden, weight, targets, ignore_index=5, impl=impl)
    logits = hidden.detach() @ weight.detach().T
    expected = F.cross_entropy(logits, targets, ignore_index=5)
    assert rel_err(loss.detach(), expected) <= 1e-10

    empty_h = torch.zeros(0, 31, dtype=torch.float64, requires_grad=True)
    empty = linear_cross_entropy(empty_h, weight, targets[:0], impl=impl)
    empty.backward()
    assert empty.item() == 0.0 and empty_h.grad.shape == (0, 31)


@pytest.mark.parametrize("impl", IMPLS)
def test_non_contiguous_inputs(impl):
    hidden, weight, targets = make_inputs(37, 31, 123, torch.float64)
    expected = reference_f64(hidden, weight, targets, "mean")
    hidden_t = hidden.detach().T.contiguous().T.requires_grad_()  # (N, d) with strides (1, N)
    weight_t = weight.detach().T.contiguous().T.requires_grad_()
    assert not hidden_t.is_contiguous() and not weight_t.is_contiguous()
    targets_t = torch.stack([targets, targets], dim=1)[:, 0]
    assert not targets_t.is_contiguous()
    loss = linear_cross_entropy(hidden_t, weight_t, targets_t, impl=impl)
    loss.backward()
    assert rel_err(loss.detach(), expected.detach()) <= 1e-10
    assert hidden_t.grad.shape == hidden.shape and weight_t.grad.shape == weight.shape


@pytest.mark.parametrize("frozen", ["weight", "hidden"])
@pytest.mark.parametrize("impl", IMPLS)
def test_frozen_input_and_no_grad_mode(impl, frozen):
    """Only the inputs that require grad get one; under no_grad the loss is still exact."""
    hidden, weight, targets = make_inputs(37, 31, 123, torch.float64)
    inputs = {"hidden": hidden, "weight": weight}
    inputs[frozen].requires_grad_(False)
    trained = "weight" if frozen == "hidden" else "hidden"
    ref = {k: v.detach().clone().requires_grad_(k == trained) for k, v in inputs.items()}
    expected = reference_f64(ref["hidden"], ref["weight"], targets, "mean")
    expected.backward()

    linear_cross_entropy(hidden, weight, targets, impl=impl).backward()
    assert inputs[frozen].grad is None
    assert rel_err(inputs[trained].grad, ref[trained].grad) <= 1e-10

    with torch.no_grad():
        evaluated = linear_cross_entropy(hidden, weight, targets, impl=impl)
    assert not evaluated.requires_grad
    assert rel_err(evaluated, expected.detach()) <= 1e-10


def test_autocast_casts_both_inputs_like_a_matmul():
    """Under bf16 autocast an fp32 weight meets bf16 activations; both become bf16, and the
    weight's gradient comes back to the fp32 parameter."""
    hidden, weight, targets = make_inputs(37, 31, 123, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(hidden.to(torch.bfloat16), weight, targets, impl="torch")
    loss.backward()
    assert loss.dtype == torch.float32 and weight.grad.dtype == torch.float32
    expected = reference_f64(hidden.bfloat16(), weight.bfloat16(), targets, "mean")
    assert rel_err(loss.detach(), expected.detach()) <= 1e-5


class _MaxBytes(TorchDispatchMode):
    """Records the largest output, in bytes, of any aten op run while active.

    Bytes rather than elements: the Triton interpreter moves kernel arguments as raw byte storages.
    """

    def __init__(self):
        super().__init__()
        self.max_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.max_bytes = max(self.max_bytes, t.numel() * t.element_size())
        return out


@pytest.mark.parametrize("impl", IMPLS)
def test_never_allocates_n_by_v(impl):
    """Forward and backward keep every buffer below N x V; the reference does not."""
    n, d, vocab = 96, 8, 80  # N d and V d are far below N V; chunks of 16 tokens
    hidden, weight, targets = make_inputs(n, d, vocab, torch.float32)
    logits_bytes = n * vocab * 4  # fp32

    with _MaxBytes() as fused:
        linear_cross_entropy(hidden, weight, targets, impl=impl, chunk_size=16).backward()
    assert 0 < fused.max_bytes <= 16 * vocab * 4 < logits_bytes

    with _MaxBytes() as naive:
        linear_cross_entropy_reference(hidden, weight, targets).backward()
    assert naive.max_bytes >= logits_bytes, "the probe must catch an N x V buffer"


BAD_INPUTS = [
    # (description, kwargs override, substring the message must contain)
    ("hidden 1-D", dict(hidden=torch.zeros(31)), "hidden"),
    ("weight 3-D", dict(weight=torch.zeros(1, 123, 31)), "weight"),
    ("targets 2-D", dict(targets=torch.zeros(37, 1, dtype=torch.long)), "targets"),
    ("weight d mismatch", dict(weight=torch.zeros(123, 30)), "weight"),
    ("targets N mismatch", dict(targets=torch.zeros(36, dtype=torch.long)), "targets"),
    ("dtype mismatch", dict(weight=torch.zeros(123, 31, dtype=torch.float64)), "weight dtype"),
    ("integer hidden", dict(hidden=torch.zeros(37, 31, dtype=torch.long)), "hidden"),
    ("float targets", dict(targets=torch.zeros(37)), "targets"),
    ("target == V", dict(targets=torch.full((37,), 123)), "got 123"),
    ("negative target", dict(targets=torch.full((37,), -1)), "got -1"),
    ("reduction", dict(reduction="avg"), "reduction"),
    ("impl", dict(impl="cuda"), "impl"),
    ("chunk_size", dict(chunk_size=0), "chunk_size"),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_inputs_raise_value_error_naming_the_argument(case):
    _, override, fragment = case
    with pytest.raises(ValueError, match=fragment):
        call_with_bad_input(linear_cross_entropy, override)


@pytest.mark.parametrize("chunk_size", [0, -4])
def test_fwd_bwd_refuses_a_chunk_size_below_one(chunk_size):
    """A chunk of 0 or fewer tokens would skip the work and return uninitialised gradients."""
    acc = torch.zeros(123, 31)
    with pytest.raises(ValueError, match="chunk_size"):
        linear_cross_entropy_fwd_bwd(torch.zeros(37, 31), torch.zeros(123, 31),
                                     torch.zeros(37, dtype=torch.long), acc,
                                     chunk_size=chunk_size)


# ----------------------------------------------------------------------------------------------
# Forward + backward in one call, adding into a shared weight-gradient buffer
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_fwd_bwd_adds_scaled_weight_gradient_into_the_buffer(impl, dtype):
    n, d, vocab = next(iter(SHAPES))  # (37, 31, 123)
    acc = torch.zeros(vocab, d, dtype=dtype)
    expected_dw = torch.zeros(vocab, d, dtype=torch.float64)
    weight = make_inputs(n, d, vocab, dtype, seed=0)[1].detach()
    for seed, scale in ((0, 1.0), (1, 0.25)):  # two losses sharing one weight, as two heads do
        hidden, _, targets = make_inputs(n, d, vocab, dtype, seed=seed)
        loss, dh = linear_cross_entropy_fwd_bwd(hidden.detach(), weight, targets, acc,
                                                scale=scale, impl=impl, chunk_size=16)
        ref_h = hidden.detach().double().requires_grad_()
        ref_w = weight.detach().double().requires_grad_()
        ref = reference_f64(ref_h, ref_w, targets, "mean")
        (scale * ref).backward()
        expected_dw += ref_w.grad
        tol = 1e-10 if dtype == torch.float64 else 1e-5
        assert rel_err(loss, ref.detach()) <= tol
        assert dh.dtype == dtype and rel_err(dh, ref_h.grad) <= tol
    assert rel_err(acc, expected_dw) <= (1e-10 if dtype == torch.float64 else 1e-5)
    with pytest.raises(ValueError, match="dweight_acc"):
        linear_cross_entropy_fwd_bwd(hidden.detach(), weight, targets, acc[:-1], impl=impl)


# ----------------------------------------------------------------------------------------------
# Dispatch: no silent fallback on CUDA
# ----------------------------------------------------------------------------------------------


def test_auto_on_cuda_without_triton_raises_naming_both_ways_out(monkeypatch):
    monkeypatch.setattr(validate, "HAS_TRITON", False)
    cuda = torch.device("cuda")
    for impl in ("auto", "triton"):
        with pytest.raises(ImportError, match=r"pip install triton.*impl='torch'"):
            validate._resolve_impl(impl, cuda)
    assert validate._resolve_impl("torch", cuda) == "torch"  # asked for explicitly: allowed
    assert validate._resolve_impl("auto", torch.device("cpu")) == "torch"  # CPU is unchanged


def test_auto_on_cuda_is_triton(monkeypatch):
    # Resolution only (no kernel runs), so it needs neither a GPU nor triton itself.
    monkeypatch.setattr(validate, "HAS_TRITON", True)
    assert validate._resolve_impl("auto", torch.device("cuda")) == "triton"

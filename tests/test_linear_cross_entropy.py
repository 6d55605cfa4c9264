"""Fused linear cross-entropy against an independent float64 reference.

On CPU the Triton kernels run under ``TRITON_INTERPRET=1`` (set by ``tests/conftest.py`` before
``mtp.kernels`` is imported); the chunked PyTorch path runs natively. GPU tests compare bf16 and
fp32 CUDA runs with the same float64 reference.
"""

import importlib
import math
import os

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # also when run without the repo's conftest

from mtp.kernels import (  # noqa: E402
    TritonConfig,
    linear_cross_entropy,
    linear_cross_entropy_reference,
    linear_cross_entropy_triton,
)

# The package exports a function of the same name, so fetch the module itself for its internals.
lce_module = importlib.import_module("mtp.kernels.linear_cross_entropy")

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
    not lce_module._triton_is_interpreted(),
    reason="the Triton interpreter is off (a CUDA machine); the GPU tests cover Triton there",
)


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


# ----------------------------------------------------------------------------------------------
# Triton kernels under the CPU interpreter
# ----------------------------------------------------------------------------------------------


def test_triton_interpreter_is_active_without_cuda():
    """Guards the interpreter tests against silently skipping on CPU-only CI."""
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the kernels are compiled, not interpreted")
    assert lce_module._triton_is_interpreted(), (
        "mtp.kernels was imported before TRITON_INTERPRET=1 was set"
    )


@interpreted
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("shape", list(SHAPES), ids=str)
def test_triton_matches_float64_reference(shape, dtype, reduction):
    n, d, vocab = shape
    tiles = SHAPES[shape]

    # Chunks not a multiple of block_n: ragged chunks, and dweight summed over 2-3 chunks.
    chunk = 20 if n < 100 else 100

    def run(h, w, t, red):
        return linear_cross_entropy_triton(h, w, t, reduction=red, chunk_size=chunk, config=tiles)

    hidden, weight, targets = make_inputs(n, d, vocab, dtype)
    check_against_reference(run, hidden, weight, targets, reduction, RTOL[dtype], RTOL[dtype])


@interpreted
def test_triton_default_config_and_single_split():
    """The launcher's own choices (tiles, splits, chunk) on CPU, and v_splits=1."""
    hidden, weight, targets = make_inputs(37, 31, 123, torch.float32)
    check_against_reference(
        lambda h, w, t, r: linear_cross_entropy(h, w, t, reduction=r, impl="triton"),
        hidden, weight, targets, "mean", 1e-5, 1e-5,
    )  # fmt: skip
    hidden, weight, targets = make_inputs(37, 31, 123, torch.float32)
    one_split = TritonConfig(block_n=16, block_v=32, block_d=16, num_warps=1, num_stages=1,
                             v_splits=1)  # fmt: skip
    check_against_reference(
        lambda h, w, t, r: linear_cross_entropy_triton(h, w, t, reduction=r, config=one_split),
        hidden, weight, targets, "sum", 1e-5, 1e-5,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Chunked PyTorch path
# ----------------------------------------------------------------------------------------------


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
# Shared behaviour
# ----------------------------------------------------------------------------------------------

IMPLS = [pytest.param("triton", marks=interpreted), "torch"]


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
    args = dict(
        hidden=torch.zeros(37, 31),
        weight=torch.zeros(123, 31),
        targets=torch.zeros(37, dtype=torch.long),
    )
    kwargs = {}
    for key, value in override.items():
        (args if key in args else kwargs)[key] = value
    with pytest.raises(ValueError, match=fragment):
        linear_cross_entropy(args["hidden"], args["weight"], args["targets"], **kwargs)


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------

GPU_SHAPES = [(37, 31, 123), (1000, 257, 5003), (4096, 1024, 32000)]


@pytest.mark.gpu
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_gpu_fp32_matches_float64_reference(shape, reduction):
    """fp32 on CUDA runs tl.dot in IEEE fp32 (torch's allow_tf32 is off by default), so the bound
    is the CPU one, loosened 5x for the longer sums of the larger shapes (up to V = 32000 terms)."""
    n, d, vocab = shape
    hidden, weight, targets = make_inputs(n, d, vocab, torch.float32, device="cuda")
    check_against_reference(
        lambda h, w, t, r: linear_cross_entropy(h, w, t, reduction=r, chunk_size=n // 3 + 1),
        hidden, weight, targets, reduction, 5e-5, 5e-5,
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_gpu_bf16_matches_float64_reference(shape, reduction):
    """bf16 inputs, reference in fp64 on the same bf16 values (so input rounding is not counted).
    Loss: logits are fp32 sums of exact bf16 products (tensor cores accumulate in fp32), error
    ~1e-6 relative; 1e-4 leaves room for the tensor cores' truncated accumulation. Gradients:
    dlogits are rounded to bf16 before the gradient matmuls and each output element is rounded to
    bf16 once, two roundings of unit 2^-9 ~ 2e-3 (norm-wise ~1.6e-3 for random errors); 8e-3 is
    four units, while a wrong scale or a missed tile gives errors of order 1."""
    n, d, vocab = shape
    hidden, weight, targets = make_inputs(n, d, vocab, torch.bfloat16, device="cuda")
    check_against_reference(
        lambda h, w, t, r: linear_cross_entropy(h, w, t, reduction=r, chunk_size=n // 3 + 1),
        hidden, weight, targets, reduction, 1e-4, 8e-3,
    )  # fmt: skip


@pytest.mark.gpu
def test_gpu_never_allocates_n_by_v():
    n, d, vocab = 4096, 64, 4096
    hidden, weight, targets = make_inputs(n, d, vocab, torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    linear_cross_entropy(hidden, weight, targets, chunk_size=512).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < n * vocab * 2, f"peak extra {extra} B reaches an N x V bf16 buffer"


# ----------------------------------------------------------------------------------------------
# Forward + backward in one call, adding into a shared weight-gradient buffer
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_fwd_bwd_adds_scaled_weight_gradient_into_the_buffer(impl, dtype):
    from mtp.kernels import linear_cross_entropy_fwd_bwd

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
    monkeypatch.setattr(lce_module, "HAS_TRITON", False)
    cuda = torch.device("cuda")
    for impl in ("auto", "triton"):
        with pytest.raises(ImportError, match=r"pip install triton.*impl='torch'"):
            lce_module._resolve_impl(impl, cuda)
    assert lce_module._resolve_impl("torch", cuda) == "torch"  # asked for explicitly: allowed
    assert lce_module._resolve_impl("auto", torch.device("cpu")) == "torch"  # CPU is unchanged


def test_auto_on_cuda_is_triton(monkeypatch):
    # Resolution only (no kernel runs), so it needs neither a GPU nor triton itself.
    monkeypatch.setattr(lce_module, "HAS_TRITON", True)
    assert lce_module._resolve_impl("auto", torch.device("cuda")) == "triton"


# ----------------------------------------------------------------------------------------------
# The torch path: no fp32 copy of the whole weight
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
    monkeypatch.setattr(lce_module, "_TORCH_WEIGHT_SLICE_BYTES", 48 * d * 4)
    with _Fp32Conversions() as probe:
        if entry == "fwd_bwd":
            acc = torch.zeros(vocab, d)  # the caller's fp32 dW buffer
            lce_module.linear_cross_entropy_fwd_bwd(hidden.detach(), weight.detach(), targets, acc,
                                             impl="torch", chunk_size=16)
        else:
            lce_module.linear_cross_entropy(hidden, weight, targets, impl="torch",
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
    monkeypatch.setattr(lce_module, "_TORCH_WEIGHT_SLICE_BYTES", 7 * weight.shape[1] * 4)
    loss = lce_module.linear_cross_entropy(hidden, weight, targets, reduction=reduction,
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

"""The Triton kernels and their launchers (``mtp.kernels.forward``, ``mtp.kernels.backward``)
against an independent float64 reference.

On CPU the kernels run under ``TRITON_INTERPRET=1`` (set by ``tests/conftest.py`` before
``mtp.kernels`` is imported); GPU tests compare bf16 and fp32 CUDA runs with the same float64
reference.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # also when run without the repo's conftest

from lce_helpers import (  # noqa: E402
    RTOL,
    SHAPES,
    call_with_bad_input,
    check_against_reference,
    interpreted,
    make_inputs,
)
from mtp.kernels import (  # noqa: E402
    TritonConfig,
    linear_cross_entropy,
    linear_cross_entropy_triton,
)
from mtp.kernels.forward import triton_is_interpreted as _triton_is_interpreted  # noqa: E402

# ----------------------------------------------------------------------------------------------
# Triton kernels under the CPU interpreter
# ----------------------------------------------------------------------------------------------


def test_triton_interpreter_is_active_without_cuda():
    """Guards the interpreter tests against silently skipping on CPU-only CI."""
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the kernels are compiled, not interpreted")
    assert _triton_is_interpreted(), "mtp.kernels was imported before TRITON_INTERPRET=1 was set"


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


ENTRY_BAD_INPUTS = [
    # (kwargs override, substring the message must contain); the shapes are checked before the
    # device, chunk_size after it (CPU tensors then need the interpreter)
    pytest.param(dict(targets=torch.full((37,), 123)), "got 123", id="target == V"),
    pytest.param(dict(weight=torch.zeros(123, 31, dtype=torch.float64)), "weight dtype",
                 id="dtype mismatch"),
    pytest.param(dict(reduction="avg"), "reduction", id="reduction"),
    pytest.param(dict(chunk_size=0), "chunk_size", id="chunk_size", marks=interpreted),
]


@pytest.mark.parametrize(("override", "fragment"), ENTRY_BAD_INPUTS)
def test_triton_entry_validates_its_inputs(override, fragment):
    """linear_cross_entropy_triton is public too: it checks its inputs as the dispatcher does."""
    with pytest.raises(ValueError, match=fragment):
        call_with_bad_input(linear_cross_entropy_triton, override)


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

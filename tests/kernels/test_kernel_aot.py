"""The GPU path of the fused linear cross-entropy, checked on a machine without a GPU.

Ahead-of-time compilation: each of the four Triton kernels, at the tiles the launcher uses
   for bf16 on CUDA, compiles for sm_80 (A100) and sm_90 (H100/H200) with Triton's own compiler
   and bundled ptxas; its PTX uses the target's tensor-core instruction and its shared memory
   fits the SM. (Registers and spills are reported by ``python -m mtp.kernels.aot``, not
   asserted: they are a performance property.)
"""

import pytest
import torch
from mtp.kernels import aot, backward, forward
from mtp.kernels.forward import default_config as _default_config

REASON = aot.unavailable_reason()
needs_cuda_compiler = pytest.mark.skipif(
    REASON is not None, reason=f"cannot compile Triton kernels for CUDA here: {REASON}"
)
TARGETS = [80, 90]


@pytest.fixture(scope="module")
def aligned_rows(tmp_path_factory) -> dict[tuple[str, str], dict]:
    """The report of every kernel on both targets at the GPU tiles, keyed (kernel, target).

    Compiled in one fresh process: under the suite's TRITON_INTERPRET=1 Triton cannot compile.
    """
    rows = aot.report(TARGETS, torch.bfloat16, ("aligned",))
    return {(row["kernel"], row["target"]): row for row in rows}


KERNELS = [name.removeprefix("_linear_cross_entropy_").removesuffix("_kernel")
           for name in aot.KERNEL_POINTERS]
ARCH = {80: "sm_80", 90: "sm_90a"}


# ----------------------------------------------------------------------------------------------
# Ahead-of-time compilation for sm_80 and sm_90
# ----------------------------------------------------------------------------------------------


def test_every_kernel_of_the_module_is_compiled():
    """A kernel added to forward.py or backward.py must be added to the AOT check too."""
    kernels = {name for module in (forward, backward) for name in vars(module)
               if name.endswith("_kernel") and name.startswith("_linear_cross_entropy_")}
    assert kernels == set(aot.KERNEL_POINTERS)


@needs_cuda_compiler
@pytest.mark.parametrize("capability", TARGETS, ids=lambda c: f"sm_{c}")
@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_compiles_with_tensor_cores_within_shared_memory(aligned_rows, kernel,
                                                                capability):
    row = aligned_rows[(kernel, ARCH[capability])]  # the PTX declares the requested target
    op = aot.TENSOR_CORE_OP[capability]
    assert row["tensor_core"].startswith(op), f"{kernel}: tl.dot did not lower to {op}"
    # > 0: the pipelined operand tiles live in shared memory; the limit is the SM's largest
    # opt-in allocation per block
    assert 0 < row["shared"] <= aot.SMEM_LIMIT_BYTES[capability]
    assert row["smem_fits"]
    cfg = _default_config(torch.bfloat16, torch.device("cuda"))
    assert (row["warps"], row["stages"]) == (cfg.num_warps, cfg.num_stages)
    # ptxas ran and its log was read (registers are a performance property, not asserted)
    assert 1 <= row["registers"] <= 255
    assert row["spill_stores"] >= 0 and row["spill_loads"] >= 0


def test_shared_memory_limits_are_the_sms():
    # CUDA programming guide, compute capabilities table: max shared memory per block (opt-in)
    assert aot.SMEM_LIMIT_BYTES == {80: 163 * 1024, 90: 227 * 1024}


@needs_cuda_compiler
def test_aot_table(aligned_rows):
    """The rows came from `python -m mtp.kernels.aot --json` (the fixture's process); the same
    command without --json prints them as this table."""
    lines = aot.format_rows(list(aligned_rows.values())).splitlines()
    assert lines[0].split() == ["kernel", "target", "spec", "dtype", "warps", "stages",
                                "registers", "spill_stores", "spill_loads", "stack", "shared",
                                "smem_fits", "tensor_core"]
    assert len(lines) == 1 + len(TARGETS) * len(aot.KERNEL_POINTERS)

"""Compile the linear cross-entropy kernels for GPU targets ahead of time, without a GPU.

    python -m mtp.kernels.aot                    # bf16, sm_80 and sm_90, every specialisation
    python -m mtp.kernels.aot --targets 90 --specialization aligned

Each ``@triton.jit`` kernel of :mod:`mtp.kernels.forward` and :mod:`mtp.kernels.backward` is
compiled with ``triton.compile`` at the tiles and launch options its launcher uses on CUDA
(``default_config`` of :mod:`mtp.kernels.forward`), for an explicit ``GPUTarget``; Triton's
bundled ``ptxas -v`` is then run on the PTX (the same binary and flags Triton uses to build the
cubin) for registers and spills.
The printed table has, per kernel and target: registers per thread, spill stores and loads, the
shared memory a block needs, whether it fits the SM, and the tensor-core instruction found in
the PTX (``mma.sync`` on sm_80, ``wgmma`` on sm_90).

Triton specialises a kernel on which integer arguments are multiples of 16 (it then knows rows
start 16-byte aligned and vectorises loads and asynchronous copies), so three specialisations
are compiled: ``aligned`` (every size and stride, e.g. (N, d, V) = (16384, 4096, 128256), what
the GPU configs were sized for), ``odd_vocab`` (V and the dlogits row stride not, e.g.
V = 50257) and ``ragged`` (d not either).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import torch

from . import backward, forward

#: Largest shared memory one block may use (opt-in dynamic shared memory), in bytes.
SMEM_LIMIT_BYTES = {80: 166912, 90: 232448}  # sm_80: 163 KiB, sm_90: 227 KiB
#: The PTX instruction that shows a tl.dot ran on tensor cores, per target.
TENSOR_CORE_OP = {80: "mma.sync", 90: "wgmma.mma_async"}
#: Launch-argument specialisations, as Triton's launcher derives them from the values: the
#: scalars that are multiples of 16 (every pointer is 16-byte aligned in all of them).
SPECIALIZATIONS = {
    # (N, d, V) = (16384, 4096, 128256): every size and stride
    "aligned": {"N", "C", "V", "D", "stride_h", "stride_w", "stride_g", "stride_dh",
                "stride_dw"},
    # V = 50257 (GPT-2): the vocabulary and the row stride of dlogits (C, V) are not
    "odd_vocab": {"N", "C", "D", "stride_h", "stride_w", "stride_dh", "stride_dw"},
    # d not a multiple of 16 either (only test shapes): no size or stride
    "ragged": {"N", "C"},
}

# Pointer arguments of each kernel: "in" (the input dtype), "acc" (the accumulation dtype) or
# "i64" (token ids). Every other argument that is not a constexpr is an i32 scalar.
KERNEL_POINTERS = {
    "_linear_cross_entropy_fwd_kernel": {
        "hidden_ptr": "in", "weight_ptr": "in", "targets_ptr": "i64", "lse_ptr": "acc",
        "target_logit_ptr": "acc",
    },
    "_linear_cross_entropy_dlogits_kernel": {
        "hidden_ptr": "in", "weight_ptr": "in", "targets_ptr": "i64", "lse_ptr": "acc",
        "scale_ptr": "acc", "dlogits_ptr": "in",
    },
    "_linear_cross_entropy_dhidden_kernel": {
        "dlogits_ptr": "in", "weight_ptr": "in", "dhidden_ptr": "in",
    },
    "_linear_cross_entropy_dweight_kernel": {
        "dlogits_ptr": "in", "hidden_ptr": "in", "dweight_ptr": "acc",
    },
}
_TL_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
             torch.float64: "fp64"}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def unavailable_reason() -> str | None:
    """Why kernels cannot be compiled for CUDA here, or None when they can."""
    try:
        import triton
        from triton.backends import backends
        from triton.backends.nvidia.compiler import get_ptxas
    except ImportError as exc:
        return f"triton or its NVIDIA backend is not importable ({exc})"
    if "nvidia" not in backends:
        return f"triton {triton.__version__} has no NVIDIA backend"
    for capability in SMEM_LIMIT_BYTES:
        try:
            tool = get_ptxas(capability)
            subprocess.run([tool.path, "--version"], check=True, capture_output=True)
        except (AttributeError, OSError, subprocess.CalledProcessError) as exc:
            return f"the ptxas that triton uses for sm_{capability} cannot run ({exc})"
    return None


def _kernels() -> dict:
    """The kernels of :mod:`mtp.kernels.forward` and :mod:`mtp.kernels.backward` by name, which
    must be compilable JITFunctions."""
    from triton.runtime.jit import JITFunction

    kernels = {**forward.TRITON_KERNELS, **backward.TRITON_KERNELS}
    if not all(isinstance(kernel, JITFunction) for kernel in kernels.values()):
        raise RuntimeError("the kernels were built by Triton's interpreter (TRITON_INTERPRET=1), "
                           "which cannot compile them; use report(), which then compiles in a "
                           "fresh process, or unset TRITON_INTERPRET")
    return kernels


def _interpreted() -> bool:
    """Whether Triton runs in its CPU interpreter in this process (then nothing compiles here:
    the interpreter also replaces triton.language's own jit functions, e.g. tl.cdiv)."""
    from triton import knobs

    return knobs.runtime.interpret or forward.triton_is_interpreted()


def compile_kernel(name: str, capability: int, dtype: torch.dtype = torch.bfloat16,
                   specialization: str = "aligned"):
    """``triton.compile`` one kernel for ``GPUTarget("cuda", capability, 32)``.

    Tiles, warps, stages, the accumulation dtype and the dot precision are those the launcher
    passes on CUDA for ``dtype`` (``default_config``, ``triton_dtypes``).

    Returns:
        The ``CompiledKernel`` (``.asm["ptx"]``, ``.metadata.shared``, ...).
    """
    import triton
    from triton.backends.compiler import GPUTarget

    if specialization not in SPECIALIZATIONS:
        raise ValueError(f"specialization must be one of {list(SPECIALIZATIONS)} (got "
                         f"{specialization!r})")
    kernel = _kernels()[name]
    cfg = forward.default_config(dtype, torch.device("cuda"))
    acc, precision = forward.triton_dtypes(dtype)
    constexprs = {"BLOCK_N": cfg.block_n, "BLOCK_V": cfg.block_v, "BLOCK_D": cfg.block_d,
                  "GROUP": cfg.group, "ACC_DTYPE": acc, "INPUT_PRECISION": precision}
    declared = {p.name for p in kernel.params if p.is_constexpr}
    if declared != set(constexprs):
        raise RuntimeError(f"{name} takes the constexprs {sorted(declared)}; this compiler "
                           f"passes {sorted(constexprs)}: update mtp.kernels.aot")
    pointers = KERNEL_POINTERS[name]
    element = {"in": _TL_NAMES[dtype], "acc": _TL_NAMES[torch.promote_types(dtype,
                                                                           torch.float32)],
               "i64": "i64"}
    signature, attrs = {}, {}
    for i, arg in enumerate(kernel.arg_names):
        if arg in constexprs:
            signature[arg] = "constexpr"
            continue
        signature[arg] = f"*{element[pointers[arg]]}" if arg in pointers else "i32"
        if arg in pointers or arg in SPECIALIZATIONS[specialization]:
            attrs[(i,)] = [["tt.divisibility", 16]]
    unknown = set(pointers) - set(kernel.arg_names)
    if unknown:
        raise RuntimeError(f"{name} has no arguments {sorted(unknown)}: update mtp.kernels.aot")
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs,
                                       attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", capability, 32),
                          options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})


def ptxas_usage(ptx: str, capability: int, *, fp_fusion: bool = True) -> dict[str, int]:
    """Registers and spills of a PTX kernel, from ``ptxas -v`` (Triton's binary and flags).

    Returns:
        ``registers`` per thread, ``spill_stores`` and ``spill_loads`` in bytes, ``stack`` frame
        bytes.
    """
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    tool = get_ptxas(capability)
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [tool.path, "-lineinfo", *([] if fp_fusion else ["--fmad=false"]), "-v",
               "--regAllocOptLevel=2", f"--gpu-name={sm_arch_from_capability(capability)}",
               src, "-o", os.path.join(tmp, "kernel.cubin")]
        log = subprocess.run(cmd, check=True, capture_output=True, text=True).stderr

    def number(pattern: str) -> int:
        match = re.search(pattern, log)
        if match is None:
            raise RuntimeError(f"no {pattern!r} in the ptxas log:\n{log}")
        return int(match.group(1))

    return {"registers": number(r"Used (\d+) registers"),
            "spill_stores": number(r"(\d+) bytes spill stores"),
            "spill_loads": number(r"(\d+) bytes spill loads"),
            "stack": number(r"(\d+) bytes stack frame")}


def kernel_report(name: str, capability: int, dtype: torch.dtype = torch.bfloat16,
                  specialization: str = "aligned") -> dict:
    """One row of the table: compile ``name`` for ``capability`` and measure it.

    ``tensor_core`` is the target's tensor-core instruction and how many times the PTX holds it
    (after unrolling), or ``none`` when ``tl.dot`` was lowered to plain FMAs.
    """
    compiled = compile_kernel(name, capability, dtype, specialization)
    ptx = compiled.asm["ptx"]
    op = TENSOR_CORE_OP[capability]
    shared = compiled.metadata.shared
    target = re.search(r"^\.target (\S+)", ptx, flags=re.MULTILINE)
    return {
        "kernel": name.removeprefix("_linear_cross_entropy_").removesuffix("_kernel"),
        "target": target.group(1) if target else "?",  # as the PTX declares it
        "spec": specialization,
        "dtype": _TL_NAMES[dtype],
        "warps": compiled.metadata.num_warps,
        "stages": compiled.metadata.num_stages,
        **ptxas_usage(ptx, capability, fp_fusion=compiled.metadata.enable_fp_fusion),
        "shared": shared,
        "smem_fits": shared <= SMEM_LIMIT_BYTES[capability],
        "tensor_core": f"{op} x{ptx.count(op)}" if op in ptx else "none",
    }


def report(capabilities=(80, 90), dtype: torch.dtype = torch.bfloat16,
           specializations=tuple(SPECIALIZATIONS)) -> list[dict]:
    """Rows for every kernel x target x specialisation.

    Under ``TRITON_INTERPRET=1`` (the CPU test suite) the compilation runs in a fresh process
    without it (``python -m mtp.kernels.aot --json``), since an interpreted Triton cannot compile.
    """
    if _interpreted():
        name = next(k for k, v in DTYPES.items() if v == dtype)
        cmd = [sys.executable, "-m", "mtp.kernels.aot", "--json", "--dtype", name,
               "--targets", ",".join(map(str, capabilities))]
        for spec in specializations:
            cmd += ["--specialization", spec]
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr}")
        return json.loads(proc.stdout)
    return [kernel_report(name, cap, dtype, spec) for spec in specializations
            for cap in capabilities for name in KERNEL_POINTERS]


def format_rows(rows: list[dict]) -> str:
    """A fixed-width table (kernels/ imports no mtp code, hence its own)."""
    cols = list(rows[0])
    table = [cols] + [[str(row[c]) for c in cols] for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(cols))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(line, widths)) for line in table)


def _capabilities(text: str) -> list[int]:
    try:
        capabilities = [int(c) for c in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected e.g. 80,90 (got {text!r})")
    unknown = [c for c in capabilities if c not in SMEM_LIMIT_BYTES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"known capabilities are {list(SMEM_LIMIT_BYTES)} (got {unknown})")
    return capabilities


def main(argv: list[str] | None = None) -> int:
    """``python -m mtp.kernels.aot``: print the table (or ``--json`` rows); exit 2 when the
    kernels cannot be compiled for CUDA here."""
    parser = argparse.ArgumentParser(prog="python -m mtp.kernels.aot",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--targets", type=_capabilities, default=[80, 90],
                        help="compute capabilities, e.g. 80,90 (sm_80 A100, sm_90 H100/H200)")
    parser.add_argument("--specialization", choices=list(SPECIALIZATIONS), action="append",
                        help="launch-argument specialisation to compile (repeatable; default all)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    reason = unavailable_reason()
    if reason is not None:
        parser.exit(2, f"cannot compile for CUDA here: {reason}\n")
    specs = tuple(args.specialization or SPECIALIZATIONS)
    rows = report(args.targets, DTYPES[args.dtype], specs)
    print(json.dumps(rows, indent=1) if args.json else format_rows(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Kernel-level benchmark of the fused linear cross-entropy against the alternatives.

Measures forward + backward time, forward-only time, peak extra memory and throughput on the
``6 N d V`` FLOP basis (the forward and backward matmuls of an unfused unembedding) for:

* ``mtp``: :func:`mtp.kernels.linear_cross_entropy` (Triton on CUDA, chunked torch on CPU);
* ``torch``: :func:`mtp.kernels.linear_cross_entropy_reference` (materialised fp32 logits);
* ``torch-chunked``: ``torch.nn.functional.linear_cross_entropy`` with chunking options, where
  this torch has it;
* ``liger``: Liger-Kernel's fused linear cross-entropy, if importable;
* ``cce``: Apple's cut-cross-entropy, if importable.

Every implementation runs on the same inputs in one process, so ratios are side by side.

Usage::

    mtp bench kernel                      # default shapes for the device
    mtp bench kernel --dtype fp32 --shapes 8192,2048,32000 --csv out.csv
    mtp bench kernel --sweep              # tile-size sweep of the Triton kernels
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from torch import Tensor

from mtp.bench.report import publish
from mtp.bench.timing import median_ms, sync
from mtp.kernels import TritonConfig, linear_cross_entropy, linear_cross_entropy_reference

LossFn = Callable[[Tensor, Tensor, Tensor], Tensor]

GPU_SHAPES = [(16384, 4096, 128256), (8192, 2048, 32000)]
CPU_SHAPES = [(2048, 256, 8192), (1024, 128, 32000)]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Dense tensor-core peaks (TFLOP/s, bf16/fp16, SXM parts); percent of peak is reported only for
# these dtypes and devices. H200 has H100's compute with more and faster memory.
PEAK_TFLOPS_16BIT = {"H100": 989.4, "H200": 989.4, "A100": 312.0}
# Tile configurations for --sweep: the default and its neighbours in tile shape and pipelining.
SWEEP_CONFIGS = [
    TritonConfig(block_n=128, block_v=128, block_d=64, num_warps=8, num_stages=3),
    TritonConfig(block_n=128, block_v=256, block_d=64, num_warps=8, num_stages=3),
    TritonConfig(block_n=64, block_v=128, block_d=64, num_warps=4, num_stages=4),
    TritonConfig(block_n=128, block_v=128, block_d=32, num_warps=4, num_stages=4),
]


def available_impls() -> dict[str, LossFn]:
    """Name -> loss function of every implementation importable here."""
    impls: dict[str, LossFn] = {
        "mtp": lambda h, w, t: linear_cross_entropy(h, w, t),
        "torch": lambda h, w, t: linear_cross_entropy_reference(h, w, t),
    }
    options_cls = getattr(torch.nn, "LinearCrossEntropyOptions", None)
    if options_cls is not None and hasattr(torch.nn.functional, "linear_cross_entropy"):
        impls["torch-chunked"] = lambda h, w, t: torch.nn.functional.linear_cross_entropy(
            h, w, t, ignore_index=-100, options=options_cls()
        )
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss()
        impls["liger"] = lambda h, w, t: liger(w, h, t)  # Liger takes (weight, input, target)
    except ImportError:
        pass
    try:
        from cut_cross_entropy import linear_cross_entropy as cce_linear_cross_entropy

        impls["cce"] = lambda h, w, t: cce_linear_cross_entropy(h, w, t)
    except ImportError:
        pass
    return impls


def _peak_extra_mib(fn: Callable[[], object], device: torch.device) -> float | None:
    """Peak memory above what was allocated before ``fn`` (CUDA only)."""
    if device.type != "cuda":
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    sync(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def peak_tflops(dtype: torch.dtype, device: torch.device) -> float | None:
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_TFLOPS_16BIT.items() if key in name), None)


def _inputs(shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device):
    """Logits with std ~2, as in a trained LM head, and 5% ignored positions; drawn on the device
    (the largest default weight is 0.5 G elements, seconds to draw on a CPU)."""
    n, d, vocab = shape
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(n, d, generator=gen, device=device, dtype=dtype)
    weight = torch.randn(vocab, d, generator=gen, device=device, dtype=dtype).mul_(2.0 / d**0.5)
    targets = torch.randint(0, vocab, (n,), generator=gen, device=device)
    targets[torch.rand(n, generator=gen, device=device) < 0.05] = -100
    return hidden.requires_grad_(), weight.requires_grad_(), targets


def _bench_one(
    name: str,
    fn: LossFn,
    inputs: tuple[Tensor, Tensor, Tensor],
    device: torch.device,
    warmup: int,
    reps: int,
) -> dict:
    hidden, weight, targets = inputs
    n, d = hidden.shape
    vocab = weight.shape[0]
    dtype = hidden.dtype
    row: dict = {"impl": name, "N": n, "d": d, "V": vocab, "dtype": str(dtype).split(".")[-1]}

    def fwd_bwd() -> Tensor:
        hidden.grad = weight.grad = None
        loss = fn(hidden, weight, targets)
        loss.backward()
        return loss

    def fwd() -> None:
        with torch.no_grad():
            fn(hidden, weight, targets)

    try:
        row["loss"] = float(fwd_bwd().detach())
        row["fwd_bwd_ms"] = median_ms(fwd_bwd, device, warmup, reps)
        row["fwd_ms"] = median_ms(fwd, device, warmup, reps)
        row["peak_extra_mib"] = _peak_extra_mib(fwd_bwd, device)
        row["status"] = "ok"
    except torch.OutOfMemoryError:
        row["status"] = "oom"
    except Exception as exc:  # a third-party kernel failing must not hide the other rows
        row["status"] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    finally:
        hidden.grad = weight.grad = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if row["status"] == "ok":
        row["tflops_6NdV"] = 6 * n * d * vocab / (row["fwd_bwd_ms"] * 1e-3) / 1e12
        peak = peak_tflops(dtype, device)
        row["pct_peak"] = 100 * row["tflops_6NdV"] / peak if peak else None
    return row


def run_kernel_bench(
    shapes: list[tuple[int, int, int]],
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    impls: list[str] | None = None,
    warmup: int = 2,
    reps: int = 5,
) -> list[dict]:
    """Benchmark every available implementation on every ``(N, d, V)`` shape.

    Args:
        shapes: ``(N, d, V)`` triples.
        dtype: Input dtype of ``hidden`` and ``weight``.
        device: Where to run.
        impls: Names to run (see :func:`available_impls`); ``None`` runs all available.
        warmup: Untimed runs before timing (Triton compiles during the first).
        reps: Timed runs; the median is reported.

    Returns:
        One dict per (shape, implementation): ``impl, N, d, V, dtype, loss, fwd_bwd_ms, fwd_ms,
        peak_extra_mib, tflops_6NdV, pct_peak, status`` (``status`` is ``ok``, ``oom`` or the
        error).
    """
    device = torch.device(device)
    available = available_impls()
    names = impls or list(available)
    unknown = [name for name in names if name not in available]
    if unknown:
        raise ValueError(f"impls {unknown} are not available here (have {list(available)})")
    rows = []
    for shape in shapes:
        inputs = _inputs(shape, dtype, device)
        for name in names:
            rows.append(_bench_one(name, available[name], inputs, device, warmup, reps))
        del inputs
    return rows


def run_config_sweep(
    shape: tuple[int, int, int],
    dtype: torch.dtype,
    device: torch.device | str,
    configs: list[TritonConfig] = SWEEP_CONFIGS,
    *,
    warmup: int = 1,
    reps: int = 3,
) -> list[dict]:
    """Time the Triton implementation under several tile configurations (CUDA)."""
    from mtp.kernels import linear_cross_entropy_triton

    device = torch.device(device)
    inputs = _inputs(shape, dtype, device)
    rows = []
    for cfg in configs:

        def fn(h, w, t, cfg=cfg):
            return linear_cross_entropy_triton(h, w, t, config=cfg)

        row = _bench_one("mtp-sweep", fn, inputs, device, warmup, reps)
        row["config"] = (
            f"n{cfg.block_n}_v{cfg.block_v}_d{cfg.block_d}_w{cfg.num_warps}_s{cfg.num_stages}"
        )
        rows.append(row)
    return rows


COLUMNS = [
    "impl", "config", "N", "d", "V", "dtype", "fwd_bwd_ms", "fwd_ms", "peak_extra_mib",
    "tflops_6NdV", "pct_peak", "loss", "status",
]  # fmt: skip


def _parse_shapes(p: argparse.ArgumentParser, text: str) -> list[tuple[int, int, int]]:
    shapes = []
    for part in text.split(";"):
        try:
            values = tuple(int(v) for v in part.split(","))
        except ValueError:
            values = ()
        if len(values) != 3 or min(values) < 1:
            p.error(f"--shapes expects N,d,V[;N,d,V...] of positive integers (got {part!r})")
        shapes.append(values)
    return shapes


def run(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """`mtp bench kernel`: print the table and append it to `--csv`."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shapes = (_parse_shapes(p, args.shapes) if args.shapes
              else GPU_SHAPES if device.type == "cuda" else CPU_SHAPES)
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    if args.sweep:
        rows = [r for s in shapes for r in run_config_sweep(s, dtype, device)]
    else:
        impls = args.impls.split(",") if args.impls else None
        try:
            rows = run_kernel_bench(shapes, dtype, device, impls=impls, warmup=args.warmup,
                                    reps=args.reps)
        except ValueError as e:
            p.error(f"--impls: {e}")
    publish(rows, args.csv, args.command,
            columns=[c for c in COLUMNS if any(c in r for r in rows)])
    return 0

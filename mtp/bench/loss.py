"""`mtp bench loss`: peak memory and time of the loss path (trunk output -> heads -> loss ->
dL/dh) over K, for the naive pass, the sequential pass with an unfused cross-entropy and the
sequential pass with the fused kernel (on CUDA also with torch's own `linear_cross_entropy`,
Liger-Kernel and cut-cross-entropy when installed).

Each (method, K) configuration runs in a fresh process (`python -m mtp.bench _loss_worker SPEC`),
so that its peak memory is its own.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from mtp.bench.report import format_table, publish
from mtp.bench.timing import current_rss, median_ms, peak_rss, reset_peak_rss
from mtp.config import ModelConfig
from mtp.model.transformer import MTPTransformer
from mtp.train.loss import heads_loss, sequential_path
from mtp.train.targets import IGNORE_INDEX, mtp_inputs_targets


def fwd_bwd_from_loss(loss_fn: Callable[..., torch.Tensor]) -> Callable:
    """Adapt a differentiable `loss_fn(hidden, weight, targets, ignore_index=...)` (an unfused
    cross-entropy, or another library's fused one) to the interface of
    `mtp.kernels.linear_cross_entropy_fwd_bwd`, which the sequential path of `mtp.train.loss`
    calls (`sequential_path`), through autograd."""

    def fwd_bwd(hidden, weight, targets, dweight_acc, *, scale=1.0, ignore_index=IGNORE_INDEX):
        with torch.enable_grad():
            hidden = hidden.detach().requires_grad_()
            weight = weight.detach().requires_grad_()
            loss = loss_fn(hidden, weight, targets, ignore_index=ignore_index)
            dh, dw = torch.autograd.grad(loss * scale, [hidden, weight])
        dweight_acc.add_(dw)
        return loss.detach().float(), dh

    return fwd_bwd


def _ce_functions(device: torch.device) -> dict[str, Callable | None]:
    """Cross-entropy used by each sequential method (None: the naive pass)."""
    from mtp.kernels import linear_cross_entropy_fwd_bwd, linear_cross_entropy_reference

    methods: dict[str, Callable | None] = {
        "naive": None,
        "sequential": fwd_bwd_from_loss(linear_cross_entropy_reference),
        "sequential+fused": linear_cross_entropy_fwd_bwd,
    }
    if device.type == "cuda":
        from mtp.bench.kernel import available_impls

        for name, fn in available_impls().items():
            if name not in ("mtp", "torch"):
                methods[f"sequential+{name}"] = fwd_bwd_from_loss(
                    lambda h, w, t, ignore_index=-100, _fn=fn: _fn(h, w, t))
    return methods


def _loss_step(spec: dict, N: int, V: int, mesh=None) -> Callable[[], None]:
    """One loss-path forward and backward (trunk output -> heads -> loss -> dL/dh).

    With a device mesh every head is its own FSDP2 unit (as `mtp.train.parallel.shard_model` makes
    it); the shared norm and unembedding, which FSDP keeps gathered through the step as the root
    unit, stay whole.
    """
    device = torch.device(spec["device"])
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[spec["dtype"]]
    torch.manual_seed(0)
    K, d, T = spec["K"], spec["d"], min(spec["T"], N)
    cfg = ModelConfig(vocab_size=V, d_model=d, n_layers=1, n_attn_heads=max(1, d // 64),
                      n_future=K, max_seq_len=T, head_type=spec.get("head_type", "block"))
    model = MTPTransformer(cfg).to(device)
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for head in model.heads:
            if any(True for _ in head.parameters()):  # deepseek's head 1 holds none
                fully_shard(head, mesh=mesh)
    B = N // T
    h = torch.randn(B, T, d, device=device, requires_grad=True)  # the trunk output
    _, targets = mtp_inputs_targets(torch.randint(0, V, (B, T + K), device=device), K)
    rope = model.rotary(torch.arange(T, device=device).expand(B, -1))
    ce = _ce_functions(device)[spec["method"]]
    path = "naive" if ce is None else sequential_path(ce)

    def step() -> None:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            out = heads_loss(model, h, rope, targets, path=path)
        out.loss.backward()
        model.zero_grad(set_to_none=False)  # gradient buffers stay: they belong to the step
        h.grad = None

    return step


def _measure(spec: dict) -> dict:
    """One (method, K) configuration of `mtp bench loss`, in its own process (or, with
    `spec["ranks"] > 1`, FSDP over that many processes; the worst rank is reported)."""
    if spec.get("ranks", 1) > 1:
        import tempfile

        from mtp.train.parallel import run_ranks

        with tempfile.TemporaryDirectory() as tmp:
            run_ranks(_loss_rank, spec["ranks"], spec, tmp,
                      backend="nccl" if spec["device"] == "cuda" else "gloo")
            per_rank = [json.loads((Path(tmp) / f"{r}.json").read_text())
                        for r in range(spec["ranks"])]
        return {k: max(r[k] for r in per_rank) for k in per_rank[0]}
    return _measure_loss_step(spec)


def _loss_rank(rank: int, world: int, spec: dict, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    if spec["device"] == "cuda":
        torch.cuda.set_device(rank)
    mesh = init_device_mesh(spec["device"], (world,))
    result = _measure_loss_step({**spec, "device": f"{spec['device']}:{rank}"
                                 if spec["device"] == "cuda" else "cpu"}, mesh)
    (Path(out_dir) / f"{rank}.json").write_text(json.dumps(result))


def _measure_loss_step(spec: dict, mesh=None) -> dict:
    device = torch.device(spec["device"])
    # The same ops at a tiny size first: one-off library buffers and thread pools are then
    # allocated before the baseline is read, and are not counted as the step's memory.
    _loss_step(spec, N=64, V=128, mesh=mesh)()
    step = _loss_step(spec, spec["N"], spec["V"], mesh)
    # NOTE: peak memory of the first full-size step. On CUDA from the allocator; on CPU from the
    # peak RSS (reset just before the step), with glibc told to serve every allocation above
    # 64 KiB by mmap (MALLOC_MMAP_THRESHOLD_, set by the parent), so a freed buffer leaves RSS at
    # once. Measured at (N, d, V, K) = (512, 64, 8192, 4): naive 203 MiB, of which the three
    # K x N x V fp32 buffers are 192 MiB; sequential + fused 28 MiB. The lifetime ru_maxrss
    # instead read ~100 MiB for every method: the peak of importing torch, not of the step.
    # `transient` is the peak above the step's end state, which holds the parameter gradients
    # every method must leave behind (K head blocks' worth of them, so they grow with K).
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        step()
        peak, end = torch.cuda.max_memory_allocated(device), torch.cuda.memory_allocated(device)
    else:
        reset_peak_rss()
        base = current_rss()
        step()
        peak, end = peak_rss(), current_rss()
    ms = median_ms(step, device, warmup=spec["warmup"], reps=spec["reps"])
    return {"peak_mib": (peak - base) / 2**20, "transient_mib": (peak - end) / 2**20, "ms": ms}


def _naive_estimate_gib(K: int, N: int, V: int) -> float:
    # logits, their fp32 copy / log-softmax and the gradient: about 3 K x N x V fp32 buffers
    return 3 * K * N * V * 4 / 2**30


def bench_loss(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    methods = args.methods.split(",") if args.methods else list(_ce_functions(device))
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    rows = []
    for K in args.ks:
        for method in methods:
            row = {"method": method, "heads": args.head_type, "K": K, "N": args.n,
                   "d": args.d, "V": args.vocab, "dtype": args.dtype, "fsdp_ranks": args.fsdp}
            need = _naive_estimate_gib(K, args.n, args.vocab)
            if method == "naive" and need > args.max_naive_gib:
                rows.append({**row, "status": f"skipped: needs ~{need:.0f} GiB"})
                continue
            spec = {"method": method, "K": K, "N": args.n, "d": args.d, "V": args.vocab,
                    "T": args.seq_len, "device": args.device, "dtype": args.dtype,
                    "warmup": args.warmup, "reps": args.reps, "ranks": args.fsdp,
                    "head_type": args.head_type}
            proc = subprocess.run([sys.executable, "-m", "mtp.bench", "_loss_worker",
                                   json.dumps(spec)], capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                rows.append({**row, "status": f"failed: {proc.stderr.strip().splitlines()[-1]}"})
            else:
                rows.append({**row, **json.loads(proc.stdout.strip().splitlines()[-1]),
                             "status": "ok"})
            print(format_table([rows[-1]]).splitlines()[-1], flush=True)
    by = {(r["method"], r["K"]): r for r in rows if r["status"] == "ok"}
    for r in rows:
        if r["status"] != "ok":
            continue
        base_k1 = by.get((r["method"], min(args.ks))) or {}
        naive = by.get(("naive", r["K"])) or {}
        r["peak_vs_K1"] = _ratio(r["peak_mib"], base_k1.get("peak_mib"))
        r["transient_vs_K1"] = _ratio(r["transient_mib"], base_k1.get("transient_mib"))
        r["time_vs_naive"] = _ratio(r["ms"], naive.get("ms"))
    return rows


def _ratio(a: float, b: float | None) -> float | None:
    """a / b, or None where b is missing or zero (a shape too small to move the memory)."""
    return a / b if b else None


def worker(spec_json: str) -> int:
    """Internal: one configuration in this (fresh) process; prints its measurements as JSON."""
    print(json.dumps(_measure(json.loads(spec_json))))
    return 0


def _check_memory(args: argparse.Namespace) -> None:
    """The sequential pass of the largest K within the memory of `--device`, before any tensor
    is made (`mtp.model.memory`; the naive pass has its own bound, `--max-naive-gib`)."""
    from mtp.model.memory import check_memory, training_need
    from mtp.util.environment import available_memory

    T = min(args.seq_len, args.n)
    cfg = ModelConfig(vocab_size=args.vocab, d_model=args.d, n_layers=1,
                      n_attn_heads=max(1, args.d // 64), n_future=max(args.ks), max_seq_len=T,
                      head_type=args.head_type)
    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    check_memory(lambda c, s: training_need(c, batch_size=s["--n"] // T, seq_len=T), cfg,
                 {"--n": args.n}, available_memory(kind), doing=f"the heads' loss at K = "
                 f"{max(args.ks)}", where=f"on {args.device}",
                 model_flags={"n_future": "--ks", "d_model": "--d", "vocab_size": "--vocab",
                              "n_layers": None, "max_seq_len": None, "ffn_hidden": None})


def run(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """`mtp bench loss`: print the table and append it to `--csv`."""
    cuda = torch.cuda.is_available()
    args.device = args.device or ("cuda" if cuda else "cpu")
    args.dtype = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    args.n = args.n or (16384 if cuda else 4096)
    args.d = args.d or (4096 if cuda else 512)
    args.vocab = args.vocab or (128256 if cuda else 32768)
    for flag, value in (("--n", args.n), ("--d", args.d), ("--vocab", args.vocab),
                        ("--seq-len", args.seq_len), ("--fsdp", args.fsdp)):
        if value < 1:
            p.error(f"{flag} must be >= 1 (got {value})")
    if args.n % args.seq_len:
        p.error(f"--n ({args.n}) must be a multiple of --seq-len ({args.seq_len})")
    if min(args.ks) < 1:
        p.error(f"--ks must be >= 1 (got {min(args.ks)})")
    known = list(_ce_functions(torch.device(args.device)))
    unknown = [m for m in (args.methods or "").split(",") if m and m not in known]
    if unknown:
        p.error(f"--methods: unknown {unknown[0]!r}; choose from {', '.join(known)}")
    _check_memory(args)
    publish(bench_loss(args), args.csv, args.command)
    return 0

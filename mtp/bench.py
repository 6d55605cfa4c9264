"""`mtp bench loss | train | kernel | decode | tokenize | sandbox`: tables of memory and
speed, ratios from one run.

loss    peak memory and time of the loss path (trunk output -> heads -> loss -> dL/dh) for the
        naive pass, the sequential pass with an unfused cross-entropy, and the sequential pass
        with the fused kernel, over K; on CUDA also the sequential pass with torch's own
        `linear_cross_entropy`, Liger-Kernel and cut-cross-entropy when installed.
train   time of a whole training step (forward, backward, AdamW) at matched parameters over K,
        beside the FLOP model's ratio (`MTPTransformer.flops_per_token`) and the FLOP/s achieved.
kernel  the fused linear cross-entropy alone against the alternatives (`mtp.bench_kernels`).
decode  the decoders over a prompt set (`mtp.decode_cli`).
tokenize  tokenising a local corpus with 1 and 2 worker processes (`mtp.bench_tokenize`).
sandbox   scoring reference solutions with tests in their own process or beside the completion
        (`mtp.eval.bench`).

Every table is printed and appended to a CSV stamped with hardware, versions and git revision.
Each loss-path configuration runs in a fresh process, so its peak memory is its own.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from mtp.config import ModelConfig
from mtp.loss import mtp_inputs_targets, naive_heads_loss, sequential_heads_loss
from mtp.model import MTPTransformer

# -- reporting shared by every benchmark ------------------------------------------------------


def environment() -> dict[str, str]:
    """Hardware, library versions and git revision, stamped on every CSV row."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    here = Path(__file__).resolve().parent
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True, cwd=here).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, cwd=here).stdout.strip()
        rev += "+dirty" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        rev = "unknown"
    if torch.cuda.is_available():
        hardware = torch.cuda.get_device_name(0)
    else:
        hardware = f"cpu:{platform.processor() or platform.machine()} x{os.cpu_count()}"
    return {
        "hardware": hardware,
        "torch": torch.__version__,
        "triton": triton_version,
        "git_rev": rev,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _columns(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(k for row in rows for k in row))


def format_table(rows: list[dict], columns: list[str] | None = None) -> str:
    """A fixed-width text table of benchmark rows (columns: every key, in first-seen order)."""
    cols = columns or _columns(rows)

    def cell(value) -> str:
        if value is None:
            return "-"
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    table = [cols] + [[cell(row.get(c)) for c in cols] for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(cols))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(line, widths)) for line in table)


def publish(rows: list[dict], csv_path: str | os.PathLike) -> None:
    """Print the environment line and the table of `rows`, then append them to `csv_path`."""
    print(", ".join(f"{k}={v}" for k, v in environment().items()))
    print(format_table(rows))
    write_csv(rows, csv_path)


def write_csv(rows: list[dict], path: str | os.PathLike) -> None:
    """Write rows plus the environment columns; a new file per column set, never rewritten."""
    env = environment()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = _columns(rows) + list(env)
    if path.exists():
        with path.open() as f:
            if next(csv.reader(f), None) != fields:  # another column set: start a new file
                path = path.with_name(f"{path.stem}-{env['date'].replace(':', '')}{path.suffix}")
    new = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        if new:
            writer.writeheader()
        for row in rows:
            writer.writerow({**row, **env})
    print(f"wrote {path}")


def median_ms(fn: Callable[[], object], device: torch.device, warmup: int, reps: int) -> float:
    """Median wall time of `fn` in milliseconds, synchronising CUDA around each call."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _train_step(model, opt, loss_fn, inputs, targets, dtype) -> Callable[[], None]:
    """One training step (forward, backward, clipping, AdamW) of `model` on one batch."""
    device_type = inputs.device.type

    def step() -> None:
        with torch.autocast(device_type, dtype=dtype, enabled=dtype != torch.float32):
            loss = loss_fn(model, inputs, targets).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def interleaved_median_ms(fns: list[Callable[[], object]], device: torch.device, warmup: int,
                          reps: int) -> list[float]:
    """Median wall time of each of `fns` in milliseconds, the calls alternating between them."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, t in zip(fns, times):
            sync()
            start = time.perf_counter()
            fn()
            sync()
            t.append((time.perf_counter() - start) * 1e3)
    return [statistics.median(t) for t in times]


# -- mtp bench loss ---------------------------------------------------------------------------


def _current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak_rss() -> None:
    # Linux: writing 5 to clear_refs resets the process's peak resident set size (VmHWM)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM"))
    return int(line.split()[1]) * 1024


def _ce_functions(device: torch.device) -> dict[str, Callable | None]:
    """Cross-entropy used by each sequential method (None: the naive pass)."""
    from mtp.kernels import linear_cross_entropy_fwd_bwd, linear_cross_entropy_reference
    from mtp.loss import fwd_bwd_from_loss

    methods: dict[str, Callable | None] = {
        "naive": None,
        "sequential": fwd_bwd_from_loss(linear_cross_entropy_reference),
        "sequential+fused": linear_cross_entropy_fwd_bwd,
    }
    if device.type == "cuda":
        from mtp.bench_kernels import available_impls

        for name, fn in available_impls().items():
            if name not in ("mtp", "torch"):
                methods[f"sequential+{name}"] = fwd_bwd_from_loss(
                    lambda h, w, t, ignore_index=-100, _fn=fn: _fn(h, w, t))
    return methods


def _loss_step(spec: dict, N: int, V: int, mesh=None) -> Callable[[], None]:
    """One loss-path forward and backward (trunk output -> heads -> loss -> dL/dh).

    With a device mesh every head is its own FSDP2 unit (as `mtp.parallel.shard_model` makes
    it); the shared norm and unembedding, which FSDP keeps gathered through the step as the root
    unit, stay whole.
    """
    device = torch.device(spec["device"])
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[spec["dtype"]]
    torch.manual_seed(0)
    K, d, T = spec["K"], spec["d"], min(spec["T"], N)
    cfg = ModelConfig(vocab_size=V, d_model=d, n_layers=1, n_heads=max(1, d // 64),
                      n_future=K, max_seq_len=T)
    model = MTPTransformer(cfg).to(device)
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for head in model.heads:
            fully_shard(head, mesh=mesh)
    B = N // T
    h = torch.randn(B, T, d, device=device, requires_grad=True)  # the trunk output
    _, targets = mtp_inputs_targets(torch.randint(0, V, (B, T + K), device=device), K)
    rope = model.rotary(torch.arange(T, device=device).expand(B, -1))
    ce = _ce_functions(device)[spec["method"]]

    def step() -> None:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            if ce is None:
                out = naive_heads_loss(model, h, rope, targets)
            else:
                out = sequential_heads_loss(model, h, rope, targets, fwd_bwd=ce)
        out.loss.backward()
        model.zero_grad(set_to_none=False)  # gradient buffers stay: they belong to the step
        h.grad = None

    return step


def _loss_worker(spec: dict) -> dict:
    """One (method, K) configuration of `mtp bench loss`, in its own process (or, with
    `spec["ranks"] > 1`, FSDP over that many processes; the worst rank is reported)."""
    if spec.get("ranks", 1) > 1:
        import tempfile

        from mtp.parallel import run_ranks

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
        _reset_peak_rss()
        base = _current_rss()
        step()
        peak, end = _peak_rss(), _current_rss()
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
            row = {"method": method, "K": K, "N": args.n, "d": args.d, "V": args.vocab,
                   "dtype": args.dtype, "fsdp_ranks": args.fsdp}
            need = _naive_estimate_gib(K, args.n, args.vocab)
            if method == "naive" and need > args.max_naive_gib:
                rows.append({**row, "status": f"skipped: needs ~{need:.0f} GiB"})
                continue
            spec = {"method": method, "K": K, "N": args.n, "d": args.d, "V": args.vocab,
                    "T": args.seq_len, "device": args.device, "dtype": args.dtype,
                    "warmup": args.warmup, "reps": args.reps, "ranks": args.fsdp}
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


# -- mtp bench train --------------------------------------------------------------------------


def bench_train(args: argparse.Namespace) -> list[dict]:
    """Whole training steps (forward, backward, clipping, AdamW) at matched parameters.

    Beside the measured `time_vs_K1`, each row has the FLOP model's ratio `flops_ratio_vs_K1`
    (`MTPTransformer.flops_per_token` of this K over K = 1's, same seq_len) and their quotient
    `time_over_flops_ratio` (target <= 1.05: a K = 4 step costs no more than its FLOPs say),
    `tflops` (model FLOP/s achieved: flops_per_token x tokens / step time), on a GPU of known
    peak `mfu_pct`, and on CUDA the step's peak memory (the allocator's). With `--compile both`
    every K runs eager and compiled (`--compile.enabled` of `mtp fit`), and compiled rows carry
    `speedup_vs_eager`.
    """
    from mtp.bench_kernels import _peak_tflops
    from mtp.loss import naive_mtp_loss, sequential_mtp_loss
    from mtp.module import compile_blocks

    device = torch.device(args.device)
    base = ModelConfig.from_name(args.model)
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    rows, steps = [], []
    for K in args.ks:
        for compiled in modes:
            cfg = ModelConfig(**{**base.__dict__, "n_future": K, "matched_params": True,
                                 "n_layers": args.n_layers or base.n_layers,
                                 "max_seq_len": max(base.max_seq_len, args.seq_len)})
            torch.manual_seed(0)
            before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            model = MTPTransformer(cfg).to(device)
            if compiled:
                compile_blocks(model)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            window = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + K),
                                   device=device)
            inputs, targets = mtp_inputs_targets(window, K)
            loss_fn = sequential_mtp_loss if args.loss == "sequential" else naive_mtp_loss
            dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
            step = _train_step(model, opt, loss_fn, inputs, targets, dtype)
            step()  # compiles (when compiled) and allocates the optimizer state
            peak_mib = None
            if device.type == "cuda":
                # the models built before this one stay alive (for the interleaved timing
                # below) and hold their memory steadily: the peak above `before` is this one's
                torch.cuda.reset_peak_memory_stats(device)
                step()
                peak_mib = (torch.cuda.max_memory_allocated(device) - before) / 2**20
            # NOTE: no peak on a CPU: the process's resident set reuses what earlier
            # configurations freed, so it reads 20-320 MiB for the same model (`mtp bench loss`
            # measures CPU peaks in a fresh process per configuration instead).
            steps.append(step)
            tokens = args.batch_size * args.seq_len
            flops = model.flops_per_token(args.seq_len)
            rows.append({"K": K, "compiled": compiled, "model": args.model,
                         "trunk_blocks": cfg.n_trunk_layers,
                         "params_M": model.num_params() / 1e6, "tokens": tokens,
                         "loss": args.loss, "dtype": args.dtype, "peak_mib": peak_mib,
                         "gflop_per_token": flops / 1e9})
    # NOTE: the configurations' steps alternate, so that a slow spell of a shared machine falls
    # on all of them alike; back-to-back runs of K = 1 then K = 4 moved their ratio by +-10%.
    times = interleaved_median_ms(steps, device, warmup=args.warmup, reps=args.reps)
    for r, ms in zip(rows, times):
        tflops = r["gflop_per_token"] * 1e9 * r["tokens"] / (ms * 1e-3) / 1e12
        peak = _peak_tflops({"fp32": torch.float32, "bf16": torch.bfloat16}[r["dtype"]], device)
        r.update(step_ms=ms, tokens_per_s=r["tokens"] / (ms * 1e-3), tflops=tflops,
                 mfu_pct=100 * tflops / peak if peak else None)
    for r in rows:
        same = [q for q in rows if q["compiled"] == r["compiled"]]
        k1 = next((q for q in same if q["K"] == 1), same[0])
        r["time_vs_K1"] = r["step_ms"] / k1["step_ms"]
        r["flops_ratio_vs_K1"] = r["gflop_per_token"] / k1["gflop_per_token"]
        r["time_over_flops_ratio"] = r["time_vs_K1"] / r["flops_ratio_vs_K1"]
        eager = next((q for q in rows if q["K"] == r["K"] and not q["compiled"]), None)
        r["speedup_vs_eager"] = eager["step_ms"] / r["step_ms"] if r["compiled"] and eager \
            else None
    return rows


# -- entry point ------------------------------------------------------------------------------


def comma_ints(text: str) -> list[int]:
    """An argparse type: comma-separated integers, e.g. `1,2,4`."""
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers (got {text!r})")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["kernel"]:
        from mtp.bench_kernels import main as kernel_main

        kernel_main(argv[1:])
        return 0
    if argv[:1] == ["decode"]:
        from mtp.decode_cli import bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["sandbox"]:
        from mtp.eval.bench import main as sandbox_main

        return sandbox_main(argv[1:])
    if argv[:1] == ["tokenize"]:
        from mtp.bench_tokenize import main as tokenize_main

        return tokenize_main(argv[1:])
    if argv[:1] == ["_loss_worker"]:  # internal: one configuration in a fresh process
        print(json.dumps(_loss_worker(json.loads(argv[1]))))
        return 0
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(prog="mtp bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("kernel", help="fused linear cross-entropy alone (see `mtp bench kernel -h`)")
    sub.add_parser("decode", help="decoders over a prompt set (see `mtp bench decode -h`)")
    sub.add_parser("sandbox", help="evaluation with tests in their own process, against beside "
                   "the completion (see `mtp bench sandbox -h`)")
    loss_p = p = sub.add_parser("loss", help="loss-path peak memory and time over K")
    p.add_argument("--n", type=int, default=16384 if cuda else 4096, help="tokens N")
    p.add_argument("--d", type=int, default=4096 if cuda else 512, help="width d")
    p.add_argument("--vocab", type=int, default=128256 if cuda else 32768, help="vocabulary V")
    p.add_argument("--seq-len", type=int, default=2048, help="T; the batch is N / T sequences")
    p.add_argument("--ks", type=comma_ints, default=[1, 2, 4, 8], help="values of K, e.g. 1,2,4,8")
    p.add_argument("--methods", default=None, help="subset, e.g. naive,sequential+fused")
    p.add_argument("--max-naive-gib", type=float, default=16.0,
                   help="skip naive configurations estimated to need more memory")
    p.add_argument("--fsdp", type=int, default=1, metavar="RANKS",
                   help="shard the heads with FSDP2 over this many processes (gloo on CPU, "
                        "one GPU each on CUDA); N tokens per rank, the worst rank reported")
    train_p = p = sub.add_parser("train", help="training-step time over K at matched parameters, "
                                 "against the FLOP model's ratio")
    p.add_argument("--model", default="cpu", help="registry name (mtp.config.MODEL_REGISTRY)")
    p.add_argument("--n-layers", type=int, default=None,
                   help="blocks of the K = 1 trunk (default: the registry's); K - 1 move to heads")
    p.add_argument("--ks", type=comma_ints, default=[1, 2, 4])
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--loss", choices=["sequential", "naive"], default="sequential")
    p.add_argument("--compile", choices=["off", "on", "both"], default="off",
                   help="torch.compile the blocks (`--compile.enabled`), or run both ways")
    for p in (loss_p, train_p):
        p.add_argument("--device", default="cuda" if cuda else "cpu")
        p.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16" if cuda else "fp32")
        p.add_argument("--warmup", type=int, default=1)
        p.add_argument("--reps", type=int, default=3)
        p.add_argument("--csv", default=None, help="default bench_results/<what>.csv")
    args = parser.parse_args(argv)
    if args.what == "loss":
        if args.n % args.seq_len:
            parser.error(f"--n ({args.n}) must be a multiple of --seq-len ({args.seq_len})")
        if args.fsdp < 1:
            parser.error(f"--fsdp must be >= 1 (got {args.fsdp})")
        rows = bench_loss(args)
    else:
        rows = bench_train(args)
    publish(rows, args.csv or f"bench_results/{args.what}.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())

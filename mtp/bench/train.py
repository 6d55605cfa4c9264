"""`mtp bench train`: whole training steps over K at matched parameters, against the FLOP model."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from mtp.bench.kernel import peak_tflops
from mtp.bench.report import publish
from mtp.bench.timing import interleaved_median_ms
from mtp.config import ModelConfig
from mtp.model.transformer import MTPTransformer
from mtp.train.loss import naive_mtp_loss, sequential_mtp_loss
from mtp.train.module import compile_blocks
from mtp.train.targets import mtp_inputs_targets


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
        peak = peak_tflops({"fp32": torch.float32, "bf16": torch.bfloat16}[r["dtype"]], device)
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


def _check_memory(args: argparse.Namespace) -> None:
    """The step of the largest K within the memory of `--device`, before any model is built
    (`mtp.model.memory`)."""
    from mtp.model.memory import check_memory, training_need
    from mtp.util.environment import available_memory

    base, K = ModelConfig.from_name(args.model), max(args.ks)
    cfg = ModelConfig(**{**base.__dict__, "n_future": K, "matched_params": True,
                         "n_layers": args.n_layers or base.n_layers,
                         "max_seq_len": max(base.max_seq_len, args.seq_len)})
    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    check_memory(lambda c, s: training_need(c, batch_size=s["--batch-size"],
                                            seq_len=s["--seq-len"], naive=args.loss == "naive"),
                 cfg, {"--batch-size": args.batch_size, "--seq-len": args.seq_len},
                 available_memory(kind), doing=f"a training step at K = {K}",
                 where=f"on {args.device}",
                 model_flags={"n_future": "--ks", "n_layers": "--n-layers", "d_model": None,
                              "vocab_size": None, "max_seq_len": None, "ffn_hidden": None})


def run(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """`mtp bench train`: print the table and append it to `--csv`."""
    from mtp.config import MODEL_REGISTRY

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    if args.model not in MODEL_REGISTRY:
        p.error(f"--model {args.model!r}: choose from {', '.join(MODEL_REGISTRY)}")
    for flag, value in (("--batch-size", args.batch_size), ("--seq-len", args.seq_len),
                        ("--ks", min(args.ks)), ("--n-layers", args.n_layers or 1)):
        if value < 1:
            p.error(f"{flag} must be >= 1 (got {value})")
    _check_memory(args)
    publish(bench_train(args), args.csv, args.command)
    return 0

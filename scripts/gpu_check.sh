#!/usr/bin/env bash
# GPU checks on a CUDA machine (H100/H200): first what a GPU user runs, then the kernel side.
#
# What a user runs: `mtp fit` through the Lightning CLI with configs/gpu-125M.yaml (matched
# parameters, bf16-mixed, the sequential head pass) on one GPU, K = 4, over the Python standard
# library's own source (offline, no `datasets`):
#   fit           60 steps, the config's DDP on one GPU;
#   resume        20 more steps from fit's last.ckpt (`--ckpt_path`);
#   generate      `mtp generate` self-spec against greedy on CUDA from resume's checkpoint (else
#                 fit's): the outputs must be equal;
#   decode        `mtp bench decode` over 4 validation prompts: L and ms/token per number of heads;
#   fit-k1        K = 1, the same blocks (matched parameters): its peak memory beside fit's K = 4;
#   fsdp          `--trainer.strategy fsdp` on one GPU, 20 steps;
#   compiled      `--compile.enabled true` (every block and head compiled), 20 steps.
# Every Lightning run must say that its loss ran the Triton kernels: mtp.kernels logs the
# implementation it chose at INFO, and each `mtp` command runs through a small wrapper of the
# `mtp` entry point that records those lines, the exit status, the wall time and the peak CUDA
# memory.
# The kernel side, as before:
#   kernel-tests  the @pytest.mark.gpu kernel tests (bf16 and fp32 against a float64 reference);
#   kernel-bf16   the kernel benchmark in bf16 at (N, d, V) = (16384, 4096, 128256) and
#                 (8192, 2048, 32000) against torch, torch's chunked linear_cross_entropy,
#                 Liger-Kernel and cut-cross-entropy (the last two when importable);
#   kernel-fp32   the same in fp32 at the smaller shape;
#   kernel-sweep  a tile-size sweep of the Triton kernels at the smaller shape;
#   registers     registers, spills and shared memory of every kernel (`mtp.kernels.aot`);
#   train-1B      `mtp bench train` at the 1B model (K = 1 and 4, bf16, eager and compiled);
#   loss-path     `mtp bench loss` at (16384, 4096, 128256): naive vs sequential + fused at
#                 K = 1, 4, 8.
#
# Time: each step has its own timeout, cut to what is left of GPU_CHECK_BUDGET seconds (default
# 510; a killed step's grace and the summary take the rest), so the script ends within 9 minutes
# whatever hangs; a step with under 20 s left is skipped and listed. A failed step does not stop
# the later ones. GPU_CHECK_STEPS picks steps by name or group (`user`, `kernels`; default both),
# e.g. to rerun what was skipped.
#
# Results: $OUT (default bench_results/gpu_check) holds three files, so that it comes back whole
# from a machine that returns only a few: summary.md (the tables: every step's status, the
# Lightning runs with their loss implementation, speed and peak memory, K = 1 against K = 4,
# generate, decode, and the kernel side's printed tables), steps.log, and logs.tar.gz (each
# step's output, the benchmarks' CSVs with hardware, versions and git revision, JUnit XML,
# nvidia-smi, versions). The exit status is 0 when every step that ran passed and every check
# held. Runs and checkpoints go to GPU_CHECK_WORK (default: a temporary folder, removed at the
# end).
#
# Packages: the machine needs torch, Triton, Lightning, einops, tokenizers and tensorboard;
# LightningCLI's parser (jsonargparse and its `signatures` extra) travels as wheels:
# `bash scripts/gpu_wheels.sh` (where a package index is reachable) fills .gpu_wheels/, which
# this script installs first (`pip install --no-index --no-deps --target`) when it holds any.
#
# GPU_CHECK_DRY=1: every step on the CPU instead, at tiny sizes, to prove that each command's
# flags and configs still parse (tests/integration/test_gpu_check.py runs it in the default
# suite). The Lightning runs, generate and decode run for real, their flags those of the GPU run
# with a few more appended (later flags win): a tiny model and corpus, the CPU. Where running
# would take too long, the command is parsed only: the compiled run (`--print_config`) and the
# kernel side's benchmarks (`mtp.bench.parser`); the kernel tests are collected and skipped. A
# failed step ends the dry run at once.
#
# Usage: OUT=/some/dir bash scripts/gpu_check.sh      (PYTHON=... to pick the interpreter)
set -uo pipefail

ROOT="${GPU_CHECK_ROOT:-$(cd "$(dirname "$0")/.." && pwd)}"
cd "$ROOT" || exit 2
OUT="${OUT:-bench_results/gpu_check}"
PYTHON="${PYTHON:-$(command -v python || command -v python3)}"
DRY="${GPU_CHECK_DRY:-0}"
BUDGET="${GPU_CHECK_BUDGET:-510}"
WANT=",${GPU_CHECK_STEPS:-user,kernels},"
WHEELS="${GPU_WHEELS:-$ROOT/.gpu_wheels}"
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"
rm -rf "$OUT/logs" "$OUT/summary.md" "$OUT/steps.log" "$OUT/logs.tar.gz"
LOGS="$OUT/logs"
mkdir -p "$LOGS"
if [[ -n "${GPU_CHECK_WORK:-}" ]]; then
    WORK="$GPU_CHECK_WORK"
    mkdir -p "$WORK"
else
    WORK="$(mktemp -d)"
    trap 'rm -rf "$WORK"' EXIT
fi
start=$(date +%s)
log() { echo "[gpu_check +$(($(date +%s) - start))s] $*" | tee -a "$OUT/steps.log"; }

if [[ "$DRY" == 1 ]]; then
    export CUDA_VISIBLE_DEVICES=""  # the CPU path even where a GPU is present
    # one thread per process: a tiny model gains nothing from more, and on a busy machine
    # spinning OpenMP threads slow every step many times over
    export OMP_NUM_THREADS=1
    DEVICE=cpu
    STEPS=4 MORE=2 SHORT=2 PROMPTS=2 PROMPT_TOKENS=16 NEW_TOKENS=16
    # appended to every `mtp fit` below: the GPU run's own flags are all parsed first
    TINY=(--trainer.accelerator cpu --model.vocab_size 512 --model.d_model 32
          --model.n_attn_heads 2 --model.max_seq_len 64 --data.seq_len 32 --data.batch_size 4
          --data.max_documents 200 --data.tokenizer_train_bytes 300000 --data.num_workers 0)
    # the compiled run is parsed only: compiling on two CPU cores takes longer than all the
    # rest, and with torch 2.13 inductor's CPU code fails in the sample that ends `mtp fit`
    PARSE_ONLY=(--print_config)
    LOSS_IMPL="torch implementation on cpu"
    # a CI machine may be busy: a step's timeout only catches a hang here, and no budget applies
    STEP_TIMEOUT=300 BUDGET=100000
else
    DEVICE=cuda
    STEPS=60 MORE=20 SHORT=20 PROMPTS=4 PROMPT_TOKENS=128 NEW_TOKENS=128
    TINY=()
    PARSE_ONLY=()
    LOSS_IMPL="triton implementation on cuda"
    STEP_TIMEOUT=
fi
log "mode: $([[ "$DRY" == 1 ]] && echo "dry run on the CPU" || echo GPU); steps: ${WANT:1:-1}"

# -- the environment -----------------------------------------------------------------------------

nvidia-smi >"$LOGS/nvidia-smi.txt" 2>&1 || log "nvidia-smi unavailable"
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    log "installing the wheels of $WHEELS into $WORK/site"
    if "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$WORK/site" "$WHEELS"/*.whl >"$LOGS/wheels.txt" 2>&1; then
        export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
    else
        log "installing the wheels failed, see wheels.txt"
    fi
fi
# mtp.kernels lives in kernels/ and is mapped by setuptools' package-dir, so the repository must be
# installed (editable, offline, no dependency resolution) for `import mtp.kernels` to work.
if ! "$PYTHON" -c "import mtp.kernels" 2>/dev/null; then
    log "installing the repository (editable, --no-deps)"
    "$PYTHON" -m pip install --no-deps --no-build-isolation -e . >"$LOGS/pip.txt" 2>&1 \
        || log "editable install failed, see pip.txt"
fi
"$PYTHON" - >"$LOGS/versions.txt" 2>&1 <<'EOF'
import importlib.metadata as md
import sysconfig
from pathlib import Path

import torch

print("torch", torch.__version__, "cuda", torch.version.cuda)
print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
for name in ("triton", "lightning", "jsonargparse", "docstring-parser", "typeshed-client",
             "tokenizers", "einops", "tensorboard", "liger-kernel", "cut-cross-entropy"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "not installed")
stdlib = Path(sysconfig.get_paths()["stdlib"])
files = [p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts]
print(f"stdlib corpus: {len(files)} .py files under {stdlib}")
EOF
cat "$LOGS/versions.txt"

# -- steps ---------------------------------------------------------------------------------------

failed=0
wanted() {  # wanted NAME GROUP: whether GPU_CHECK_STEPS names the step or its group
    [[ "$WANT" == *",$1,"* || "$WANT" == *",$2,"* ]]
}

# step NAME GROUP SECONDS CMD...: CMD under its own timeout, cut to what is left of the budget,
# its output in $LOGS/NAME.txt (MTP_RUN_STATS tells the `mtp` wrapper where its JSON goes); the
# step's name, status, exit status and seconds are appended to $LOGS/steps.tsv.
step() {
    local name=$1 group=$2 limit=${STEP_TIMEOUT:-$3}
    shift 3
    wanted "$name" "$group" || return 0
    local left=$((BUDGET - ($(date +%s) - start)))
    if ((left < 20)); then
        log "$name: skipped, ${left}s of the ${BUDGET}s budget left"
        printf '%s\t%s\t%s\t%s\t%s\n' "$name" "skipped (budget)" - 0 "$limit" >>"$LOGS/steps.tsv"
        return 0
    fi
    ((limit > left)) && limit=$left
    log "$name (timeout ${limit}s): $*"
    local t0 rc status
    t0=$(date +%s)
    MTP_RUN_STATS="$LOGS/$name.json" timeout --kill-after=10 "$limit" "$@" >"$LOGS/$name.txt" 2>&1
    rc=$?
    status=ok
    ((rc == 124 || rc == 137)) && status="timed out"
    ((rc != 0 && rc != 124 && rc != 137)) && status=failed
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$(($(date +%s) - t0))" "$limit" \
        >>"$LOGS/steps.tsv"
    log "$name: $status (exit status $rc, $(($(date +%s) - t0))s)"
    if ((rc != 0)); then
        failed=1
        tail -n 25 "$LOGS/$name.txt"
        [[ "$DRY" == 1 ]] && finish
    fi
    return 0
}

# needs NAME GROUP FILE: FILE exists, else NAME is recorded as skipped (a step before it failed)
needs() {
    wanted "$1" "$2" || return 1
    [[ -f "$3" ]] && return 0
    log "$1: skipped, $3 is missing"
    printf '%s\t%s\t%s\t%s\t%s\n' "$1" "skipped (no checkpoint)" - 0 - >>"$LOGS/steps.tsv"
    failed=1
    [[ "$DRY" == 1 ]] && finish
    return 1
}

# The `mtp` command as its console script runs it (mtp.cli.main), in this process, plus what the
# checks read off the run: mtp.kernels' INFO lines (which linear cross-entropy implementation
# ran), the exit status, the wall time and the peak memory, as JSON in $MTP_RUN_STATS.
cat >"$WORK/mtp_run.py" <<'EOF'
import json
import logging
import os
import resource
import sys
import time

import torch


class KernelLines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
        print(f"[{record.name}] {record.getMessage()}", file=sys.stderr, flush=True)


lines = KernelLines()
logging.getLogger("mtp.kernels").setLevel(logging.INFO)
logging.getLogger("mtp.kernels").addHandler(lines)
from mtp.cli import main  # noqa: E402

t0, rc = time.monotonic(), 1
try:
    rc = main(sys.argv[1:])
except SystemExit as exit_:  # a parse error, or --print_config
    rc = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
    raise
finally:
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    stats = {"rc": rc, "seconds": round(time.monotonic() - t0, 1), "kernel_lines": lines.lines,
             "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
             "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
             "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    with open(os.environ["MTP_RUN_STATS"], "w") as f:
        json.dump(stats, f)
sys.exit(rc)
EOF
MTP=("$PYTHON" "$WORK/mtp_run.py")
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

# the shipped 125M config on the standard library, K = 4, one GPU, a short run that learns
FIT=(--config "$ROOT/configs/gpu-125M.yaml" --data.source stdlib
     --data.tokenizer_train_bytes 8000000 --data.cache_dir "$WORK/cache"
     --trainer.devices 1 --trainer.precision bf16-mixed --trainer.limit_val_batches 4
     --loss.strategy sequential --optim.warmup_steps 10
     --trainer.logger.init_args.save_dir "$WORK/runs")
runs="$WORK/runs"
rm -rf "$runs"  # a rerun in the same GPU_CHECK_WORK starts at version_0 again; the cache stays
last() { echo "$runs/$1/version_0/checkpoints/last.ckpt"; }

finish() {
    "$PYTHON" - "$OUT" "$LOGS" "$runs" "$LOSS_IMPL" "$((STEPS + MORE))" "$failed" \
        <<'EOF' 2>&1 | tee "$OUT/summary.md"
"""The tables of summary.md from the steps' logs, JSON and CSVs; exit status 1 if a check failed."""
import csv
import json
import re
import sys
from pathlib import Path

import torch
import yaml

out, logs, runs = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
loss_impl, resumed_to, failed = sys.argv[4], int(sys.argv[5]), sys.argv[6] == "1"
problems = []


def table(header, rows):
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")
    print()


def stats(name):
    path = logs / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def text(name):
    path = logs / f"{name}.txt"
    return path.read_text(errors="replace") if path.is_file() else ""


def gib(x):
    return "-" if x is None else f"{x:.2f}"


steps = [line.split("\t") for line in (logs / "steps.tsv").read_text().splitlines()] \
    if (logs / "steps.tsv").is_file() else []
print("# gpu_check\n")
print((logs / "versions.txt").read_text() if (logs / "versions.txt").is_file() else "")
table(["step", "status", "exit status", "seconds", "timeout s"], steps)
ran = {s[0] for s in steps if s[1] == "ok"}

fits = [n for n in ("fit", "resume", "fit-k1", "fsdp", "compiled")
        if n in ran and (runs / n / "version_0" / "config.yaml").is_file()]  # not parsed only
if fits:
    print("## Lightning runs (`mtp fit`, configs/gpu-125M.yaml on the standard library)\n")
    rows = []
    for name in fits:
        s, log = stats(name), text(name)
        cfg = yaml.safe_load((runs / name / "version_0" / "config.yaml").read_text())
        t, m = cfg["trainer"], cfg["model"]
        strategy = t["strategy"] if isinstance(t["strategy"], str) else "fsdp"
        speed = re.findall(r"step (\d+)/\d+ .*?([\d,]+) tok/s\s+([\d.]+) s/step", log)
        val = re.findall(r"validation at step \d+\s+next_token_loss ([\d.]+)", log)
        impl = "; ".join(s.get("kernel_lines", [])) or "none logged"
        if loss_impl not in impl:
            problems.append(f"{name}: the loss did not log `{loss_impl}` (got: {impl})")
        rows.append([name, m["n_future"], strategy, cfg["compile"]["enabled"], t["precision"],
                     speed[-1][0] if speed else "-", speed[-1][2] if speed else "-",
                     speed[-1][1] if speed else "-", val[-1] if val else "-",
                     impl.removeprefix("linear cross-entropy: "),
                     gib(s.get("peak_allocated_gib")), gib(s.get("peak_reserved_gib")),
                     gib(s.get("peak_rss_gib")), s.get("seconds", "-")])
    table(["run", "K", "strategy", "compiled", "precision", "last step", "s/step", "tok/s",
           "val next-token loss", "linear cross-entropy", "peak alloc GiB", "peak reserved GiB",
           "peak RSS GiB", "wall s"], rows)
if "resume" in ran:
    ckpt = torch.load(runs / "resume" / "version_0" / "checkpoints" / "last.ckpt",
                      map_location="cpu", mmap=True, weights_only=False)
    if ckpt["global_step"] != resumed_to:
        problems.append(f"resume: last.ckpt is at step {ckpt['global_step']}, not {resumed_to}")
    if "Restoring states from the checkpoint" not in text("resume"):
        problems.append("resume: Lightning did not restore the checkpoint")
if {"fit", "fit-k1"} <= ran and (runs / "fit-k1" / "version_0").is_dir():
    cuda = stats("fit").get("peak_allocated_gib") is not None
    key = "peak_allocated_gib" if cuda else "peak_rss_gib"
    k4, k1 = stats("fit").get(key), stats("fit-k1").get(key)
    print("## Peak memory of the Lightning run, K = 1 against K = 4 (matched parameters)\n")
    table(["memory", "K = 1 GiB", "K = 4 GiB", "K = 4 / K = 1"],
          [["CUDA, allocated" if cuda else "process RSS (no CUDA)", gib(k1), gib(k4),
            f"{k4 / k1:.3f}" if k1 and k4 else "-"]])
if "generate" in ran:
    log = text("generate")
    print("## `mtp generate --decoder self-spec --compare greedy`\n")
    rows = re.findall(r"\[([\w-]+)\] tokens (\d+)\s+forwards (\d+)\s+L ([\d.]+) tokens/forward\s+"
                      r"([\d.]+) ms/token", log)
    table(["decoder", "tokens", "forwards", "L", "ms/token"], rows)
    equal = re.search(r"outputs equal: (\w+)", log)
    print(f"outputs equal: {equal[1] if equal else 'not reported'}\n")
    if not equal or equal[1] != "yes":
        problems.append("generate: self-spec's output is not greedy's")
if "decode" in ran and (logs / "decode.csv").is_file():
    rows = list(csv.DictReader((logs / "decode.csv").open()))
    print("## `mtp bench decode` over validation prompts\n")
    table(["decoder", "L", "simulated L (validation)", "ms/token", "speedup", "equal to greedy"],
          [[r["decoder"], r["L"], r.get("sim_L_text") or "-", r["ms_per_token"], r["speedup"],
            r["equal_to_greedy"]] for r in rows])
    for r in rows:
        done, total = r["equal_to_greedy"].split("/")
        if done != total:
            problems.append(f"decode: {r['decoder']} equals greedy on {r['equal_to_greedy']}")
for name in ("kernel-bf16", "kernel-fp32", "kernel-sweep", "train-1B", "loss-path"):
    if name in ran and text(name).strip():
        print(f"## {name}\n\n```\n{text(name).rstrip()[-6000:]}\n```\n")
for p in problems:
    print(f"CHECK FAILED: {p}")
print("result:", "FAILED" if problems or failed else "all steps that ran passed")
sys.exit(1 if problems or failed else 0)
EOF
    local rc=${PIPESTATUS[0]}
    ((rc != 0)) && failed=1
    tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$LOGS"
    log "done; results in $OUT"
    exit "$failed"
}

# -- what a GPU user runs ------------------------------------------------------------------------

step fit user 150 "${MTP[@]}" fit "${FIT[@]}" --model.n_future 4 --trainer.max_steps "$STEPS" \
    --trainer.val_check_interval "$STEPS" --trainer.logger.init_args.name fit "${TINY[@]}"
needs resume user "$(last fit)" && step resume user 90 "${MTP[@]}" fit "${FIT[@]}" \
    --model.n_future 4 --trainer.max_steps "$((STEPS + MORE))" \
    --trainer.val_check_interval "$MORE" --trainer.logger.init_args.name resume \
    --ckpt_path "$(last fit)" "${TINY[@]}"
ckpt="$(last resume)"
[[ -f "$ckpt" ]] || ckpt="$(last fit)"
needs generate user "$ckpt" && step generate user 60 "${MTP[@]}" generate --ckpt "$ckpt" \
    --prompt "def fibonacci(n):" --decoder self-spec --compare greedy \
    --max-new-tokens "$NEW_TOKENS" --show-drafts markers --device "$DEVICE"
needs decode user "$ckpt" && step decode user 75 "${MTP[@]}" bench decode --ckpt "$ckpt" \
    --prompts validation --limit "$PROMPTS" --prompt-tokens "$PROMPT_TOKENS" \
    --max-new-tokens "$NEW_TOKENS" --decoders greedy,self-spec --auto-tree 0 --repeat 1 \
    --warmup 1 --device "$DEVICE" --csv "$LOGS/decode.csv"
step fit-k1 user 90 "${MTP[@]}" fit "${FIT[@]}" --model.n_future 1 --trainer.max_steps "$SHORT" \
    --trainer.val_check_interval "$SHORT" --trainer.logger.init_args.name fit-k1 "${TINY[@]}"
step fsdp user 90 "${MTP[@]}" fit "${FIT[@]}" --model.n_future 4 --trainer.strategy fsdp \
    --trainer.max_steps "$SHORT" --trainer.val_check_interval "$SHORT" \
    --trainer.logger.init_args.name fsdp "${TINY[@]}"
step compiled user 150 "${MTP[@]}" fit "${FIT[@]}" --model.n_future 4 --compile.enabled true \
    --trainer.max_steps "$SHORT" --trainer.val_check_interval "$SHORT" \
    --trainer.logger.init_args.name compiled "${TINY[@]}" "${PARSE_ONLY[@]}"

# -- the kernel side -----------------------------------------------------------------------------

# `mtp bench ARGS`; in the dry run parsed only (`mtp.bench.parser`): on two CPU cores each
# benchmark takes 5-45 s even at tiny sizes, and its flags are what can rot
BENCH=("$PYTHON" -m mtp.bench)
[[ "$DRY" == 1 ]] && BENCH=("$PYTHON" -c \
    'import sys; from mtp.bench import parser; parser()[0].parse_args(sys.argv[1:])')

step kernel-tests kernels 150 "$PYTHON" -m pytest -o addopts="" \
    tests/kernels/test_linear_cross_entropy_*.py -m gpu -q -rA -p no:cacheprovider \
    --junitxml="$LOGS/gpu_tests.xml"
step kernel-bf16 kernels 120 "${BENCH[@]}" kernel --dtype bf16 --warmup 2 --reps 5 \
    --csv "$LOGS/kernel_bench_bf16.csv"
step kernel-fp32 kernels 40 "${BENCH[@]}" kernel --dtype fp32 --shapes 8192,2048,32000 \
    --warmup 1 --reps 3 --csv "$LOGS/kernel_bench_fp32.csv"
step kernel-sweep kernels 40 "${BENCH[@]}" kernel --sweep --dtype bf16 \
    --shapes 8192,2048,32000 --csv "$LOGS/kernel_sweep_bf16.csv"
# registers and spills (ptxas -v) for this GPU and for sm_80 / sm_90; the command takes no flags,
# so the dry run only checks that its module loads
AOT=()
[[ "$DRY" == 1 ]] && AOT=(--help)
step registers kernels 20 "$PYTHON" -m mtp.kernels.aot "${AOT[@]}"
step train-1B kernels 110 "${BENCH[@]}" train --model 1B --ks 1,4 --dtype bf16 --batch-size 4 \
    --seq-len 2048 --compile both --warmup 2 --reps 5 --csv "$LOGS/train_1B.csv"
step loss-path kernels 60 "${BENCH[@]}" loss --n 16384 --d 4096 --vocab 128256 --seq-len 4096 \
    --ks 1,4,8 --methods naive,sequential+fused --max-naive-gib 100 --warmup 1 --reps 3 \
    --csv "$LOGS/loss_path.csv"

finish

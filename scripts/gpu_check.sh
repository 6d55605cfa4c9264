#!/usr/bin/env bash
# GPU checks on a CUDA machine (H100/H200): the kernel and the training side.
#
#   1. the @pytest.mark.gpu kernel tests (bf16 and fp32 against a float64 reference);
#   2. the kernel benchmark in bf16 at (N, d, V) = (16384, 4096, 128256) and (8192, 2048, 32000)
#      against torch, torch's chunked linear_cross_entropy, Liger-Kernel and cut-cross-entropy
#      (the last two when importable), then fp32 at the smaller shape;
#   3. a tile-size sweep of the Triton kernels at the smaller shape;
#   4. registers, spills and shared memory of every kernel for this GPU (`mtp.kernels.aot`);
#   5. `mtp bench train` at the 1B model (K = 1 and 4, bf16, eager and compiled): step time,
#      tokens/s, MFU, peak memory, against the FLOP model's K = 4 / K = 1 ratio;
#   6. `mtp bench loss` at (N, d, V) = (16384, 4096, 128256): naive vs sequential + fused at
#      K = 1, 4, 8 (peak memory and time of the loss path).
#
# Results go to $OUT (default bench_results/gpu_check): test logs and JUnit XML, benchmark tables
# and CSVs (with hardware, versions and git revision), nvidia-smi. Each step has its own timeout so
# the whole script ends within 9 minutes even when a step hangs; a failed step does not stop the
# later ones, and the exit status is that of the tests. Only torch and Triton are needed (the
# benchmarks run as `python -m mtp.bench`, without the Lightning CLI).
#
# Usage: OUT=/some/dir bash scripts/gpu_check.sh      (PYTHON=... to pick the interpreter)
set -uo pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:-bench_results/gpu_check}"
PYTHON="${PYTHON:-python}"
mkdir -p "$OUT"
start=$(date +%s)
log() { echo "[gpu_check +$(($(date +%s) - start))s] $*" | tee -a "$OUT/steps.log"; }

nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || log "nvidia-smi unavailable"

# mtp.kernels lives in kernels/ and is mapped by setuptools' package-dir, so the repository must be
# installed (editable, offline, no dependency resolution) for `import mtp.kernels` to work.
if ! "$PYTHON" -c "import mtp.kernels" 2>/dev/null; then
    log "installing the repository (editable, --no-deps)"
    "$PYTHON" -m pip install --no-deps --no-build-isolation -e . >"$OUT/pip.txt" 2>&1 \
        || log "editable install failed, see pip.txt"
fi
"$PYTHON" - >"$OUT/versions.txt" 2>&1 <<'EOF'
import torch, triton
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)
print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
for name in ("liger_kernel", "cut_cross_entropy"):
    try:
        __import__(name)
        print(name, "importable")
    except ImportError as exc:
        print(name, "not importable:", exc)
EOF
cat "$OUT/versions.txt"

log "1/6 GPU kernel tests (bf16, fp32)"
timeout 150 "$PYTHON" -m pytest -o addopts="" tests/kernels/test_linear_cross_entropy_*.py -m gpu \
    -q -rA -p no:cacheprovider --junitxml="$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.txt"
tests_rc=${PIPESTATUS[0]}
log "tests exit status $tests_rc"

log "2/6 kernel benchmark, bf16"
timeout 120 "$PYTHON" -m mtp.bench kernel --dtype bf16 --warmup 2 --reps 5 \
    --csv "$OUT/kernel_bench_bf16.csv" 2>&1 | tee "$OUT/kernel_bench_bf16.txt"
log "bf16 benchmark exit status ${PIPESTATUS[0]}"

log "3/6 kernel benchmark, fp32 (smaller shape)"
timeout 40 "$PYTHON" -m mtp.bench kernel --dtype fp32 --shapes 8192,2048,32000 --warmup 1 \
    --reps 3 --csv "$OUT/kernel_bench_fp32.csv" 2>&1 | tee "$OUT/kernel_bench_fp32.txt"
log "fp32 benchmark exit status ${PIPESTATUS[0]}"

log "4/6 tile sweep, bf16 (smaller shape)"
timeout 40 "$PYTHON" -m mtp.bench kernel --sweep --dtype bf16 --shapes 8192,2048,32000 \
    --csv "$OUT/kernel_sweep_bf16.csv" 2>&1 | tee "$OUT/kernel_sweep_bf16.txt"
log "sweep exit status ${PIPESTATUS[0]}"

log "4b/6 registers and spills of the kernels (ptxas -v) for this GPU and for sm_80 / sm_90"
timeout 20 "$PYTHON" -m mtp.kernels.aot 2>&1 | tee "$OUT/kernel_registers.txt"
log "registers exit status ${PIPESTATUS[0]}"

log "5/6 training step, 1B model, K = 1 and 4, bf16, eager and compiled"
timeout 110 "$PYTHON" -m mtp.bench train --model 1B --ks 1,4 --dtype bf16 --batch-size 4 \
    --seq-len 2048 --compile both --warmup 2 --reps 5 --csv "$OUT/train_1B.csv" 2>&1 \
    | tee "$OUT/train_1B.txt"
log "train benchmark exit status ${PIPESTATUS[0]}"

log "6/6 loss path, (16384, 4096, 128256), naive vs sequential + fused, K = 1, 4, 8"
timeout 60 "$PYTHON" -m mtp.bench loss --n 16384 --d 4096 --vocab 128256 --seq-len 4096 \
    --ks 1,4,8 --methods naive,sequential+fused --max-naive-gib 100 --warmup 1 --reps 3 \
    --csv "$OUT/loss_path.csv" 2>&1 | tee "$OUT/loss_path.txt"
log "loss benchmark exit status ${PIPESTATUS[0]}"

log "done; results in $OUT"
exit "$tests_rc"

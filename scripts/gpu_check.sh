#!/usr/bin/env bash
# The CUDA checks, for a session that is lent a GPU (one prepared run, ~5 minutes):
# the CUDA-marked tests, the HF-equivalence suite on CUDA with the sdpa backend, and
# decode-step timings at 64 and 256 running requests on the 135M bfloat16 model.
# Runs from the repository root without installing (the GPU image has torch,
# transformers, tokenizers, safetensors, pytest); logs and results go to $OUT.
#
#     bash scripts/gpu_check.sh
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/gpu-check}"
mkdir -p "$OUT"
nvidia-smi -L; python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
python3 -m pytest -q -p no:cacheprovider tests/runner/test_cuda.py tests/runner/test_cuda_startup.py \
    2>&1 | tee "$OUT/cuda-tests.log"
python3 -m pytest -q -p no:cacheprovider tests/engine/test_hf_equivalence.py \
    --carpool-device cuda -k sdpa 2>&1 | tee "$OUT/hf-equivalence-cuda.log"
python3 benchmarks/make_vs_vllm_checkpoints.py /tmp/vs-vllm --models 135M --dtypes bfloat16 >/dev/null
for n in 64 256; do
    python3 benchmarks/step_times.py /tmp/vs-vllm/135m-bfloat16 --dtype bfloat16 --clock wall \
        --requests $n --engine-arg device=cuda --engine-arg attention_backend=sdpa \
        --engine-arg gpu_memory_utilization=0.5 --engine-arg kv_cache_memory=None
done 2>&1 | tee "$OUT/step-times-cuda.log"

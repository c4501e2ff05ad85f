"""Tensor parallelism through the CUDA start-up path, on CPU: two ranks (threads of this
process, a real gloo group) each profile against their own stand-in card and agree on the
smallest KV pool; then a step on both gives TP=1's token. Only the `torch.cuda` memory
queries are stood in for, and gloo stands in for NCCL (which needs GPUs)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from carpool.core.scheduler_output import ScheduledRequest, SchedulerOutput
from carpool.distributed import join_group, local_init_method
from carpool.platform import CudaPlatform
from carpool.sampling_params import SamplingParams
from tests.runner.test_cuda_startup import FakeCudaMemory, GiB

SETTINGS = dict(num_kv_blocks=None, gpu_memory_utilization=0.5, attention_backend="sdpa",
                max_num_batched_tokens=256, max_num_seqs=8, max_model_len=512)


def test_ranks_profile_their_cards_and_share_the_smallest_pool(llama_checkpoint, make_runner,
                                                              prompts):
    url = local_init_method()
    scheduled, next_block = [], 0
    for i, prompt in enumerate(prompts):  # block_size 4
        num_blocks = -(-len(prompt) // 4)
        scheduled.append(ScheduledRequest(f"r{i}", prompt, 0,
                                          list(range(next_block, next_block + num_blocks)),
                                          True, SamplingParams(temperature=0.0)))
        next_block += num_blocks
    step = SchedulerOutput(scheduled=scheduled)

    def rank(r: int):
        group = join_group(url, 2, torch.device("cpu"), rank=r)
        memory = FakeCudaMemory(total=(8 if r == 0 else 6) * GiB)  # rank 1's card is smaller
        runner = make_runner(llama_checkpoint, **SETTINGS,
                             platform=CudaPlatform(torch.device("cpu"), memory), tp=group)
        return runner, runner.execute(step)

    with ThreadPoolExecutor(2) as pool:
        (rank0, out0), (rank1, out1) = pool.map(rank, (0, 1))
    # 0.5 * 6 GiB - 1 GiB peak - 0.5 GiB elsewhere on rank 1's card; rank 0's could hold more.
    assert rank0.num_kv_blocks == rank1.num_kv_blocks == (
        (3 * GiB - GiB - GiB // 2) // rank1._spec.bytes_per_block)
    assert rank0._spec.num_kv_heads == 1  # of the model's 2
    assert out1.sampled_token_ids == {}  # rank 0 samples
    single = make_runner(llama_checkpoint, attention_backend="sdpa")
    assert out0.sampled_token_ids == single.execute(step).sampled_token_ids

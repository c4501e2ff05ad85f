"""Executes one scheduler step: packed inputs -> forward over the paged KV cache -> sampled tokens.

The runner owns every tensor (weights, KV cache, generators); the scheduler
owns every decision. `execute` takes the step's `SchedulerOutput` (ids, block
tables, token counts) and returns one token per request that reached the end
of its known tokens. Logits are computed only for those rows.

Under tensor parallelism one `ModelRunner` runs on every rank over its shard of
the model (`tp`), each with its own KV cache of identical block ids; every rank
runs the same steps in the same order, and only rank 0 samples.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from carpool.attention import AttentionShape
from carpool.config import EngineConfig
from carpool.core.scheduler_output import ScheduledRequest, SchedulerOutput
from carpool.distributed import SINGLE, TensorParallelGroup
from carpool.lora.adapter_cache import AdapterCache
from carpool.lora.peft_adapter import load_adapter
from carpool.lora.step_lora import KernelTerms, StepLora, order_by_adapter
from carpool.lora_request import LoRARequest
from carpool.models.config import ModelConfig, load_model_config
from carpool.models.draft_check import check_draft_model
from carpool.models.loader import load_model, resolve_model_path
from carpool.models.sharding import ShardLayout
from carpool.outputs import PositionLogprobs, PromptLogprobs
from carpool.platform import Platform, platform_for
from carpool.runner import kv_cache, spec_verify
from carpool.runner.draft_proposer import DraftProposer
from carpool.runner.input_batch import build_input_batch
from carpool.runner.prompt_logprobs import chunk_prompt_logprobs, wants_prompt_logprobs
from carpool.runner.sampler import Sampler
from carpool.sampling_params import SamplingParams
from carpool.structured.speculation import StepGrammar
from carpool.utils.device import resolve_device, resolve_dtype

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelRunnerOutput:
    """One step's results, runner to engine (per request id)."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)  # request id -> new token
    # Only for requests whose sampling_params.logprobs is not None.
    logprobs: dict[str, PositionLogprobs] = field(default_factory=dict)
    # This step's chunk of prompt logprobs, for requests with sampling_params.prompt_logprobs.
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    # Speculative decoding, for requests scheduled with drafts: the drafts verified, emitted
    # before the sampled token, and their logprobs where asked (see runner/spec_verify.py).
    accepted_draft_ids: dict[str, list[int]] = field(default_factory=dict)
    accepted_draft_logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    # For the same requests: how many drafts the step verified, fewer than the scheduler's
    # slots where a grammar cut a draft model's drafts (0: none, a plain decode). The
    # scheduler's counters and averages count these, not the slots.
    num_draft_tokens: dict[str, int] = field(default_factory=dict)

    def logprobs_of(self, request_id: str) -> list[PositionLogprobs] | None:
        """The logprobs of each token the request got this step, in order (None: not asked)."""
        last = self.logprobs.get(request_id)
        if last is None:
            return None
        return [*self.accepted_draft_logprobs.get(request_id, ()), last]


class ModelRunner:
    """Loads a checkpoint, sizes and allocates the KV cache, and runs steps.

    Device specifics come from its `Platform` (process and model set-up, KV memory
    budget) and its attention backend (cache layout, attention kernels); `platform`
    defaults to the device's own and may be given to test one platform's path on another.
    `tp` is the tensor-parallel group of this rank (default: one rank, the whole model).
    """

    def __init__(self, config: EngineConfig, model_path: str | Path, *,
                 tp: TensorParallelGroup = SINGLE, platform: Platform | None = None) -> None:
        """`config`: resolved against the model (`EngineConfig.from_args` or `for_model`),
        with this rank's device; `model_path`: the model's folder (`config.model` resolved)."""
        path = resolve_model_path(model_path)
        model_config = load_model_config(path)
        self.model_config: ModelConfig = model_config
        check_resolved(config, model_config.max_position_embeddings)
        sched_config = config.scheduler
        self.device = resolve_device(config.device)
        batch_invariant = config.batch_invariant
        if batch_invariant and self.device.type != "cpu":
            raise ValueError(f"batch_invariant is CPU-only for now (the device resolved to "
                             f"{self.device}); run with device cpu or without it")
        # This process's slot among the engine's: replica r's rank k (carpool.utils.cpu_threads).
        thread_slot = config.data_parallel_rank * config.tensor_parallel_size + tp.rank
        self.platform = platform if platform is not None else platform_for(
            self.device, config.cpu, batch_invariant=batch_invariant, thread_slot=thread_slot,
            max_num_batched_tokens=sched_config.max_num_batched_tokens,
            mixture_of_experts=model_config.moe is not None)
        self.platform.prepare_process()
        self.dtype = resolve_dtype(config.dtype, model_config.dtype, self.device)
        self.block_size = sched_config.block_size
        self.max_model_len = config.max_model_len
        self.max_num_batched_tokens = sched_config.max_num_batched_tokens
        self.max_num_seqs = sched_config.max_num_seqs
        self.tp = tp
        layout = ShardLayout.of(model_config, tp.rank, tp.world_size)
        kernels = self.platform.compiled_kernels()
        if batch_invariant and kernels is None:
            raise ValueError("batch_invariant needs the C++ CPU kernels, which could not be "
                             "built here (see the warning above: a compiler and ninja)")
        self.attention = self.platform.attention_backend(
            config.attention_backend,
            AttentionShape(layout.num_heads, layout.num_kv_heads, model_config.head_dim,
                           model_config.sliding_window, dtype=self.dtype),
            self.device)
        self.model = load_model(path, model_config, self.dtype, self.device, tp,
                                config.quantization,
                                self.platform.quant_linear_packer(self.dtype))
        self.platform.prepare_model(self.model)
        if config.moe_router_stats and hasattr(self.model, "count_router_load"):
            self.model.count_router_load()
        # LoRA adapters, read from their folders when a step first needs them (None: off)
        self.drafter: DraftProposer | None = None  # (set once the pool is sized)
        self.adapters = None if config.lora is None else AdapterCache(
            config.lora.capacity, self._load_adapter)
        self._max_lora_rank = 0 if config.lora is None else config.lora.max_lora_rank
        # the adapters' term by the kernels' lora_add_ where the CPU route says so
        route = getattr(self.platform, "route", None)
        self.lora_kernel = kernels.lora_add_ if route is not None and route.lora_kernel \
            else None
        self._lora_terms = KernelTerms()  # the last adapter set's lora_add_ weight lists
        # the weights' format and their types, as the loader found them (None: float weights)
        self.quantization: str | None = getattr(self.model, "quantization", None)
        self.sampler = Sampler(self.device, model_config.eos_token_ids, config.seed,
                               argmax_rows=None if kernels is None else kernels.argmax_rows)
        self._spec = kv_cache.KVCacheSpec.from_model(model_config, self.block_size, self.dtype,
                                                     layout.num_kv_heads)
        # Every rank holds the same block ids: the pool is what the smallest rank can hold.
        self.num_kv_blocks = tp.all_reduce_min(self._choose_num_blocks(
            config.num_kv_blocks, config.kv_cache_memory, config.gpu_memory_utilization))
        self.kv_caches = kv_cache.allocate_kv_caches(self._spec, self.num_kv_blocks, self.device,
                                                     self.attention, self.platform.kv_cache_zeros)
        self.kv_cache_info = kv_cache.kv_cache_info(self._spec, self.num_kv_blocks,
                                                    self.max_model_len)
        self.drafter = self._load_drafter(config, model_config, path)
        logger.info("attention backend: %s; platform: %s%s", self.attention.name,
                    self.platform.describe(), f"; {tp.describe()}" if tp.is_parallel else "")
        logger.info("KV cache: %(num_blocks)d blocks of %(block_size)d tokens = %(num_tokens)d "
                    "tokens, %(bytes)d bytes; max concurrency at max_model_len: "
                    "%(max_concurrency).2f", self.kv_cache_info)

    def _load_drafter(self, config: EngineConfig, model_config: ModelConfig,
                      path: Path) -> DraftProposer | None:
        """The draft model of speculative method `draft_model` (None: another method, or
        none), on a platform of its own (its CPU route follows its shape); checked again
        here for configs built field by field."""
        speculative = config.speculative_config
        if speculative is None or speculative.method != "draft_model":
            return None
        if self.tp.is_parallel or self.adapters is not None:
            raise ValueError("speculative_config.method 'draft_model' needs "
                             "tensor_parallel_size 1 and no enable_lora")
        check_draft_model(speculative.model, model_config, path, self.max_model_len)
        platform = platform_for(self.device, config.cpu, batch_invariant=config.batch_invariant,
                                thread_slot=config.data_parallel_rank,
                                max_num_batched_tokens=config.scheduler.max_num_batched_tokens)
        return DraftProposer(resolve_model_path(speculative.model), dtype=self.dtype,
                             device=self.device, platform=platform,
                             attention_backend=config.attention_backend,
                             block_size=self.block_size, num_kv_blocks=self.num_kv_blocks,
                             seed=config.seed, eos_token_ids=model_config.eos_token_ids,
                             tokens_for_batch=speculative.num_tokens_for_batch)

    def close(self) -> None:
        """Nothing to release early: the tensors go with the runner (see `runner.executor`)."""

    def router_load(self) -> tuple[tuple[int, ...], ...] | None:
        """A mixture of experts' rows per expert per sparse layer since start, when counted
        (`moe_router_stats`); None otherwise. (Every tensor-parallel rank routes alike.)"""
        counted = getattr(self.model, "router_load", None)
        return None if counted is None else counted()

    def execute(self, scheduler_output: SchedulerOutput,
                grammar: StepGrammar | None = None) -> ModelRunnerOutput:
        """One forward over all scheduled tokens; a sampled token per request with sample=True.

        Writes the new tokens' K/V into their slots. Padding tokens (static baseline)
        run through the model against the scratch block and are discarded.
        `grammar`: the step's constrained requests; their masks (one per verified position)
        begin before the forward, once the drafts are known, and are awaited only once the
        logits exist, so they are computed meanwhile.
        """
        return self._run_step(scheduler_output, self.kv_caches, self.num_kv_blocks, grammar)

    @torch.inference_mode()
    def _run_step(self, scheduler_output: SchedulerOutput, kv_caches: list[torch.Tensor],
                  num_kv_blocks: int, grammar: StepGrammar | None = None) -> ModelRunnerOutput:
        """`execute` against the given caches of num_kv_blocks + 1 (scratch) blocks."""
        self.sampler.free(scheduler_output.finished_ids)
        if scheduler_output.is_empty:
            return ModelRunnerOutput()
        lora, draft_probs = None, {}
        slotted = {r.request_id for r in scheduler_output.scheduled if r.draft_token_ids}
        if self.drafter is not None and kv_caches is self.kv_caches:  # (not when profiling)
            drafted = self.drafter.propose(scheduler_output, grammar)
            scheduler_output, draft_probs = drafted.scheduler_output, drafted.probs
        if grammar is not None:
            grammar.start({r.request_id: r.draft_token_ids for r in scheduler_output.scheduled
                           if r.draft_token_ids and r.request_id in grammar})
        if self.adapters is not None:
            scheduler_output = order_by_adapter(scheduler_output)
        batch = build_input_batch(scheduler_output, block_size=self.block_size,
                                  scratch_block=num_kv_blocks, device=self.device)
        if self.adapters is not None:
            lora = self._step_lora(scheduler_output, batch)
        meta = self.attention.build_metadata(batch.layout)
        args = (batch.input_ids, batch.positions, kv_caches, self.attention, meta)
        # (a base-only step calls the model as it would without adapters)
        hidden = self.model(*args) if lora is None else self.model(*args, lora=lora)
        output = ModelRunnerOutput(num_draft_tokens={
            r.request_id: len(r.draft_token_ids) for r in scheduler_output.scheduled
            if r.request_id in slotted} if slotted else {})
        for i, req in enumerate(scheduler_output.scheduled):
            if req.sampling_params.prompt_logprobs is not None and wants_prompt_logprobs(req):
                # on every rank: the logits are a collective
                chunk = chunk_prompt_logprobs(self.model.compute_logits, hidden, req,
                                              int(batch.layout.query_starts[i]))
                if self.tp.rank == 0:
                    output.prompt_logprobs[req.request_id] = chunk
        if not batch.sampled:
            return output
        logits = self.model.compute_logits(hidden[batch.logits_indices])  # (N, V) model dtype
        if self.tp.rank != 0:  # every rank gathers the logits (a collective); rank 0 samples
            return ModelRunnerOutput()
        bitmask = grammar.result() if grammar is not None else None
        if batch.num_drafts:
            output = self._verify_drafts(logits, batch.sampled, bitmask, output, draft_probs)
            if self.drafter is not None:
                self.drafter.verified([r for r in batch.sampled if r.draft_token_ids],
                                      output.accepted_draft_ids)
            return output
        sampled = self.sampler.sample(logits, batch.sampled, bitmask)
        ids = [req.request_id for req in batch.sampled]
        return dataclasses.replace(
            output, sampled_token_ids=dict(zip(ids, sampled.token_ids)),
            logprobs={rid: logprobs for rid, logprobs in zip(ids, sampled.logprobs)
                      if logprobs is not None})

    def _verify_drafts(self, logits: torch.Tensor, requests: list[ScheduledRequest], bitmask,
                       output: ModelRunnerOutput,
                       draft_probs: dict[str, torch.Tensor]) -> ModelRunnerOutput:
        """Sample every logits row of a step with draft tokens and keep what verifies;
        `draft_probs`: a draft model's q per sampled request (rejection sampling)."""
        states = self.sampler.seeded_states([r for r in requests if r.draft_token_ids
                                             and r.request_id not in draft_probs])
        sampled = self.sampler.sample(logits, spec_verify.logits_rows(requests), bitmask,
                                      spec_verify.proposals(requests, draft_probs))
        verified = spec_verify.verify(requests, sampled.token_ids, sampled.logprobs)
        # A request drafted by n-gram draws only for the rows kept, as without drafts; one
        # with a draft model's q keeps its 1 + k draws (`rejection_tokens` uses them all).
        for rid, state in states.items():
            seed = next(r.sampling_params.seed for r in requests if r.request_id == rid)
            self.sampler.rewind(rid, seed, state, verified.num_rows_used[rid])
        return dataclasses.replace(
            output, sampled_token_ids=verified.sampled_token_ids,
            accepted_draft_ids=verified.accepted_draft_ids,
            logprobs={rid: positions[-1] for rid, positions in verified.logprobs.items()},
            accepted_draft_logprobs={rid: positions[:-1]
                                     for rid, positions in verified.logprobs.items()})

    def _step_lora(self, scheduler_output: SchedulerOutput, batch) -> StepLora | None:
        """The step's rows grouped by adapter, their weights loaded (None: all base rows)."""
        requests = [s.lora_request for s in scheduler_output.scheduled
                    if s.lora_request is not None]
        if not requests:
            return None
        weights = self.adapters.activate(requests)
        return StepLora.of(scheduler_output.scheduled, batch.layout.query_starts,
                           batch.layout.query_lens, weights, self.lora_kernel, self._lora_terms)

    def _load_adapter(self, request: LoRARequest):
        weights = load_adapter(request.lora_name, request.lora_path, self.model_config,
                               self._max_lora_rank, self.dtype, self.device)
        logger.info("LoRA adapter %r (id %d) loaded from %s: %d bytes", request.lora_name,
                    request.lora_int_id, request.lora_path, weights.nbytes)
        return weights

    def evict_adapter(self, lora_int_id: int) -> bool:
        """Drop a loaded adapter now (unloaded by name); False if it was not loaded."""
        self._lora_terms.clear()  # it may hold the adapter's tensors
        return self.adapters is not None and self.adapters.evict(lora_int_id)

    def _choose_num_blocks(self, num_kv_blocks: int | None, kv_cache_memory: int | None,
                           gpu_memory_utilization: float) -> int:
        """Explicit count, else bytes, else a profiled budget (CUDA), else the platform's
        default share of RAM (CPU, capped at what max_num_seqs requests could fill)."""
        if num_kv_blocks is not None:
            if num_kv_blocks < 1:
                raise ValueError(f"num_kv_blocks must be >= 1, got {num_kv_blocks}")
            return num_kv_blocks
        if kv_cache_memory is not None:
            return kv_cache.num_blocks_for_bytes(self._spec, kv_cache_memory, "kv_cache_memory")
        if self.platform.profiles_memory:
            self._profile_forward()
            budget = self.platform.kv_cache_budget(gpu_memory_utilization)
            return kv_cache.num_blocks_for_bytes(self._spec, budget, "gpu_memory_utilization")
        num_blocks = kv_cache.num_blocks_for_bytes(self._spec,
                                                   self.platform.default_kv_cache_bytes(),
                                                   "the CPU default KV cache size")
        # No point holding more than max_num_seqs requests of max_model_len could fill.
        return min(num_blocks, self.max_num_seqs * -(-self.max_model_len // self.block_size))

    def _profile_forward(self) -> None:
        """Run the largest steps the scheduler may send against a throwaway cache (peak memory)."""
        num_blocks, steps = profiling_steps(self.max_num_batched_tokens, self.max_num_seqs,
                                            self.max_model_len, self.block_size)
        self.platform.begin_profile()
        caches = kv_cache.allocate_kv_caches(self._spec, num_blocks, self.device, self.attention)
        for step in steps:
            self._run_step(step, caches, num_blocks)
        del caches
        self.platform.end_profile()


def check_resolved(config: EngineConfig, max_position_embeddings: int) -> None:
    """ValueError unless `config`'s max_model_len is set, is the scheduler's, and fits the
    model (configs from `EngineConfig.from_args` or `for_model` always do)."""
    if not config.is_resolved:
        raise ValueError("ModelRunner needs a config resolved against its model "
                         "(EngineConfig.from_args or for_model)")
    if config.max_model_len > max_position_embeddings:
        raise ValueError(f"max_model_len ({config.max_model_len}) exceeds the model's "
                         f"max_position_embeddings ({max_position_embeddings})")


def profiling_steps(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                    block_size: int) -> tuple[int, list[SchedulerOutput]]:
    """(blocks needed, steps): a full-budget prefill, and max_num_seqs decodes at max_model_len.

    The decodes' block tables repeat a few blocks, so the gather reads max_model_len keys
    per request (the real peak) from a small throwaway cache.
    """
    greedy = SamplingParams(temperature=0.0)
    num_seqs = max(1, min(max_num_seqs, -(-max_num_batched_tokens // max_model_len)))
    lengths = [max_num_batched_tokens // num_seqs + (i < max_num_batched_tokens % num_seqs)
               for i in range(num_seqs)]
    prefills, next_block = [], 0
    for i, length in enumerate(lengths):
        blocks = list(range(next_block, next_block + -(-length // block_size)))
        next_block += len(blocks)
        prefills.append(ScheduledRequest(f"profile-prefill-{i}", [0] * length, 0, blocks, True,
                                         greedy))
    blocks_per_seq = -(-max_model_len // block_size)
    table = [b % next_block for b in range(blocks_per_seq)]
    decodes = [ScheduledRequest(f"profile-decode-{i}", [0], max_model_len - 1, table, True, greedy)
               for i in range(max_num_seqs)]
    return next_block, [SchedulerOutput(scheduled=prefills), SchedulerOutput(scheduled=decodes)]

"""How a Llama-family model splits across the ranks of a tensor-parallel group.

    q/k/v, gate/up  column-parallel: rank r holds its slice of the output rows
    experts         every expert sharded like the dense MLP: rank r holds its slice of each
                    expert's gate/up rows and down columns (and of the shared expert's),
                    so every rank runs every routed row and one all-reduce sums the layer
    o, down         row-parallel: rank r holds its slice of the input columns;
                    the partial products are summed by an all-reduce
    embedding, lm_head  vocab-parallel: rank r holds rows [r*V/N, (r+1)*V/N) of the
                    vocabulary padded up to a multiple of N (padding rows are zero)

Query heads split evenly. KV heads split evenly too when there are at least as many
as ranks; with fewer (MQA, small GQA) each KV head is replicated on the ranks whose
query heads read it, so every rank holds exactly one. `Shard` says which slice of a
checkpoint tensor a rank loads, so the loader reads only that slice from disk.
"""

from __future__ import annotations

from dataclasses import dataclass

from carpool.models.config import ModelConfig


@dataclass(frozen=True)
class Shard:
    """Rank's slice [start, start + size) along `dim` of a checkpoint tensor `full` long there.

    `start + size` may pass `full` (the vocabulary padding): those rows are zero.
    """

    dim: int
    start: int
    size: int
    full: int

    @property
    def num_loaded(self) -> int:
        """How many of the `size` rows (or columns) the checkpoint holds."""
        return max(0, min(self.size, self.full - self.start))


@dataclass(frozen=True)
class ShardLayout:
    """One rank's sizes and offsets; `ShardLayout.of(config, 0, 1)` is the whole model."""

    rank: int
    world_size: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank
    kv_head_start: int  # the first of them, among the model's KV heads
    intermediate_size: int  # MLP rows on this rank
    vocab_per_rank: int  # padded vocabulary / world_size
    expert_intermediate_size: int = 0  # each expert's gate/up rows on this rank (0: dense)
    shared_expert_intermediate_size: int = 0  # the shared expert's rows on this rank

    @classmethod
    def of(cls, config: ModelConfig, rank: int, world_size: int) -> ShardLayout:
        check_divisible(config, world_size)
        num_heads = config.num_heads // world_size
        if config.num_kv_heads >= world_size:
            num_kv_heads = config.num_kv_heads // world_size
            kv_head_start = rank * num_kv_heads
        else:  # replicated: this rank's query heads all read one KV head
            num_kv_heads = 1
            kv_head_start = rank * config.num_kv_heads // world_size
        moe = config.moe
        return cls(rank=rank, world_size=world_size, num_heads=num_heads,
                   num_kv_heads=num_kv_heads, kv_head_start=kv_head_start,
                   intermediate_size=config.intermediate_size // world_size,
                   vocab_per_rank=-(-config.vocab_size // world_size),
                   expert_intermediate_size=0 if moe is None
                   else moe.expert_intermediate_size // world_size,
                   shared_expert_intermediate_size=0 if moe is None
                   else moe.shared_expert_intermediate_size // world_size)

    def column(self, size_per_rank: int, full: int, index: int | None = None) -> Shard:
        """Output rows of the `index`-th block of `size_per_rank` (default: this rank's)."""
        index = self.rank if index is None else index
        return Shard(0, index * size_per_rank, size_per_rank, full)

    def row(self, size_per_rank: int, full: int) -> Shard:
        """This rank's input columns of a row-parallel weight."""
        return Shard(1, self.rank * size_per_rank, size_per_rank, full)


def check_divisible(config: ModelConfig, world_size: int) -> None:
    """ValueError naming tensor_parallel_size and the numbers when the model cannot split."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {world_size!r}")
    if config.num_heads % world_size:
        raise ValueError(f"tensor_parallel_size ({world_size}) must divide the model's "
                         f"num_attention_heads ({config.num_heads})")
    kv = config.num_kv_heads
    if kv % world_size and world_size % kv:
        raise ValueError(f"tensor_parallel_size ({world_size}) must divide the model's "
                         f"num_key_value_heads ({kv}) or be a multiple of it")
    sizes = {"intermediate_size": config.intermediate_size}
    if config.moe is not None:
        sizes["moe_intermediate_size"] = config.moe.expert_intermediate_size
        sizes["shared_expert_intermediate_size"] = config.moe.shared_expert_intermediate_size
    for name, size in sizes.items():
        if size % world_size:
            raise ValueError(f"tensor_parallel_size ({world_size}) must divide the model's "
                             f"{name} ({size})")

"""Paged KV accounting: a fixed pool of block ids handed to requests on demand.

A request's block table is a list of block ids; block `i` of the table holds
the KV of its tokens at positions [i * block_size, (i + 1) * block_size).
Blocks leave from the front of the free queue and return to its back, so the
ids a request gets are predictable (tests assert them). Reference counts
leave room for prefix sharing: a block is free again only when no table
holds it.

    table:  [ 7 | 3 | 9 ]            block_size = 4, 10 tokens held
    tokens:  0..3 4..7 8 9 _ _       2 slots of internal waste in block 9
"""

from __future__ import annotations

from collections import deque

from carpool.core.kv_fit import cdiv


class NoFreeBlocksError(RuntimeError):
    """Raised by `allocate` when the pool cannot grow a table as asked."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.block_size = block_size
        self.num_total_blocks = num_blocks
        self._free_block_ids: deque[int] = deque(range(num_blocks))
        self._ref_counts: list[int] = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}
        self._num_tokens: dict[str, int] = {}  # tokens each table was sized for

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - len(self._free_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of the pool held by requests, 0..1."""
        return self.num_used_blocks / self.num_total_blocks

    @property
    def num_wasted_slots(self) -> int:
        """Internal waste: token slots allocated but not (yet) used, in tables' last blocks."""
        return sum(len(table) * self.block_size - self._num_tokens[request_id]
                   for request_id, table in self._tables.items())

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return cdiv(num_tokens, self.block_size)

    def num_new_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Blocks a request must gain for its table to hold `num_tokens` tokens in all."""
        table = self._tables.get(request_id, ())
        return max(0, self.num_blocks_for(num_tokens) - len(table))

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return self.num_new_blocks_needed(request_id, num_tokens) <= len(self._free_block_ids)

    def allocate(self, request_id: str, num_tokens: int) -> list[int]:
        """Grow the request's table (creating it if needed) to hold `num_tokens` tokens in all.

        Takes the new blocks from the front of the free queue and returns the
        whole table (the live list: read it, do not change it). Raises
        `NoFreeBlocksError`, changing nothing, when the pool is short.
        """
        num_new = self.num_new_blocks_needed(request_id, num_tokens)
        if num_new > len(self._free_block_ids):
            raise NoFreeBlocksError(
                f"request {request_id!r} needs {num_new} more blocks for {num_tokens} tokens, "
                f"only {len(self._free_block_ids)} free")
        table = self._tables.setdefault(request_id, [])
        for _ in range(num_new):
            block_id = self._free_block_ids.popleft()
            self._ref_counts[block_id] += 1
            table.append(block_id)
        self._num_tokens[request_id] = max(num_tokens, self._num_tokens.get(request_id, 0))
        return table

    def free(self, request_id: str) -> int:
        """Drop the request's table; blocks no other table holds go to the back of the free queue.

        Returns how many blocks became free (0 for a request holding none).
        """
        table = self._tables.pop(request_id, [])
        self._num_tokens.pop(request_id, None)
        num_freed = 0
        for block_id in table:
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free_block_ids.append(block_id)
                num_freed += 1
        return num_freed

    def get_block_table(self, request_id: str) -> list[int]:
        """The request's block ids in token order (empty when it holds none). Do not mutate."""
        return self._tables.get(request_id, [])

    def holds(self, request_id: str) -> bool:
        return request_id in self._tables

    def check_integrity(self) -> None:
        """Raise AssertionError unless free + held = total, each id once, ref counts consistent."""
        free = list(self._free_block_ids)
        free_set = set(free)
        if len(free_set) != len(free):
            raise AssertionError("a block id is in the free queue twice")
        counts = [0] * self.num_total_blocks
        for request_id, table in self._tables.items():
            if len(set(table)) != len(table):
                raise AssertionError(f"request {request_id!r} holds a block twice: {table}")
            if len(table) != self.num_blocks_for(self._num_tokens[request_id]):
                raise AssertionError(f"request {request_id!r} holds {len(table)} blocks "
                                     f"for {self._num_tokens[request_id]} tokens")
            for block_id in table:
                counts[block_id] += 1
        for block_id in range(self.num_total_blocks):
            if counts[block_id] != self._ref_counts[block_id]:
                raise AssertionError(f"block {block_id}: ref count {self._ref_counts[block_id]}, "
                                     f"held by {counts[block_id]} tables")
            if (counts[block_id] == 0) != (block_id in free_set):
                raise AssertionError(f"block {block_id} is both free and held, or neither")

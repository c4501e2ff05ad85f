"""Paged KV accounting: a fixed pool of block ids handed to requests on demand.

A request's block table is a list of block ids; block `i` of the table holds
the KV of its tokens at positions [i * block_size, (i + 1) * block_size).
Blocks leave from the front of the free queue and return to its back, so the
ids a request gets are predictable (tests assert them). A block is free again
only when no table holds it (reference counts).

A table that grows (a decode crossing into a new block, a later prompt chunk)
takes its next block with up to `growth_run_blocks - 1` ids that follow it at the
front of the queue set aside as the request's spare blocks, and grows from those
next: its blocks come in runs of consecutive ids instead of one id each (200
requests decoding together would otherwise interleave theirs), and a decode
kernel reads a run as one stream. Spare blocks are free (counted so, held by no
table) and lent back when the queue is empty, before any cached block is
evicted; they return to the queue's back when their request frees its table.

    decoding A, B:  queue 20 21 22 23 24 25 ...   A grows: takes 20, spares 21..23
                    B grows: takes 24, spares 25..27; A's next blocks are 21, 22, 23

    table:  [ 7 | 3 | 9 ]            block_size = 4, 10 tokens held
    tokens:  0..3 4..7 8 9 _ _       2 slots of internal waste in block 9

With prefix caching on, a full block gets a hash once a step is planned to
compute its K/V (`cache_full_blocks`; the scheduler calls it before a lookup
could hit the block, or when the request leaves); a new table may start with
such blocks found by `find_cached_blocks` (shared, reference count > 1). A block is written
in one step only, by the one request computing it: a table that starts with it
reads it, in that step (after the step's writes) or later, and never writes it. A
cached block that no table holds stays free *and* findable until evicted: new
blocks come from the plain free queue first, then from the prefix cache's
least recently used free blocks (see `core/prefix_cache.py`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from carpool.core.kv_fit import cdiv
from carpool.core.prefix_cache import PrefixCache, hash_block_tokens
from carpool.core.request import Request


class NoFreeBlocksError(RuntimeError):
    """Raised by `allocate` when the pool cannot grow a table as asked."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = False, growth_run_blocks: int = 16) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size),
                            ("growth_run_blocks", growth_run_blocks)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.block_size = block_size
        self.num_total_blocks = num_blocks
        self._free_block_ids: deque[int] = deque(range(num_blocks))  # free blocks without a hash
        self.growth_run_blocks = growth_run_blocks
        self._spare_ids: dict[str, deque[int]] = {}  # per request: free ids it grows into next
        self._num_spare = 0
        self._ref_counts: list[int] = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}
        self._num_tokens: dict[str, int] = {}  # tokens each table was sized for
        self.prefix_cache = PrefixCache() if enable_prefix_caching else None
        self._num_hashed: dict[str, int] = {}  # leading blocks of each table that have a hash

    @property
    def num_free_blocks(self) -> int:
        """Blocks no table holds: plain free ones (spares too) and cached ones that may still
        be hit."""
        num_cached_free = self.prefix_cache.num_evictable if self.prefix_cache else 0
        return len(self._free_block_ids) + self._num_spare + num_cached_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - self.num_free_blocks

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

    def num_new_blocks_needed(self, request_id: str, num_tokens: int,
                              cached_block_ids: Sequence[int] = ()) -> int:
        """Blocks a request must take from the free pool for its table to hold `num_tokens`
        tokens in all, when a new table starts with `cached_block_ids`."""
        table = self._tables.get(request_id, ())
        return max(0, self.num_blocks_for(num_tokens) - len(table) - len(cached_block_ids))

    def can_allocate(self, request_id: str, num_tokens: int,
                     cached_block_ids: Sequence[int] = ()) -> bool:
        table = self._tables.get(request_id)
        if table is not None and len(table) * self.block_size >= num_tokens:
            return True  # most decode steps: the last block has room
        num_new = self.num_new_blocks_needed(request_id, num_tokens, cached_block_ids)
        return num_new <= self._num_free_besides(cached_block_ids)

    def allocate(self, request_id: str, num_tokens: int,
                 cached_block_ids: Sequence[int] = ()) -> list[int]:
        """Grow the request's table (creating it if needed) to hold `num_tokens` tokens in all.

        A new table may start with `cached_block_ids` (from `find_cached_blocks`, just
        before): they gain a holder. New blocks come from the front of the free queue (a
        table that grows: from its spare blocks first), then from other requests' spare
        blocks, then by evicting the least recently used cached free block. Returns the whole
        table (the live list: read it, do not change it). Raises `NoFreeBlocksError`,
        changing nothing, when the pool is short.
        """
        if cached_block_ids and request_id in self._tables:
            raise ValueError(f"request {request_id!r} already holds blocks; only a new table "
                             "starts with cached blocks")
        table = self._tables.get(request_id)
        if table is not None and len(table) * self.block_size >= num_tokens:
            if num_tokens > self._num_tokens[request_id]:  # most decode steps: it has room
                self._num_tokens[request_id] = num_tokens
            return table
        num_new = self.num_new_blocks_needed(request_id, num_tokens, cached_block_ids)
        num_free = self._num_free_besides(cached_block_ids)
        if num_new > num_free:
            raise NoFreeBlocksError(
                f"request {request_id!r} needs {num_new} more blocks for {num_tokens} tokens, "
                f"only {num_free} free")
        growing = table is not None
        if table is None:
            table = self._tables[request_id] = []
        for block_id in cached_block_ids:
            if self._ref_counts[block_id] == 0:
                self.prefix_cache.take(block_id)
            self._ref_counts[block_id] += 1
            table.append(block_id)
        if cached_block_ids:
            self._num_hashed[request_id] = len(cached_block_ids)
        for _ in range(num_new):
            block_id = self._take_growth_block(request_id) if growing else self._take_free_block()
            self._ref_counts[block_id] += 1
            table.append(block_id)
        self._num_tokens[request_id] = max(num_tokens, self._num_tokens.get(request_id, 0))
        return table

    def free(self, request_id: str) -> int:
        """Drop the request's table; blocks no other table holds become free: plain ones go to
        the back of the free queue in table order, then its spare blocks; cached ones become
        the prefix cache's most recently used, tail block first, so a request's tail is
        evicted before its head.

        Returns how many blocks became free (0 for a request holding none).
        """
        table = self._tables.pop(request_id, [])
        self._num_tokens.pop(request_id, None)
        self._num_hashed.pop(request_id, None)
        cached = []
        cache = self.prefix_cache
        for block_id in table:
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                if cache is not None and cache.hash_of(block_id) is not None:
                    cached.append(block_id)
                else:
                    self._free_block_ids.append(block_id)
        spares = self._spare_ids.pop(request_id, ())
        self._num_spare -= len(spares)
        self._free_block_ids.extend(spares)
        for block_id in reversed(cached):
            cache.release(block_id)
        return sum(1 for block_id in table if self._ref_counts[block_id] == 0)

    # -- prefix caching ----------------------------------------------------------------------

    def find_cached_blocks(self, request: Request) -> list[int]:
        """The cached blocks holding the longest computed prefix of the request's tokens
        (empty with caching off). At most `(num_tokens - 1) // block_size` blocks, so the
        last token is always computed and no write lands in a shared block. Extends
        `request.block_hashes`; changes no block."""
        if self.prefix_cache is None:
            return []
        num_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self.block_hashes(request, num_blocks)
        found = []
        for block_hash in hashes[:num_blocks]:
            block_id = self.prefix_cache.get(block_hash)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Give a hash to each block of the request's table that `num_computed_tokens` fills
        (its K/V written by the end of the step being planned), so other requests can hit it.
        No-op with caching off."""
        if self.prefix_cache is None or request.request_id not in self._tables:
            return
        table = self._tables[request.request_id]
        num_full = min(num_computed_tokens // self.block_size, len(table))
        start = self._num_hashed.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self.block_hashes(request, num_full)
        for index in range(start, num_full):
            self.prefix_cache.register(table[index], hashes[index])
        self._num_hashed[request.request_id] = num_full

    def reset_prefix_cache(self) -> int:
        """Forget every block hash; cached free blocks become plain free blocks (to the back of
        the free queue). Held blocks stay held, only unshareable. Returns the blocks freed of
        their hash that no table holds."""
        if self.prefix_cache is None:
            return 0
        freed = self.prefix_cache.clear()
        self._free_block_ids.extend(freed)
        return len(freed)

    def block_hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """The chained hashes of the request's first `num_blocks` full blocks (at least; the
        live `request.block_hashes`, extended as needed). Changes no block."""
        hashes = request.block_hashes
        size = self.block_size
        while len(hashes) < num_blocks:
            index = len(hashes)
            tokens = request.token_ids_slice(index * size, (index + 1) * size)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, tokens, request.cache_salt,
                                            request.lora_int_id))
        return hashes

    def _num_free_besides(self, cached_block_ids: Sequence[int]) -> int:
        """Free blocks left for new ones once `cached_block_ids` (some may be free) are held."""
        return self.num_free_blocks - sum(1 for b in cached_block_ids if self._ref_counts[b] == 0)

    def _take_free_block(self) -> int:
        """The front of the free queue; else the last spare block of the first request that
        has one (a free block, so no cached content is lost); else an evicted cached block."""
        if self._free_block_ids:
            return self._free_block_ids.popleft()
        if self._num_spare:
            request_id, spares = next(iter(self._spare_ids.items()))
            return self._take_spare(request_id, spares, spares.pop)
        return self.prefix_cache.evict()

    def _take_growth_block(self, request_id: str) -> int:
        """A block for a table that grows: its next spare block; else the front of the free
        queue, with the ids that follow it there (up to growth_run_blocks - 1) as its spares."""
        spares = self._spare_ids.get(request_id)
        if spares:
            return self._take_spare(request_id, spares, spares.popleft)
        queue = self._free_block_ids
        if not queue:
            return self._take_free_block()
        block_id = queue.popleft()
        run: deque[int] = deque()
        limit = self.growth_run_blocks - 1
        while len(run) < limit and queue and queue[0] == block_id + len(run) + 1:
            run.append(queue.popleft())
        if run:
            self._spare_ids[request_id] = run
            self._num_spare += len(run)
        return block_id

    def _take_spare(self, request_id: str, spares: deque[int], take) -> int:
        block_id = take()
        self._num_spare -= 1
        if not spares:
            del self._spare_ids[request_id]
        return block_id

    def get_block_table(self, request_id: str) -> list[int]:
        """The request's block ids in token order (empty when it holds none). Do not mutate."""
        return self._tables.get(request_id, [])

    def holds(self, request_id: str) -> bool:
        return request_id in self._tables

    def check_integrity(self) -> None:
        """Raise AssertionError unless free + held = total, each id once, ref counts consistent,
        and (with caching on) the hash maps and the LRU agree with the ref counts."""
        free = list(self._free_block_ids)
        for request_id, spares in self._spare_ids.items():
            if not spares or request_id not in self._tables:
                raise AssertionError(f"request {request_id!r} keeps spare blocks {list(spares)} "
                                     "without a table")
            free += spares
        if sum(len(spares) for spares in self._spare_ids.values()) != self._num_spare:
            raise AssertionError("the spare block count is off")
        if self.prefix_cache is not None:
            self.prefix_cache.check_integrity(self._ref_counts)
            free += [b for b in range(self.num_total_blocks) if self.prefix_cache.is_evictable(b)]
            if any(self.prefix_cache.hash_of(b) is not None for b in self._free_block_ids):
                raise AssertionError("a block in the plain free queue has a hash")
            if any(self.prefix_cache.hash_of(b) is not None
                   for spares in self._spare_ids.values() for b in spares):
                raise AssertionError("a spare block has a hash")
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

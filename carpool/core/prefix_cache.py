"""Automatic prefix caching: full KV blocks found again by the hash of their tokens.

A block's hash chains over its parent block's hash and its own token ids, so
two equal hashes mean two equal whole prefixes, not merely two equal blocks.
Only full blocks whose K/V is computed get a hash; a request's last, partial
block never does:

    block_size = 4, cache_salt "s", LoRA adapter id 3
    tokens:  | 5 6 7 8 | 9 1 2 3 | 4 4 (partial)
    hash:      h0 = H(root "s" 3, 5 6 7 8)
                         h1 = H(h0, 9 1 2 3)

The hash is sha256 over an unambiguous byte encoding, so a crafted prompt
cannot collide with another tenant's prefix; `cache_salt` and the LoRA adapter's
id enter the first block's hash and so separate whole chains (an adapter changes
every layer's K/V: two adapters never share a block).

`PrefixCache` maps hashes to block ids and keeps the *cached free* blocks
(hash kept, no table holds them) in least-recently-used order: the block
manager hits them again or, when it needs a block and has no uncached one,
evicts the least recently used one (its hash is forgotten).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

_ROOT = b"\x00"
_CHILD = b"\x01"


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int],
                      cache_salt: str | None = None, lora_int_id: int = 0) -> bytes:
    """sha256 of one block: the parent's hash (or the root, the salt and the adapter id; 0
    for the base model), then the token ids."""
    digest = hashlib.sha256()
    if parent_hash is None:
        salt = b"" if cache_salt is None else b"\x01" + cache_salt.encode("utf-8")
        adapter = b"" if not lora_int_id else struct.pack("<q", lora_int_id)
        digest.update(_ROOT + struct.pack("<I", len(salt)) + salt + adapter)
    else:
        digest.update(_CHILD + parent_hash)
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return digest.digest()


@dataclass
class PrefixCacheStats:
    """Counted once per request, at its first admission (a re-admission after preemption
    that re-hits its own blocks is no hit)."""

    num_queries: int = 0  # tokens looked up
    num_hits: int = 0  # of those, tokens found cached

    def record(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        self.num_queries += num_queried_tokens
        self.num_hits += num_hit_tokens


class PrefixCache:
    """Hash <-> block id for computed full blocks, and the LRU order of the free ones."""

    def __init__(self) -> None:
        self._block_by_hash: dict[bytes, int] = {}
        self._hash_by_block: dict[int, bytes] = {}
        # Cached blocks no table holds, least recently used first (the next to evict).
        self._evictable: OrderedDict[int, None] = OrderedDict()

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with a hash, held or free."""
        return len(self._hash_by_block)

    def get(self, block_hash: bytes) -> int | None:
        return self._block_by_hash.get(block_hash)

    def hash_of(self, block_id: int) -> bytes | None:
        return self._hash_by_block.get(block_id)

    def is_evictable(self, block_id: int) -> bool:
        return block_id in self._evictable

    def register(self, block_id: int, block_hash: bytes) -> bool:
        """Give a held block its hash. Returns False, changing nothing, when the block already
        has a hash or another block already holds this one (the first keeps it)."""
        if block_id in self._hash_by_block or block_hash in self._block_by_hash:
            return False
        self._block_by_hash[block_hash] = block_id
        self._hash_by_block[block_id] = block_hash
        return True

    def take(self, block_id: int) -> None:
        """A cached free block gets a holder again: it leaves the LRU."""
        del self._evictable[block_id]

    def release(self, block_id: int) -> None:
        """A cached block lost its last holder: it becomes the most recently used free block."""
        if block_id not in self._hash_by_block:
            raise ValueError(f"block {block_id} has no hash to keep")
        self._evictable[block_id] = None

    def evict(self) -> int:
        """Take the least recently used free block and forget its hash; KeyError when none."""
        block_id, _ = self._evictable.popitem(last=False)
        del self._block_by_hash[self._hash_by_block.pop(block_id)]
        return block_id

    def clear(self) -> list[int]:
        """Forget every hash (held blocks simply stop being shareable). Returns the free
        blocks that were cached, least recently used first: they are plain free blocks now."""
        freed = list(self._evictable)
        self._evictable.clear()
        self._block_by_hash.clear()
        self._hash_by_block.clear()
        return freed

    def check_integrity(self, ref_counts: Sequence[int]) -> None:
        """Raise AssertionError unless the two maps are inverse and the LRU holds exactly the
        cached blocks with reference count 0."""
        if len(self._block_by_hash) != len(self._hash_by_block):
            raise AssertionError("hash -> block and block -> hash maps differ in size")
        for block_hash, block_id in self._block_by_hash.items():
            if self._hash_by_block.get(block_id) != block_hash:
                raise AssertionError(f"block {block_id}: hash maps disagree")
        for block_id in self._hash_by_block:
            if (ref_counts[block_id] == 0) != (block_id in self._evictable):
                raise AssertionError(f"cached block {block_id} has ref count "
                                     f"{ref_counts[block_id]} but is "
                                     f"{'' if block_id in self._evictable else 'not '}evictable")
        for block_id in self._evictable:
            if block_id not in self._hash_by_block:
                raise AssertionError(f"evictable block {block_id} has no hash")

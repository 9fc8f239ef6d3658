"""KV cache blocks: an allocator with reference counts and automatic prefix caching.

A block holds `block_size` tokens of K/V for every layer. A full block is identified by the hash
of its tokens and of everything before it, so two requests with the same prefix share blocks. The
hash is SHA-256 over the parent block's hash, the extra keys (what else the K/V depend on: the LoRA
adapter) and the tokens, as vLLM's `sha256` prefix-caching hash: a hit is taken without comparing
tokens, so the hash must be collision resistant (with a 64-bit hash, colliding blocks can be found
in seconds, and a prompt would be served another's K/V).
Freed blocks keep their contents and hash in an LRU free list: they can be revived by a later
request with the same prefix until the allocator needs them for something else.

Block 0 is never handed out: it stays zero and is where padded attention positions point, so the
rest of the cache can be left uninitialised (no time spent zeroing gigabytes at start-up).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

BlockHash = bytes
# The parent of a sequence's first block.
ROOT_HASH: BlockHash = hashlib.sha256(b"tokenmill prefix cache").digest()


def block_hash(parent: BlockHash | None, tokens: Sequence[int], extra: bytes = b"") -> BlockHash:
    """SHA-256 of (parent hash, extra keys, tokens), serialized without ambiguity: the parent's 32
    bytes, the extra keys' length and bytes, then the tokens as 64-bit integers."""
    data = (parent or ROOT_HASH) + len(extra).to_bytes(4, "little") + extra + array("q", tokens).tobytes()
    return hashlib.sha256(data).digest()


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError("the KV cache budget holds no block: raise --kv-cache-memory")
        self.num_blocks = num_blocks - 1  # usable blocks; block 0 is the zero block
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks
        # Unreferenced blocks, least recently freed first; values unused.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self.cached: dict[BlockHash, int] = {}  # hash -> block id
        self.fresh: list[int] = []  # allocated since the last step: the cache zeroes them
        self.stats = PrefixCacheStats()

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def allocate(self) -> int:
        block, _ = self.free.popitem(last=False)
        old = self.block_hashes[block]
        if old is not None:  # evict: its old contents are about to be overwritten
            if self.cached.get(old) == block:
                del self.cached[old]
            self.block_hashes[block] = None
        self.ref_counts[block] = 1
        self.fresh.append(block)
        return block

    def take_fresh(self) -> list[int]:
        fresh, self.fresh = self.fresh, []
        return fresh

    def release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free[block] = None

    def lookup(self, h: BlockHash) -> int | None:
        """Take a reference on the cached block with hash `h`, if any."""
        block = self.cached.get(h)
        if block is None:
            return None
        if self.ref_counts[block] == 0:
            del self.free[block]
        self.ref_counts[block] += 1
        return block

    def register(self, block: int, h: BlockHash) -> None:
        """Record that `block` now holds the full block with hash `h`."""
        if not self.enable_prefix_caching:
            return
        self.block_hashes[block] = h
        self.cached.setdefault(h, block)

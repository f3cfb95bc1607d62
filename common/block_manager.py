"""Paged KV blocks: allocation, reference counts, and the prefix cache.

Full blocks are content-addressed by ``common.hashing``'s chained hash. A block whose reference count drops to
zero goes to the free LRU but keeps its hash, so a later request with the same prefix can take it back; it loses
the hash only when the allocator reuses it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from itertools import islice

import numpy as np

from common.hashing import ROOT_HASH, HashKeys, iter_block_hashes
from common.sequence import Sequence


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    tokens: bytes | None = None  # its ids as the bytes its hash covers (``iter_block_hashes``), to confirm a hit


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which served from the cache


# With find_runs, an allocation of RUN_MIN_BLOCKS or more looks for contiguous runs among the run_window × need
# least recently freed blocks (docs/performance-notes.md, "KV blocks in runs").
RUN_MIN_BLOCKS = 4


class NoFreeBlocksError(RuntimeError):
    """Raised by ``allocate`` when the pool cannot cover the request (callers check ``can_allocate`` first)."""


class BlockManager:
    """Owns the block pool. Not thread-safe: only the engine loop calls it."""

    def __init__(self, num_blocks: int, block_size: int, model_id: str, enable_prefix_caching: bool = True,
                 run_window: int = 8) -> None:
        if num_blocks <= 0:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.model_id = model_id
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._by_hash: dict[int, int] = {}
        self.stats = PrefixCacheStats()
        # KV events for the router: (stored?, hash), drained by the worker's load reports
        self._events: list[tuple[bool, int]] = []
        self.track_events = False
        # set where blocks travel over NIXL (a prefill worker; a decode worker once it pulls): allocations then
        # look for contiguous runs (_take_free)
        self.find_runs = False
        self.run_window = run_window

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def cached_block_hashes(self) -> set[int]:
        return set(self._by_hash)

    def drain_events(self) -> tuple[list[int], list[int]]:
        """Block hashes stored in and removed from the prefix cache since the last call."""
        ev, self._events = self._events, []
        return [h for stored, h in ev if stored], [h for stored, h in ev if not stored]

    # -- prefix cache ----------------------------------------------------------------------------------
    def _keys(self, seq: Sequence) -> HashKeys:
        return HashKeys(self.model_id, cache_salt=seq.cache_salt)

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of ``seq``'s tokens, leaving ≥ 1 token to compute. The blocks
        are hashed in one pass up to the first miss."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        if max_blocks <= 0:
            return []
        hit: list[int] = []
        by_hash, blocks = self._by_hash, self.blocks
        for h, toks in iter_block_hashes(ROOT_HASH, seq.tokens_range(0, max_blocks * bs), bs, self._keys(seq)):
            bid = by_hash.get(h)
            if bid is None or blocks[bid].tokens != toks:
                break
            hit.append(bid)
        return hit

    def admit(self, seq: Sequence, hit: list[int] | None = None) -> None:
        """First admission: take the cached prefix (refs++), count the lookup. ``hit``: what :meth:`match_prefix`
        just returned for ``seq`` (nothing has changed the cache since), so the prefix is not looked up twice."""
        if hit is None:
            hit = self.match_prefix(seq)
        for bid in hit:
            self._take(bid)
        seq.block_ids = list(hit)
        seq.block_hashes = []
        for b in hit:
            h = self.blocks[b].hash
            assert h is not None  # a prefix hit is a block found by its hash
            seq.block_hashes.append(h)
        seq.num_computed_tokens = len(hit) * self.block_size
        if not seq.admitted:
            self.stats.queries += seq.num_prompt_tokens
            self.stats.hits += seq.num_computed_tokens
            seq.num_cached_tokens = seq.num_computed_tokens
            seq.admitted = True

    def num_new_blocks(self, seq: Sequence, num_tokens_after: int, hit_blocks: int = 0) -> int:
        return max(0, self.blocks_needed(num_tokens_after) - max(len(seq.block_ids), hit_blocks))

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def _take(self, bid: int) -> None:
        b = self.blocks[bid]
        if b.ref_count == 0:
            del self._free[bid]
        b.ref_count += 1

    def _take_free(self, need: int) -> list[int]:
        """``need`` free blocks in ascending order, taken off the free list: the least recently freed. With
        ``find_runs`` and ``RUN_MIN_BLOCKS`` or more: the fewest contiguous runs found among the ``run_window ×
        need`` least recently freed (the shortest run that holds them all, else the longest runs first), so a KV
        transfer of them is few descriptors (common/kv_transfer.py) however fragmented decoding has left the free
        list."""
        window = min(len(self._free), need * self.run_window)
        if not self.find_runs or need < RUN_MIN_BLOCKS or window <= need:
            return sorted(self._free.popitem(last=False)[0] for _ in range(need))
        ids = np.fromiter(islice(self._free, window), dtype=np.int64, count=window)
        ids.sort()
        starts = np.flatnonzero(np.diff(ids, prepend=ids[0] - 2) != 1)
        lengths = np.diff(starts, append=window)
        fits = np.flatnonzero(lengths >= need)
        if fits.size:
            first = starts[fits[np.argmin(lengths[fits])]]
            taken = ids[first : first + need]
        else:
            parts, left = [], need
            for r in np.argsort(-lengths, kind="stable"):
                k = min(int(lengths[r]), left)
                parts.append(ids[starts[r] : starts[r] + k])
                left -= k
                if not left:
                    break
            taken = np.sort(np.concatenate(parts))
        out = taken.tolist()
        for bid in out:
            del self._free[bid]
        return out

    def allocate(self, seq: Sequence, num_tokens_after: int) -> None:
        """Grow ``seq``'s block table to hold ``num_tokens_after`` tokens. The blocks taken in one call go into the
        table in ascending id order and in as few runs as :meth:`_take_free` finds: neighbours in the table are then
        neighbours in the pool, and a KV transfer posts each such run as one descriptor (common/kv_transfer.py)."""
        need = self.blocks_needed(num_tokens_after) - len(seq.block_ids)
        if need > len(self._free):
            raise NoFreeBlocksError(f"need {need} blocks, {len(self._free)} free")
        taken = self._take_free(need) if need > 0 else []
        for bid in taken:
            b = self.blocks[bid]
            if b.hash is not None:
                if self._by_hash.get(b.hash) == bid:
                    del self._by_hash[b.hash]
                    if self.track_events:
                        self._events.append((False, b.hash))
                b.hash = None
                b.tokens = None
            b.ref_count = 1
            seq.block_ids.append(bid)

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Register the hashes of blocks that became full with computed tokens."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = seq.num_computed_tokens // bs
        if len(seq.block_hashes) >= full:  # most steps: a decode's token fills no block
            return
        start = len(seq.block_hashes)
        parent = seq.block_hashes[-1] if seq.block_hashes else ROOT_HASH
        toks = seq.tokens_range(start * bs, full * bs)
        for k, (h, data) in enumerate(iter_block_hashes(parent, toks, bs, self._keys(seq))):
            seq.block_hashes.append(h)
            b = self.blocks[seq.block_ids[start + k]]
            if h not in self._by_hash:
                self._by_hash[h] = b.block_id
                b.hash = h
                b.tokens = data
                if self.track_events:
                    self._events.append((True, h))

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; tail blocks are freed first so they are reused first."""
        for bid in reversed(seq.block_ids):
            b = self.blocks[bid]
            b.ref_count -= 1
            if b.ref_count == 0:
                self._free[bid] = None
        seq.block_ids = []
        seq.block_hashes = []

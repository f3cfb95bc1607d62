"""Content addresses of full KV blocks: a chained hash shared by the engine and the router.

A block's hash is a 64-bit integer from blake2b over the parent block's hash, the block's token ids and the extra
keys (model id, adapter, cache salt): ``iter_block_hashes``. Chaining makes a block's address depend on the whole
prefix before it, so equal hashes mean equal prefixes (confirmed by comparing tokens on a hit).
The router calls ``prefix_block_hashes`` on the same ids with the same keys, so its overlap counts are exact.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cache

ROOT_HASH = 0
_PARENT = struct.Struct("<Q")


@cache
def _block_struct(block_size: int) -> struct.Struct:
    """A block's token ids as the bytes its hash covers: ``block_size`` little-endian int64."""
    return struct.Struct(f"<{block_size}q")


@dataclass(frozen=True, slots=True)
class HashKeys:
    """What besides the tokens decides whether two blocks hold the same KV."""

    model_id: str
    adapter: str = ""
    cache_salt: str = ""

    def encode(self) -> bytes:
        return f"{self.model_id}\x00{self.adapter}\x00{self.cache_salt}".encode()


def iter_block_hashes(parent: int, tokens: Sequence[int], block_size: int,
                      keys: HashKeys) -> Iterator[tuple[int, bytes]]:
    """``(hash, tokens)`` of each full block of ``tokens`` in order (a trailing partial block has none), the first
    one's parent ``parent``; a block's tokens as the little-endian int64 bytes its hash covers, which the prefix
    cache keeps to confirm a hit. Lazy, so a lookup that misses early hashes no more blocks; the keys are encoded
    once for all the blocks."""
    kb = keys.encode()
    pack = _block_struct(block_size).pack
    for i in range(len(tokens) // block_size):
        data = pack(*tokens[i * block_size : (i + 1) * block_size])
        h = hashlib.blake2b(_PARENT.pack(parent), digest_size=8)
        h.update(data)
        h.update(kb)
        parent = int.from_bytes(h.digest(), "little")
        yield parent, data


def prefix_block_hashes(tokens: Sequence[int], block_size: int, keys: HashKeys) -> list[int]:
    """Hashes of every full block of ``tokens`` (a trailing partial block has none)."""
    return [h for h, _ in iter_block_hashes(ROOT_HASH, tokens, block_size, keys)]

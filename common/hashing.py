"""Content addresses of full KV blocks: a chained hash shared by the engine and the router.

``block_hash(parent, tokens, extra)`` is a 64-bit integer from blake2b over the parent's hash, the block's token
ids and the extra keys (model id, adapter, cache salt). Chaining makes a block's address depend on the whole
prefix before it, so equal hashes mean equal prefixes (confirmed by comparing tokens on a hit).
The router calls ``prefix_block_hashes`` on the same ids with the same keys, so its overlap counts are exact.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

ROOT_HASH = 0


@dataclass(frozen=True, slots=True)
class HashKeys:
    """What besides the tokens decides whether two blocks hold the same KV."""

    model_id: str
    adapter: str = ""
    cache_salt: str = ""

    def encode(self) -> bytes:
        return f"{self.model_id}\x00{self.adapter}\x00{self.cache_salt}".encode()


def block_hash(parent: int, tokens: Sequence[int], keys: HashKeys) -> int:
    """Hash of one full block given its parent block's hash (``ROOT_HASH`` for the first block)."""
    return chain_block_hashes(parent, tokens, len(tokens), keys)[0]


def chain_block_hashes(parent: int, tokens: Sequence[int], block_size: int, keys: HashKeys) -> list[int]:
    """Hashes of every full block of ``tokens`` (a trailing partial block has none), the first one's parent
    ``parent``. The tokens are converted once and the keys encoded once for all the blocks: a pulled 1,024-token
    prompt commits its 64 blocks in one call on the decode worker's engine thread."""
    out: list[int] = []
    arr = np.asarray(tokens, dtype=np.int64)
    kb = keys.encode()
    for i in range(len(arr) // block_size):
        h = hashlib.blake2b(digest_size=8)
        h.update(struct.pack("<Q", parent))
        h.update(arr[i * block_size : (i + 1) * block_size].tobytes())
        h.update(kb)
        parent = int.from_bytes(h.digest(), "little")
        out.append(parent)
    return out


def prefix_block_hashes(tokens: Sequence[int], block_size: int, keys: HashKeys) -> list[int]:
    """Hashes of every full block of ``tokens`` (a trailing partial block has none)."""
    return chain_block_hashes(ROOT_HASH, tokens, block_size, keys)

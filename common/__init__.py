"""Tokenmill's shared library: model runtime, paged KV cache, scheduler, sampling, hashing.

Nothing here imports ``services``: services wrap this library, never the reverse.
"""

import os

# torch's CPU allocator backs buffers of 2 MiB and more with transparent huge pages when THP_MEM_ALLOC_ENABLE=1
# (madvise; the kernel's THP mode must allow it): the weights, oneDNN's packed copies and the KV pool. Decoding reads
# all of them every step, and 4 KiB pages cost TLB misses: the engine closed loop at 32 in flight measured
# 502 -> 542 tok/s with it on a 2-core VM (bfloat16). c10 reads the variable once, at its first allocation, so it is
# set here, before the engine allocates anything; worker processes inherit it. Set it to 0 to keep small pages.
THP_SET_BY_USER = "THP_MEM_ALLOC_ENABLE" in os.environ
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

"""CPU kernels compiled on first use (``torch.utils.cpp_extension``; needs a C++ compiler, cached afterwards).

``paged_decode_attention`` reads K/V straight from the paged pool instead of gathering them into a padded copy;
``add_rms_norm`` fuses the residual add with the next RMSNorm, ``rope_write_kv`` RoPE with the KV-cache write and
``silu_mul`` the MLP's activation with its product (bfloat16 or float32, rounding as the ops they replace);
``argmax_rows`` is the greedy pick and ``pick_rows`` the sampled one over whole rows (temperature, top-p, min-p,
no sort); ``linear_small_batch`` is the bfloat16 matmul of decode batches (up to 32 rows) and
``prefill_attention`` a prompt's causal attention, both on torch's AMX brgemm micro-kernel. All in
csrc/paged_attention_cpu.cpp.
The engine uses them on CPU, in bfloat16 and float32, when they compiled with AVX-512 (``engine.cpu_kernels``
false turns them off, true on even without AVX-512; see common/model_runner.py and common/model_cpu.py). If the
compiler is missing, ``available()`` is False and the model keeps the portable PyTorch path.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
_SRC = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"
# no implicit fused multiply-adds: the fused stages round as torch's separate ops do
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]
_lock = threading.Lock()
_module: Any = None
_failed = False


def _load() -> Any:
    global _module, _failed
    if _module is not None:  # every kernel call comes here: no lock once it is loaded
        return _module
    with _lock:
        if _module is not None or _failed:
            return _module
        if os.environ.get("TOKENMILL_NO_CPU_KERNELS"):
            _failed = True
            return None
        try:
            _module = _build()
        except Exception as e:  # no compiler, no headers: the portable path still works
            log.warning("CPU kernels unavailable (%s); using the portable attention path", e)
            _failed = True
        return _module


def build_dir() -> Path:
    """The build directory of this source with these flags: another version of the source (another checkout, an
    upgrade) builds in its own and never waits on or overwrites this one."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    digest = hashlib.sha256(_SRC.read_bytes() + " ".join(_CFLAGS).encode()).hexdigest()[:16]
    return root / f"tokenmill_cpu_kernels-{digest}"


def _build() -> Any:
    """Compile (or load the cached build). torch's own build lock is a file that a process killed mid-build leaves
    behind, and every later load waits on it forever; so builds are serialized here by an flock, which the kernel
    releases when its holder dies, and a torch lock found while holding it is stale and removed."""
    from torch.utils.cpp_extension import load

    d = build_dir()
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "tokenmill.flock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        stale = d / "lock"
        if stale.exists():
            log.warning("removing %s, left by a build that did not finish", stale)
            stale.unlink()
        if not any(d.glob("*.so")):
            log.info("compiling the CPU kernels (first use of this version only; cached in %s)", d)
        return load(name="tokenmill_cpu_kernels", sources=[str(_SRC)], extra_cflags=_CFLAGS,
                    extra_ldflags=["-fopenmp"], build_directory=str(d), verbose=False)


def available() -> bool:
    return _load() is not None


def vectorized() -> bool:
    """Compiled with the AVX-512 path (the scalar one is slower than the portable PyTorch path)."""
    return available() and bool(getattr(_module, "vectorized", False))


def paged_decode_attention(q: Any, cache: Any, layer: int, tables: Any, ctx_lens: Any, scale: float) -> Any:
    return _load().paged_decode_attention(q, cache, layer, tables, ctx_lens, scale)


def add_rms_norm(x: Any, delta: Any, weight: Any, eps: float) -> Any:
    """``x += delta`` in place (``delta`` may be None), then RMSNorm(x) * weight; ``[T, H]`` rows (bf16/fp32)."""
    return _load().add_rms_norm(x, delta, weight, eps)


def rope_write_kv(qkv: Any, positions: Any, cos: Any, sin: Any, cache: Any, rows: Any, k_off: int, v_off: int,
                  heads: int, kv_heads: int) -> None:
    """RoPE on the q/k heads of a fused ``[T, (H + 2 KVH) * D]`` projection in place, then its K and V
    rows into ``cache`` (viewed as ``[-1, KVH, D]``) at ``rows + k_off`` / ``rows + v_off``."""
    _load().rope_write_kv(qkv, positions, cos, sin, cache, rows, k_off, v_off, heads, kv_heads)


def silu_mul(gate_up: Any) -> Any:
    """``silu(gate) * up`` of a fused ``[T, 2I]`` projection → ``[T, I]``."""
    return _load().silu_mul(gate_up)


def argmax_rows(x: Any) -> Any:
    """Per-row argmax of ``[N, V]`` bfloat16/float32 logits (first index on ties, as ``torch.argmax``)."""
    return _load().argmax_rows(x)


def masked_argmax_rows(x: Any, rows: Any, bitmask: Any) -> Any:
    """Per-row argmax of ``x[rows]`` (``[N, V]`` bfloat16/float32 logits; ``rows`` int64 ``[M]``) over the entries
    whose bit is set in ``bitmask`` (int32 ``[M, ceil(V / 32)]``, bit ``t % 32`` of word ``t / 32``): the first
    largest allowed entry; the first allowed one where all of them are -inf; 0 where none is allowed."""
    return _load().masked_argmax_rows(x, rows, bitmask)


def pick_rows(x: Any, prm: Any, temp_col: int, topp_col: int, minp_col: int, u_col: int, top_p: bool,
              min_p: bool) -> Any:
    """The sampler's pick over each row's whole vocabulary, as ``triton_ops.pick_full``: ``x`` ``[N, V]`` float32
    logits (not modified; rows may be strided), ``prm`` ``[N, C]`` float32 with each row's temperature, top-p, min-p
    and uniform number ``u`` in ``[0, 1)`` at the given columns; ``top_p``/``min_p``: whether any row uses them.
    Per row: z = x / temperature, w = exp(z - max z); top-p keeps the tokens whose order key (z's bits, ordered as z)
    is at least the largest threshold whose tokens' mass reaches top_p × the total (all tokens tied with it); min-p
    those with w ≥ min_p; the pick is the first token, in vocabulary order, whose running kept mass exceeds u × the
    kept mass. A row with no finite logit gets 0. int64 ``[N]``."""
    return _load().pick_rows(x, prm, temp_col, topp_col, minp_col, u_col, top_p, min_p)


def amx_bf16() -> bool:
    """Whether torch's brgemm micro-kernel runs bfloat16 on AMX here (what ``linear_small_batch`` needs)."""
    return vectorized() and bool(_module.amx_bf16())


def pack_small_batch(w: Any) -> Any:
    """A ``[N, K]`` bfloat16 weight (N and K multiples of 32) in ``linear_small_batch``'s layout."""
    return _load().pack_small_batch(w)


def linear_small_batch(x: Any, packed: Any, bias: Any = None) -> Any:
    """``x @ w.T (+ bias)`` for ``[M, K]`` bfloat16 rows and ``packed = pack_small_batch(w)``: oneDNN's result bit
    for bit, without its fixed cost per call (~17 us), which dominates a decode batch's small matmuls."""
    return _load().linear_small_batch(x, packed, bias)


def prefill_attention(q: Any, k: Any, v: Any, scale: float) -> Any:
    """Causal self-attention of one prompt (no cached prefix): ``q [S, H, D]``, ``k``/``v [S, KVH, D]`` bfloat16
    (rows may be strided, each row's heads contiguous) → ``[S, H, D]``. Needs ``amx_bf16()``."""
    return _load().prefill_attention(q, k, v, scale)

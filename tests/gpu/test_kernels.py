"""The Triton kernels of the CUDA fast path (common/triton_ops.py) against float64 / portable references on fresh
random inputs, outputs poisoned with NaN first where the kernel writes into a given buffer: paged decode attention
(batches 1/7/64, contexts to 2,000, flash-decoding splits, a padding row), paged prompt attention over tiles
(causal, after a cached prefix, rows outside the tiles untouched), RoPE + KV write, residual add + RMSNorm,
SiLU·mul, the batch-1 GEMV (and the down projection with SiLU·mul fused into it), split-K GEMM and its partials
summed by the norm kernel, and the grammar masks' argmax and -inf fill.

Every check takes its device: the tests run them on CUDA; on a CPU they run under Triton's interpreter
(``TRITON_INTERPRET=1``) with a smaller KV pool (``nb``).
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.gpu

# (dtype, heads, kv heads, head dim, relative tolerance): Llama-3.1-8B's heads in bfloat16, SmolLM2's in float32
CONFIGS = {
    "bf16-llama8b": (torch.bfloat16, 32, 8, 128, 1e-2),
    "fp32-smollm2": (torch.float32, 9, 3, 64, 1e-5),
}
DECODE_CASES = [(1, 128, 0), (1, 2000, 0), (7, 600, 1), (7, 600, 3), (64, 1024, 0), (64, 1024, 2)]  # batch, ctx, splits
GEMV_SHAPES = [(6144, 4096), (4096, 14336), (1000, 576)]
LAYERS, BS = 4, 16


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN when ``out`` holds a NaN (an element the kernel never wrote)."""
    if torch.isnan(out).any():
        return float("nan")
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str) -> None:
    err = rel_err(out, ref)
    assert err < tol, f"{what}: relative error {err:.3e} (tolerance {tol:.0e}; nan: elements left unwritten)"


def _gen(device: str, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _randn(*shape: int, g: torch.Generator, dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.randn(*shape, device=device, generator=g).to(dtype)


def ref_decode(q: torch.Tensor, cache: torch.Tensor, layer: int, tables: torch.Tensor, ctx: torch.Tensor
               ) -> torch.Tensor:
    """Decode attention in float64, one sequence at a time from the paged pool; a context of 0 gives zeros."""
    b_, h, d = q.shape
    bs, kvh = cache.shape[3], cache.shape[4]
    outs = []
    for b in range(b_):
        c = int(ctx[b])
        if c == 0:
            outs.append(torch.zeros(h, d, dtype=torch.float64, device=q.device))
            continue
        blocks = tables[b, : -(-c // bs)].long()
        k = cache[blocks, layer, 0].reshape(-1, kvh, d)[:c].double().repeat_interleave(h // kvh, 1)
        v = cache[blocks, layer, 1].reshape(-1, kvh, d)[:c].double().repeat_interleave(h // kvh, 1)
        sc = torch.einsum("hd,nhd->hn", q[b].double(), k) / math.sqrt(d)
        outs.append(torch.einsum("hn,nhd->hd", sc.softmax(-1), v))
    return torch.stack(outs)


def check_decode_attention(device: str, config: str, batch: int, max_ctx: int, splits: int, nb: int = 3000,
                           row_map: bool = False) -> None:
    """``row_map``: the rows share three block tables (``table_rows``), as a CUDA graph's prompt rows share their
    sequence's."""
    from common import triton_ops as tk

    dtype, h, kvh, d, tol = CONFIGS[config]
    g = _gen(device, 1000 * batch + max_ctx + splits)
    cache = _randn(nb, LAYERS, 2, BS, kvh, d, g=g, dtype=dtype, device=device)
    w = -(-max_ctx // BS)
    tables = torch.stack([torch.randperm(nb, device=device, generator=g)[:w] for _ in range(batch)]).int()
    ctx = torch.randint(1, max_ctx + 1, (batch,), device=device, generator=g).int()
    ctx[0] = max_ctx
    if batch > 1:
        ctx[-1] = 0  # a padding row: its output must be zeros
    qkv = _randn(batch, (h + 2 * kvh) * d, g=g, dtype=dtype, device=device)
    q = qkv[:, : h * d].view(batch, h, d)  # strided rows, as the forward passes them
    out = torch.full((batch, h, d), float("nan"), dtype=dtype, device=device)
    rows = None
    if row_map:
        rows = torch.randint(0, 3, (batch,), device=device, generator=g).int()
        tables, per_row = tables[:3].contiguous(), tables[:3][rows.long()]
    tk.paged_decode_attention(q, cache, 2, tables, ctx, d**-0.5, out, num_splits=splits, table_rows=rows)
    assert_close(out, ref_decode(q, cache, 2, per_row if row_map else tables, ctx), tol,
                 f"paged decode attention {config} batch {batch} context ≤{max_ctx} splits {splits} map {row_map}")


def check_prompt_attention(device: str, config: str, nb: int = 3000) -> None:
    """The paged prompt kernel over tiles of three chunks (one from position 0, one after a cached prefix, one of a
    single token) beside rows it must not touch (decode rows, padding), against causal float64 attention."""
    from common import triton_ops as tk
    from common.cuda_graphs import prompt_tile_rows

    dtype, h, kvh, d, tol = CONFIGS[config]
    g = _gen(device, 7)
    cache = _randn(nb, LAYERS, 2, BS, kvh, d, g=g, dtype=dtype, device=device)
    tq = prompt_tile_rows(h // kvh)
    chunks = [(0, 70), (500, 37), (129, 1)]  # (first position, tokens)
    w = -(-600 // BS)
    tables = torch.stack([torch.randperm(nb, device=device, generator=g)[:w] for _ in range(4)]).int()
    skip = 3  # rows 0..2: decode rows the kernel leaves alone
    rows = skip + sum(n for _, n in chunks) + 2  # two padding rows at the end
    pos = torch.zeros(rows, dtype=torch.int32, device=device)
    trow = torch.zeros(rows, dtype=torch.int32, device=device)
    tile0, tilen = [], []
    r = skip
    for ci, (p0, n) in enumerate(chunks):
        pos[r : r + n] = torch.arange(p0, p0 + n, dtype=torch.int32, device=device)
        trow[r : r + n] = ci + 1
        for a in range(0, n, tq):
            tile0.append(r + a)
            tilen.append(min(tq, n - a))
        r += n
    tiles = torch.zeros(2, len(tile0) + 3, dtype=torch.int32, device=device)  # 3 unused tiles: count 0
    tiles[0, : len(tile0)] = torch.tensor(tile0, dtype=torch.int32)
    tiles[1, : len(tile0)] = torch.tensor(tilen, dtype=torch.int32)
    qkv = _randn(rows, (h + 2 * kvh) * d, g=g, dtype=dtype, device=device)
    q = qkv[:, : h * d].view(rows, h, d)
    out = torch.full((rows, h, d), float("nan"), dtype=dtype, device=device)
    tk.paged_prompt_attention(q, cache, 2, tables, trow, pos, tiles, d**-0.5, out)
    # each prompt row is a decode row over its context up to itself
    ref = ref_decode(q[skip : r], cache, 2, tables[trow[skip:r].long()], pos[skip:r] + 1)
    assert_close(out[skip:r], ref, tol, f"paged prompt attention ({config}, tiles of {tq})")
    assert torch.isnan(out[:skip]).all() and torch.isnan(out[r:]).all(), \
        f"the prompt kernel wrote rows outside its tiles ({config})"


def check_rope_kv_write(device: str, config: str, nb: int = 3000) -> None:
    from common import triton_ops as tk
    from common.model import apply_rope

    dtype, h, kvh, d, tol = CONFIGS[config]
    g = _gen(device, 2)
    t, maxpos = 300, 4096
    inv = 1.0 / (500000 ** (torch.arange(0, d, 2, device=device).float() / d))
    fr = torch.outer(torch.arange(maxpos, device=device).float(), inv)
    emb = torch.cat((fr, fr), -1)
    cos, sin = emb.cos(), emb.sin()
    qkv = _randn(t, (h + 2 * kvh) * d, g=g, dtype=dtype, device=device)
    orig = qkv.clone()
    pos = torch.randint(0, maxpos, (t,), device=device, generator=g)
    slots = torch.randperm(nb * BS, device=device, generator=g)[:t]
    blocks, offs = slots // BS, slots % BS
    rows = blocks * (LAYERS * 2 * BS) + offs  # layer-0 K rows
    rows[5] = -1  # a padding row: nothing written
    cache = torch.full((nb, LAYERS, 2, BS, kvh, d), float("nan"), dtype=dtype, device=device)
    tk.rope_kv_write(qkv, pos, rows, cos, sin, cache, 1, h, kvh, d)
    ref = apply_rope(orig[:, : (h + kvh) * d].double().view(t, h + kvh, d), cos[pos].unsqueeze(1).double(),
                     sin[pos].unsqueeze(1).double())
    keep = torch.arange(t, device=device) != 5
    assert_close(qkv[:, : (h + kvh) * d].view(t, h + kvh, d), ref, tol, f"RoPE of Q and K in place ({config})")
    assert_close(cache[blocks[keep], 1, 0, offs[keep]], ref[keep, h:], tol, f"K written to the pool ({config})")
    v_written = cache[blocks[keep], 1, 1, offs[keep]]
    assert torch.equal(v_written, orig[keep, (h + kvh) * d :].view(-1, kvh, d)), f"V not copied exactly ({config})"
    assert torch.isnan(cache[blocks[5], 1, :, offs[5]]).all(), f"the padding row (slot -1) was written ({config})"
    written = torch.zeros(nb, BS, dtype=torch.bool, device=device)
    written[blocks[keep], offs[keep]] = True
    other = cache[:, 1].transpose(1, 2)[~written]  # [slots, 2 (k/v), kvh, d] of layer 1 that no row targets
    assert torch.isnan(other).all() and torch.isnan(cache[:, [0, 2, 3]]).all(), \
        f"the kernel wrote outside its target slots / layer ({config})"


def check_add_rms_norm(device: str, config: str) -> None:
    from common import triton_ops as tk
    from common.model import rms_norm

    dtype, h, _kvh, d, tol = CONFIGS[config]
    g = _gen(device, 3)
    t, n = 300, h * d
    x = _randn(t, n, g=g, dtype=dtype, device=device)
    delta = _randn(t, n, g=g, dtype=dtype, device=device)
    wt = _randn(n, g=g, dtype=dtype, device=device)
    x0 = x.clone()
    out = tk.add_rms_norm(x, delta, wt, 1e-5)
    xr = x0 + delta
    assert_close(x, xr, tol, f"residual add in place ({config})")
    assert_close(out, rms_norm(xr, wt, 1e-5), tol, f"RMSNorm of the sum ({config})")
    # without a delta: the norm alone, x untouched
    x1 = x.clone()
    assert_close(tk.add_rms_norm(x, None, wt, 1e-5), rms_norm(x1, wt, 1e-5), tol, f"RMSNorm alone ({config})")
    assert torch.equal(x, x1), f"add_rms_norm without a delta changed x ({config})"


def check_silu_mul(device: str, config: str) -> None:
    from common import triton_ops as tk

    dtype, _h, _kvh, _d, tol = CONFIGS[config]
    g = _gen(device, 4)
    gu = _randn(300, 2 * 1536, g=g, dtype=dtype, device=device)
    gate, up = gu.chunk(2, -1)
    assert_close(tk.silu_mul(gu), torch.nn.functional.silu(gate) * up, tol, f"SiLU·mul ({config})")


def check_gemv_and_splitk(device: str, n: int, k: int) -> None:
    """bfloat16, as the fast path uses them: the batch-1 GEMV (with a bias; and with SiLU·mul fused into its input
    for the down projection), and where K allows, split-K GEMM at 5/16/64 rows, alone and summed by the norm."""
    from common import triton_ops as tk
    from common.model import rms_norm

    bf, tol = torch.bfloat16, 1e-2
    g = _gen(device, n + k)
    w = _randn(n, k, g=g, dtype=bf, device=device)
    x = _randn(1, k, g=g, dtype=bf, device=device)
    bias = _randn(n, g=g, dtype=bf, device=device)
    ref = torch.nn.functional.linear(x.double(), w.double(), bias.double())
    assert_close(tk.gemv(x, w, bias), ref, tol, f"GEMV {n}x{k}")
    gu = _randn(1, 2 * k, g=g, dtype=bf, device=device)
    assert_close(tk.down_proj(gu, w), torch.nn.functional.linear(tk.silu_mul(gu).double(), w.double()), tol,
                 f"down projection with fused SiLU·mul {n}x{k}")
    cfg = tk.SPLITK_CONFIG
    if k % (cfg[1] * cfg[2]):
        return  # split-K needs K divisible into splits × BLOCK_K
    for m in (5, 16, 64):
        xm = _randn(m, k, g=g, dtype=bf, device=device)
        refm = torch.nn.functional.linear(xm.double(), w.double())
        assert_close(tk.splitk_mm(xm, w, cfg).sum(0), refm, tol, f"split-K {m}x{n}x{k}")
        res_x = _randn(m, n, g=g, dtype=bf, device=device)
        nw = _randn(n, g=g, dtype=bf, device=device)
        xr = res_x + refm.to(bf)
        hn = tk.add_rms_norm(res_x, tk.splitk_mm(xm, w, cfg), nw, 1e-5)
        assert_close(res_x, xr, tol, f"residual + split-K partials {m}x{n}x{k}")
        assert_close(hn, rms_norm(xr, nw, 1e-5), tol, f"RMSNorm of residual + split-K partials {m}x{n}x{k}")


def check_grammar_mask_kernels(device: str, dtype: torch.dtype = torch.bfloat16) -> None:
    """The grammar masks' kernels on random packed bitmasks over SmolLM2's 49,152 tokens and a Llama 3 row stride
    (logits sliced to the sampled vocabulary): the masked argmax against the argmax of -inf-filled rows (rows without
    a mask over every token; ties to the first index, across the kernel's blocks too), and the in-place -inf fill
    (allowed entries untouched, other rows untouched)."""
    import numpy as np

    from common import triton_ops as tk

    vocab, full, n = 49_152, 128_256, 7
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(n, full, generator=g).to(dtype).to(device)[:, :vocab]
    logits[5, :] = 0.0  # all equal: the first allowed token
    logits[6, 100] = logits[6, 9000] = 50.0  # a tie across two blocks: the earlier one
    words = vocab // 32
    bits = torch.rand(4, words * 32, generator=g) < 0.05
    bits[2, 100] = bits[2, 9000] = True
    packed = np.packbits(bits.numpy().astype(np.uint8), axis=1, bitorder="little").view(np.int32)
    masks = torch.from_numpy(packed.copy()).to(device)
    mask_rows = [0, -1, 1, 3, -1, 2, 2]
    got = tk.masked_argmax(logits, masks, torch.tensor(mask_rows, dtype=torch.int32, device=device)).tolist()
    want = []
    for i, m in enumerate(mask_rows):
        row = logits[i].float().cpu().clone()
        if m >= 0:
            row[~bits[m, :vocab]] = float("-inf")
        want.append(int(row.argmax()))
    assert got == want, (got, want)
    assert got[5] == int(bits[2].nonzero()[0]) and got[6] == 100
    x = torch.randn(n, vocab, generator=g).to(device)
    before = x.clone()
    tk.apply_token_bitmask_(x, masks, torch.tensor(mask_rows, dtype=torch.int32, device=device))
    for i, m in enumerate(mask_rows):
        if m < 0:
            assert torch.equal(x[i], before[i]), i
        else:
            keep = bits[m, :vocab].to(device)
            assert torch.equal(x[i][keep], before[i][keep]) and bool(torch.isneginf(x[i][~keep]).all()), i
    # the wait for the grammar mask process's answer: it passes at once when the batch is answered, and gives up
    # after its reads otherwise, flagging the batch it waited for
    answered, needed, flag = (torch.tensor([v], dtype=torch.int64, device=device) for v in (7, 7, 0))
    tk.wait_masks(answered, needed, flag, spins=100)
    assert flag.item() == 0, "a wait for an answered batch gave up"
    needed.fill_(8)
    tk.wait_masks(answered, needed, flag, spins=100)
    assert flag.item() == 8, f"a wait for a batch never answered did not flag it ({flag.item()})"
    if torch.device(device).type != "cuda":  # (the Triton interpreter on the CPU: no host memory to map)
        return
    # the sampler's way on CUDA: the masks and the rows' index in host memory that the kernels read in place
    import mmap

    from common.sampler import _Mapped

    def mapped(a: np.ndarray) -> _Mapped:  # page-aligned host memory, as the mask table's
        host = np.frombuffer(mmap.mmap(-1, a.nbytes), np.int32).reshape(a.shape)
        host[...] = a
        return _Mapped.of(host, torch.device(device))

    host_masks, host_rows = mapped(packed), mapped(np.array(mask_rows, dtype=np.int32))
    assert host_masks.tensor.device == logits.device and host_masks.tensor.data_ptr() == host_masks.host.ctypes.data
    assert tk.masked_argmax(logits, host_masks.tensor, host_rows.tensor).tolist() == want
    y = before.clone()
    tk.apply_token_bitmask_(y, host_masks.tensor, host_rows.tensor)
    assert torch.equal(y, x)
    host_rows.host[:] = -1  # written on the host, read by the next kernel
    tk.apply_token_bitmask_(y, host_masks.tensor, host_rows.tensor)
    assert torch.equal(y, x)
    assert tk.masked_argmax(logits, host_masks.tensor, host_rows.tensor).tolist() == logits.float().argmax(-1).tolist()
    # the wait on the device for a word of host memory that another thread writes later (as the mask process
    # writes its answered batch): the kernels queued behind it start once it is there, and read what was written
    # before it
    import threading
    import time

    words = mapped(np.zeros(8, dtype=np.int32))  # [answered, want, flag] as int64, then padding
    w64 = words.host.view(np.int64)
    dev64 = words.tensor.view(torch.int64)
    w64[:3] = (3, 4, 0)
    host_rows.host[:] = -1
    late_rows = [0, 1, 2, 3, 0, 1, 2]

    def answer() -> None:
        time.sleep(0.2)
        host_rows.host[:] = late_rows
        w64[0] = 4

    t = threading.Thread(target=answer)
    start = time.monotonic()
    t.start()
    tk.wait_masks(dev64[0:1], dev64[1:2], dev64[2:3])
    got = tk.masked_argmax(logits, host_masks.tensor, host_rows.tensor)
    torch.cuda.synchronize()
    waited = time.monotonic() - start
    t.join()
    assert int(w64[2]) == 0, "the wait gave up: it never saw the word the host wrote"
    assert waited >= 0.2, f"the kernels did not wait for the word ({waited:.3f} s)"
    host_rows.host[:] = late_rows
    want_late = tk.masked_argmax(logits, host_masks.tensor, host_rows.tensor).tolist()
    assert got.tolist() == want_late, "the kernel behind the wait read the rows from before the host wrote them"


def check_sampler_kernels(device: str) -> None:
    """The sampler's kernels against its portable PyTorch path on the CPU: penalties over each slot's own columns,
    the fold of picked tokens (repeated and new) into the kept tables, and the pick among top-k candidates
    (temperature, per-row top-k, top-p, min-p, the inverse CDF in vocabulary order)."""
    from common import sampler as sm
    from common import triton_ops as tk

    g = torch.Generator().manual_seed(3)
    vocab, n, width, slots_n = 5000, 24, 64, 30
    ids = torch.zeros(slots_n + 1, width, dtype=torch.long)
    counts = torch.zeros(slots_n + 1, width)
    nseen = torch.zeros(slots_n + 1, dtype=torch.long)
    for s_ in range(1, slots_n + 1):  # a slot's own columns, then its column 0 repeated with count 0
        m = int(torch.randint(0, width - 8, (1,), generator=g))
        own = torch.randperm(vocab, generator=g)[: max(m, 1)]
        ids[s_, :m], ids[s_, m:], nseen[s_] = own[:m], own[0], m
        counts[s_, :m] = torch.randint(0, 4, (m,), generator=g).float()
    prm = torch.zeros(n, len(sm._PAD_ROW))
    prm[:, sm._TEMP] = torch.rand(n, generator=g) + 0.3
    prm[:, sm._TOPK] = torch.randint(1, 41, (n,), generator=g).float()
    prm[:, sm._TOPP] = torch.rand(n, generator=g) * 0.6 + 0.4
    prm[:, sm._MINP] = torch.rand(n, generator=g) * 0.1
    prm[:, sm._REP] = torch.rand(n, generator=g) + 0.5
    prm[:, sm._PRES] = torch.randn(n, generator=g)
    prm[:, sm._FREQ] = torch.randn(n, generator=g)
    prm[:, sm._U] = torch.rand(n, generator=g) * sm._U_MAX
    prm[:, sm._SLOT] = torch.randperm(slots_n + 1, generator=g)[:n].float()  # slot 0 among them: untouched
    prm[prm[:, sm._SLOT] == 0, sm._REP] = 1.0  # as the table has it
    prm[prm[:, sm._SLOT] == 0, sm._PRES] = 0.0
    prm[prm[:, sm._SLOT] == 0, sm._FREQ] = 0.0

    class Kept:  # the portable path reads these three from a _Slots
        pass

    ref_slots, dev_slots = Kept(), Kept()
    ref_slots.ids, ref_slots.counts, ref_slots.nseen = ids.clone(), counts.clone(), nseen.clone()
    dev_slots.ids, dev_slots.counts, dev_slots.nseen = ids.to(device), counts.to(device), nseen.to(device)
    x = torch.randn(n, vocab, generator=g) * 3
    want = x.clone()
    sm._penalize(want, prm, ref_slots, width, True, True)
    got = x.to(device)
    tk.penalize_(got, prm.to(device), dev_slots.ids, dev_slots.counts, dev_slots.nseen,
                 (sm._REP, sm._PRES, sm._FREQ, sm._SLOT), True, True)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-5)

    # a picked token each: half of them one the slot has seen already
    seen_tok = ref_slots.ids.gather(1, torch.zeros(slots_n + 1, 1, dtype=torch.long)).squeeze(1)
    slot_of = prm[:, sm._SLOT].long()
    tok = torch.where(torch.arange(n) % 2 == 0, seen_tok[slot_of], torch.randint(0, vocab, (n,), generator=g))
    sm._fold(ref_slots, prm, tok, width)
    tk.fold_(tok.to(device), prm.to(device), dev_slots.ids, dev_slots.counts, dev_slots.nseen, sm._SLOT)
    live = torch.arange(1, slots_n + 1)
    for name in ("ids", "counts", "nseen"):
        assert torch.equal(getattr(dev_slots, name).cpu()[live], getattr(ref_slots, name)[live]), name
    assert torch.equal(dev_slots.nseen.cpu(), ref_slots.nseen)

    k = 40
    prm[:4, sm._TOPK] = 1.0  # a single candidate: no choice
    vals, cand = torch.topk(x, k, dim=-1)
    picks = []
    for _ in range(20):  # many uniform numbers: the picks follow the reference's bins
        prm[:, sm._U] = torch.rand(n, generator=g) * sm._U_MAX
        spec = sm._GraphKey(n, 0, False, False, False, True, k, True, True, 0)
        want_t = sm._pick(x.clone(), prm, spec, sm._Workspace(torch.device("cpu")))
        got_t = tk.pick_candidates(vals.to(device), cand.to(device), prm.to(device),
                                   (sm._TEMP, sm._TOPK, sm._TOPP, sm._MINP, sm._U), True, True).cpu()
        picks.append((got_t, want_t))
    same = sum(int((a == b).sum()) for a, b in picks)
    assert same >= 0.99 * n * len(picks), f"{same} of {n * len(picks)} picks agree"
    top1 = prm[:, sm._TOPK] == 1
    for a, _ in picks:
        assert torch.equal(a[top1], cand[top1, 0])
        for i in range(n):  # every pick among its row's own top-k candidates
            assert int(a[i]) in cand[i, : int(prm[i, sm._TOPK])].tolist(), i


def check_row_uniforms(device: str) -> None:
    """``triton_ops.row_uniforms_`` (the uniform numbers a CUDA graph's pick draws from each row's seed hash and its
    position less the tick) equals the host's ``sampler._uniforms``, capped at ``_U_MAX``, bit for bit: seeds at 0,
    1 and 2^64 - 1 among random ones, the number of rows not a power of two, a table row's other columns and the
    rows past ``n`` untouched; the tick moves by ``advance`` only."""
    import random

    import numpy as np

    from common import sampler as sm
    from common import triton_ops as tk

    rng = random.Random(11)
    n = 37
    seeds = [0, 1, (1 << 64) - 1, *(rng.getrandbits(64) for _ in range(n - 3))]
    positions = [0, 5, (1 << 31) + 3, *(rng.randrange(1 << 20) for _ in range(n - 3))]
    hashes = [sm._mix64(s) for s in seeds]
    want = torch.from_numpy(np.minimum(sm._uniforms(hashes, positions), sm._U_MAX).astype(np.float32))
    pack = torch.full((n + 3, sm._PACK_WORDS), -7, dtype=torch.int64)
    pack[:, : sm._PACK_WORDS - 2] = torch.rand(n + 3, sm._PACK_WORDS * 2 - 4).view(torch.int64)  # a table's floats
    pack[:n, -2] = torch.from_numpy(np.array(hashes, dtype=np.uint64).view(np.int64))
    for tick_at, advance in ((0, 1), (123_456, 0), (1 << 40, 1)):
        pack[:n, -1] = torch.tensor(positions, dtype=torch.int64) - tick_at
        dev = pack.to(device)
        prm = dev[:, : sm._PACK_WORDS - 2].view(torch.float32)
        tick = torch.tensor([tick_at], dtype=torch.int64, device=device)
        tk.row_uniforms_(prm[:n], dev[:, sm._PACK_WORDS - 2 :], tick, sm._U, advance)
        got = prm[:, sm._U].cpu()
        assert torch.equal(got[:n], want), (tick_at, (got[:n] != want).nonzero()[:5])
        assert int(tick[0]) == tick_at + advance
        other = torch.ones(sm._PACK_WORDS * 2 - 4, dtype=torch.bool)
        other[sm._U] = False
        assert torch.equal(prm[:n, other].cpu(), pack[:n, : sm._PACK_WORDS - 2].view(torch.float32)[:, other])
        assert torch.equal(dev[n:].cpu(), pack[n:]) and torch.equal(dev[:, -2:].cpu(), pack[:, -2:])


def check_scaled_division(device: str) -> None:
    """``triton_ops._scaled`` (x / t from t's reciprocal and one fused multiply-add correction, the pick's z) is
    IEEE division, bit for bit: against PyTorch's ``x / t`` on 2^18 logits (spread over many binades, with the
    infinities and a NaN) at temperatures whose reciprocals round up and down."""
    import triton

    from common.triton_ops import _scaled_kernel

    g = torch.Generator().manual_seed(3)
    x = torch.randn(1 << 18, generator=g) * torch.exp2(torch.randint(-20, 20, (1 << 18,), generator=g).float())
    x[:4] = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0])
    x = x.to(device)
    for temp in (1.0, 0.7, 1.3, 0.05, 3.7, 0.999999, 1.0000001, 2.0 / 3.0):
        t = torch.tensor(temp, dtype=torch.float32)
        out = torch.empty_like(x)
        _scaled_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, float(t), x.numel(), BLOCK=1024)
        want = x / t.to(device)
        same = (out == want) | (out.isnan() & want.isnan())
        assert bool(same.all()), f"temperature {temp}: {int((~same).sum())} quotients differ, e.g. " \
            f"{x[~same][:3].tolist()} -> {out[~same][:3].tolist()} not {want[~same][:3].tolist()}"


def exact_pick_shares(logits: torch.Tensor, temp: float, top_p: float, min_p: float) -> torch.Tensor:
    """Each token's share of the pick in float64: temperature, top-p (the smallest set of the largest whose mass
    reaches top_p), min-p (probability at least min_p × the largest), renormalized."""
    p = torch.exp((logits.double() - logits.double().max()) / temp)
    order = p.argsort(descending=True)
    ps = p[order]
    keep = torch.zeros_like(p, dtype=torch.bool)
    keep[order] = ps.cumsum(0) - ps < top_p * p.sum()
    keep &= p >= min_p * p.max()
    q = torch.where(keep, p, 0.0)
    return q / q.sum()


def check_pick_full(device: str, vocab: int = 3000, n: int = 2048, cases: tuple[int, ...] | None = None,
                    **settings: int) -> None:
    """The whole-vocabulary pick (``pick_full``): with every row's uniform number on a grid of ``n`` points, each
    token is picked in its exact share of the rows (an inverse CDF maps the grid's points in an interval of width q
    to its token: q·n of them, ±1), and never a token that temperature, top-p or min-p drop. The vocabulary spans
    several of the kernel's blocks (the running sum carried across them); one case masks the first blocks to -inf
    (a grammar's mask), one has a token far above the others (top-p keeps it alone: the blocks without it are
    skipped). With top-p or min-p, the kept set's edge is checked exactly too. ``settings`` override the kernel's
    module settings by name (``PICK_BLOCK=256, PICK_SEGMENTS=4``: several blocks a segment, skipped blocks beside
    read ones; ``PICK_CAP=4``: top-p's first candidates overflow their slots and the second try's fit;
    ``PICK_CAP=2``: some rows overflow both, so their last digits run over the whole rows)."""
    from common import sampler as sm
    from common import triton_ops as tk

    if settings:
        saved = {k: getattr(tk, k) for k in settings}
        for k, val in settings.items():
            setattr(tk, k, val)
        try:
            check_pick_full(device, vocab, n, cases)
        finally:
            for k, val in saved.items():
                setattr(tk, k, val)
        return
    g = torch.Generator().manual_seed(7)
    base = torch.randn(vocab, generator=g) * 2.5
    masked = base.clone()
    masked[:2100] = float("-inf")
    peaked = base.clone()
    peaked[1234] = 40.0
    every = [(base, 1.0, 1.0, 0.0), (base, 0.7, 0.9, 0.0), (base, 1.3, 0.5, 0.0), (base, 1.0, 1.0, 0.05),
             (base, 1.0, 0.8, 0.02), (masked, 1.0, 0.95, 0.0), (peaked, 1.0, 0.9, 0.0)]
    for i, (logits, temp, top_p, min_p) in enumerate(every):
        if cases is not None and i not in cases:
            continue
        prm = torch.tensor([sm._PAD_ROW] * n, dtype=torch.float32)
        prm[:, sm._TEMP], prm[:, sm._TOPP], prm[:, sm._MINP] = temp, top_p, min_p
        prm[:, sm._U] = (torch.arange(n, dtype=torch.float64) + 0.5).div(n).float()
        x = logits.expand(n, vocab).contiguous()
        got = tk.pick_full(x.to(device), prm.to(device), (sm._TEMP, sm._TOPP, sm._MINP, sm._U), top_p < 1,
                           min_p > 0).cpu()
        want = exact_pick_shares(logits, temp, top_p, min_p)
        share = torch.bincount(got, minlength=vocab).double() / n
        what = f"temperature {temp}, top_p {top_p}, min_p {min_p}"
        assert share[want == 0].sum() == 0, f"{what}: dropped tokens picked {torch.nonzero(share * (want == 0))}"
        worst = float((share - want).abs().max())
        assert worst <= 2.0 / n, f"{what}: a token's share off by {worst:.2e} (at most 2/{n})"
        if top_p < 1 or min_p > 0:
            # the kept set's lower edge, exactly: with the vocabulary in falling order, the largest u picks the
            # last token that top-p and min-p keep (one more kept or one fewer moves the pick)
            desc = logits.sort(descending=True).values
            last = int((exact_pick_shares(desc, temp, top_p, min_p) > 0).sum()) - 1
            edge = prm[:2].clone()
            edge[:, sm._U] = sm._U_MAX
            got = tk.pick_full(desc.expand(2, vocab).contiguous().to(device), edge.to(device),
                               (sm._TEMP, sm._TOPP, sm._MINP, sm._U), top_p < 1, min_p > 0).cpu()
            assert got.tolist() == [last, last], f"{what}: u at its largest picks {got.tolist()}, not token {last}"


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"b{c[0]}-ctx{c[1]}-splits{c[2]}")
@pytest.mark.parametrize("config", CONFIGS)
def test_paged_decode_attention(config, case):
    check_decode_attention("cuda", config, *case)


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("config", CONFIGS)
def test_paged_decode_attention_rows_sharing_tables(config, splits):
    check_decode_attention("cuda", config, 24, 700, splits, row_map=True)


@pytest.mark.parametrize("config", CONFIGS)
def test_paged_prompt_attention(config):
    check_prompt_attention("cuda", config)


@pytest.mark.parametrize("config", CONFIGS)
def test_rope_kv_write(config):
    check_rope_kv_write("cuda", config)


@pytest.mark.parametrize("config", CONFIGS)
def test_add_rms_norm(config):
    check_add_rms_norm("cuda", config)


@pytest.mark.parametrize("config", CONFIGS)
def test_silu_mul(config):
    check_silu_mul("cuda", config)


@pytest.mark.parametrize("shape", GEMV_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_gemv_and_splitk(shape):
    check_gemv_and_splitk("cuda", *shape)


def test_grammar_mask_kernels():
    check_grammar_mask_kernels("cuda")


def test_sampler_kernels():
    check_sampler_kernels("cuda")
    check_row_uniforms("cuda")


def test_pick_full():
    check_pick_full("cuda")


def test_scaled_division():
    check_scaled_division("cuda")


def test_pick_full_several_blocks_a_segment():
    check_pick_full("cuda", PICK_BLOCK=256, PICK_SEGMENTS=4)


def test_pick_full_with_top_p_candidates_on_the_second_try():
    check_pick_full("cuda", PICK_CAP=4)


def test_pick_full_with_top_p_candidates_past_their_slots():
    check_pick_full("cuda", PICK_CAP=2)

"""The CPU kernels (common/csrc) against the portable PyTorch ops they replace, on random data."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from common import cpu_kernels, model_cpu
from common.model import AttentionMetadata, cache_rows, paged_attention


def test_the_kernel_compiles_here():
    # the machines we run on have a C++ compiler; the portable path is only a fallback
    assert cpu_kernels.available()


@pytest.mark.parametrize("n_seqs", [2, 5])  # a job per (sequence, kv head) / per sequence
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [32, 80])  # bf16 rows go by 32-element chunks; 80 ends with a chunk of 16
def test_decode_attention_matches_the_portable_path(dtype, n_seqs, d):
    g = torch.Generator().manual_seed(7)
    nb, layers, bs, kvh, heads = 40, 3, 16, 2, 6
    ctx = [1, 16, 17, 70, 33][:n_seqs]  # one token, a full block, one past a block, several blocks
    b = len(ctx)
    width = max(-(-c // bs) for c in ctx)
    cache = torch.randn(nb, layers, 2, bs, kvh, d, generator=g).to(dtype)
    perm = torch.randperm(nb, generator=g)
    tables = perm[: b * width].view(b, width)  # scattered blocks, each sequence its own
    q = torch.randn(b, heads, d, generator=g).to(dtype)
    ctx_t = torch.tensor(ctx)
    rows = cache_rows(tables, bs, layers)
    mask = (torch.arange(width * bs)[None] < ctx_t[:, None])[:, None, None, :]
    for layer in range(layers):
        meta = AttentionMetadata(
            slot_rows=torch.zeros(0, dtype=torch.long), prefill_query_lens=[], prefill_context_lens=[],
            prefill_rows=[], num_decode_tokens=b, decode_rows=rows, decode_mask=mask, layer_stride=2 * bs,
            kv_stride=bs,
        )
        empty = torch.zeros(0, kvh, d, dtype=dtype)
        ref = paged_attention(q, empty, empty, cache.view(-1, kvh, d), layer * 2 * bs, meta).float()
        got = cpu_kernels.paged_decode_attention(q, cache, layer, tables, ctx_t, d**-0.5).float()
        rel = ((got - ref).abs().max() / ref.abs().max()).item()
        assert rel < (1e-5 if dtype == torch.float32 else 2e-2), rel


def test_bad_shapes_are_refused():
    cache = torch.zeros(4, 1, 2, 16, 2, 32)
    with pytest.raises(RuntimeError, match="head shapes disagree"):
        cpu_kernels.paged_decode_attention(torch.zeros(1, 6, 16), cache, 0, torch.zeros(1, 1, dtype=torch.long),
                                           torch.ones(1, dtype=torch.long), 1.0)
    with pytest.raises(RuntimeError, match="context length out of range"):
        cpu_kernels.paged_decode_attention(torch.zeros(1, 4, 32), cache, 0, torch.zeros(1, 1, dtype=torch.long),
                                           torch.tensor([17]), 1.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden", [576, 40])  # the AVX-512 chunks, and a width that is not a multiple of 16
def test_add_rms_norm_matches_the_portable_ops(hidden, dtype):
    from common.model import rms_norm

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(37, hidden, generator=g) * 3).to(dtype)
    delta = torch.randn(37, hidden, generator=g).to(dtype)
    w = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    want_x = x + delta
    want = rms_norm(want_x, w, 1e-5)
    got = cpu_kernels.add_rms_norm(x, delta, w, 1e-5)
    assert torch.equal(x, want_x)  # the residual, updated in place, rounded as x + delta is
    # only the float32 sum of squares is ordered differently: at most one step of the dtype apart (rarely in bf16)
    diff = (got.float() - want.float()).abs()
    assert (diff <= want.float().abs() * (2**-7 if dtype == torch.bfloat16 else 2**-20)).all()
    if dtype == torch.bfloat16:
        assert (diff > 0).float().mean() < 0.01
    alone = cpu_kernels.add_rms_norm(want_x.clone(), None, w, 1e-5)
    assert torch.equal(alone, got)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 40])  # the AVX-512 halves, and a half (20) that takes the scalar tail
def test_rope_write_kv_equals_apply_rope_and_the_cache_write(head_dim, dtype):
    from common.model import apply_rope

    g = torch.Generator().manual_seed(5)
    t, heads, kvh, d, max_pos = 23, 6, 2, head_dim, 512
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(max_pos).float(), inv)
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    qkv = (torch.randn(t, (heads + 2 * kvh) * d, generator=g) * 2).to(dtype)
    pos = torch.randint(0, max_pos, (t,), generator=g)
    cache = torch.zeros(8, 3, 2, 16, kvh, d, dtype=dtype)
    rows = torch.randperm(8 * 3 * 2 * 16 // 2, generator=g)[:t]  # distinct rows, anywhere below the V offset
    k_off, v_off = 0, 8 * 3 * 2 * 16 // 2
    # the portable ops
    want = qkv.clone()
    qk = apply_rope(want[:, : (heads + kvh) * d].view(t, heads + kvh, d), cos[pos].unsqueeze(1).to(dtype),
                    sin[pos].unsqueeze(1).to(dtype))
    want_cache = cache.clone()
    want_cache.view(-1, kvh, d).index_copy_(0, rows + k_off, qk[:, heads:])
    want_cache.view(-1, kvh, d).index_copy_(0, rows + v_off, want[:, (heads + kvh) * d :].view(t, kvh, d))
    want[:, : (heads + kvh) * d] = qk.reshape(t, -1)
    cpu_kernels.rope_write_kv(qkv, pos, cos, sin, cache, rows, k_off, v_off, heads, kvh)
    assert torch.equal(qkv, want)  # rounded as the portable ops round: bit for bit
    assert torch.equal(cache, want_cache)
    with pytest.raises(RuntimeError, match="position out of range"):
        cpu_kernels.rope_write_kv(qkv, pos + max_pos, cos, sin, cache, rows, k_off, v_off, heads, kvh)
    with pytest.raises(RuntimeError, match="cache row out of range"):
        cpu_kernels.rope_write_kv(qkv, pos, cos, sin, cache, rows + 10**6, k_off, v_off, heads, kvh)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("inter", [1536, 40])
def test_silu_mul_matches_the_portable_ops(inter, dtype):
    g = torch.Generator().manual_seed(9)
    gu = (torch.randn(19, 2 * inter, generator=g) * 4).to(dtype)
    gu[0, :8] = torch.tensor([-100.0, -88.0, -20.0, 0.0, 20.0, 88.0, 100.0, 1e4])  # both tails of e^-x
    gate, up = gu.chunk(2, dim=-1)
    want = (torch.nn.functional.silu(gate) * up).float()
    got = cpu_kernels.silu_mul(gu).float()
    # a polynomial e^x instead of torch's: the float32 SiLU may differ in its last bits, so rarely one bf16 step
    step = 2**-7 if dtype == torch.bfloat16 else 2**-20
    diff = (got - want).abs()
    assert (diff <= want.abs() * step).all()
    if dtype == torch.bfloat16:
        assert (diff > 0).float().mean() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [49152, 1000, 7])  # whole 16-lane chunks, a tail, shorter than a chunk
def test_argmax_rows_equals_torch_argmax_ties_included(dtype, vocab):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, vocab, generator=g).to(dtype)
    x[1] = 0.0  # all tied: the first index
    x[2, vocab // 3] = x[2, vocab - 1] = 50.0  # a tie between two lanes / chunks
    x[3, -1] = 60.0  # the maximum in the last entry (the tail)
    x[4] = -float("inf")
    x[4, vocab // 2] = -1e30
    assert torch.equal(cpu_kernels.argmax_rows(x), x.argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [49152, 1000, 7])
def test_masked_argmax_rows_equals_an_argmax_over_the_allowed_entries(dtype, vocab):
    """Rows picked out of the logits, each argmax over its bitmask's allowed entries: random masks dense and sparse,
    ties across 16-lane chunks and halves of a mask word, the maximum outside the mask, an allowed entry only in
    the tail; every allowed entry -inf: the first allowed one; nothing allowed: 0."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(12, vocab, generator=g).to(dtype)
    allowed = torch.rand(12, vocab, generator=g) < torch.tensor([0.5, 0.5, 0.02, 0.9, 0.5, 0.5, 0.5, 0.001, 0.5, 0.5,
                                                                0.5, 0.5]).unsqueeze(1)
    x[1] = 0.0  # all tied: the first allowed entry
    x[3, vocab // 3] = x[3, vocab - 1] = 50.0  # a tie between two chunks
    allowed[3, vocab // 3] = allowed[3, vocab - 1] = True
    x[4, 0] = 99.0  # the maximum disallowed
    allowed[4, 0] = False
    allowed[5] = False
    allowed[5, vocab - 1] = True  # only the last entry (the tail)
    x[6, allowed[6]] = -float("inf")  # every allowed entry -inf
    allowed[8] = False  # nothing allowed
    if vocab >= 32:
        x[9, 16] = x[9, 5] = 70.0  # a tie between the two halves of the first mask word
        allowed[9, 16] = allowed[9, 5] = True
    rows = torch.tensor([0, 1, 2, 3, 4, 5, 6, 8, 9, 11, 7, 0])  # any rows, in any order, repeated
    words = (vocab + 31) // 32
    bits = torch.zeros(len(rows), words * 32, dtype=torch.int64)
    bits[:, :vocab] = allowed[rows].long()
    mask = (bits.view(len(rows), words, 32) << torch.arange(32)).sum(-1).to(torch.int64)
    mask = torch.where(mask >= 2**31, mask - 2**32, mask).to(torch.int32)
    got = cpu_kernels.masked_argmax_rows(x, rows, mask).tolist()
    want = []
    for r in rows.tolist():
        ok = allowed[r]
        if not ok.any():
            want.append(0)
        elif (x[r][ok].float() == -float("inf")).all():
            want.append(int(ok.nonzero()[0]))
        else:
            want.append(int(x[r].float().masked_fill(~ok, -float("inf")).argmax()))
    assert got == want


def test_greedy_sampling_from_bfloat16_logits_equals_float32():
    from common.sampler import SampleRow, sample
    from common.sampling import SamplingParams

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 5000, generator=g).to(torch.bfloat16)
    logits[0, 10] = logits[0, 20] = 9.0  # a tie
    greedy = SamplingParams(temperature=0.0)
    rows = [SampleRow(greedy, 0, 0, [1], [], (2,)) for _ in range(6)]
    want = logits.float().argmax(dim=-1).tolist()
    assert sample(logits.clone(), rows).token_ids == want
    # a row that needs float32 (logprobs) sends the whole batch down the float32 path: same picks
    lp = SamplingParams(temperature=0.0, logprobs=2)
    res = sample(logits.clone(), [*rows[:5], SampleRow(lp, 0, 0, [1], [], (2,))])
    assert res.token_ids == want and res.logprobs[5] is not None and res.logprobs[0] is None


@pytest.mark.skipif(not (cpu_kernels.vectorized() and model_cpu.bf16_packing_supported()),
                    reason="the bfloat16 fast path needs the AVX-512 kernels and oneDNN's bfloat16 matmul")
def test_bfloat16_fast_path_is_on_and_no_further_from_float32_than_the_portable_one():
    """bfloat16 on CPU runs the kernels (attention, the fused stages) by default. Neither bf16 path equals the
    float32 reference token for token (bf16 rounds), so the check is: over the 20 reference prompts, greedy tokens
    agree with float32's for about as long as the portable bf16 path's do: within 5% (measured: 17.8 vs 16.1 of 24
    where the test was written; 18.1 vs 18.55 on a Xeon with AVX-512 and neither AMX nor AVX512-BF16, where one
    greedy divergence more or less moves the count)."""
    from common.config import EngineConfig
    from common.engine import LLMEngine
    from common.sampling import SamplingParams
    from tests.prompts import prompt_ids

    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def run(dtype: str, kernels: bool | None) -> tuple[LLMEngine, list[list[int]]]:
        eng = LLMEngine.from_spec(None, EngineConfig(dtype=dtype, kv_cache_memory=128 << 20, cpu_kernels=kernels))
        return eng, [list(o.token_ids) for o in eng.generate(prompt_ids(eng.tokenizer), params)]

    def agreeing(outs: list[list[int]], ref: list[list[int]]) -> int:
        total = 0
        for a, b in zip(outs, ref):
            n = 0
            while n < len(a) and a[n] == b[n]:
                n += 1
            total += n
        return total

    _, ref = run("float32", False)
    fast, got = run("bfloat16", None)
    assert fast.runner.use_cpu_kernel and fast.runner.model.backend.name == "cpu"
    layer = fast.runner.model.layers[0]  # packed in bf16: the plain copies are freed
    assert layer.qkv.numel() == 0 and layer.down.numel() == 0 and fast.runner.model.lm_head.numel() > 0
    plain, want = run("bfloat16", False)
    assert not plain.runner.use_cpu_kernel and plain.runner.model.backend.name == "portable"
    assert agreeing(got, ref) >= 0.95 * agreeing(want, ref), (agreeing(got, ref), agreeing(want, ref))


def test_the_tokenmill_entry_point_gives_torch_buffers_huge_pages(monkeypatch):
    """The ``tokenmill`` entry point turns on torch's transparent-huge-page allocation (where the kernel's THP mode
    allows it) before torch allocates; importing ``common`` changes no environment; the vLLM peer's environment
    leaves it out unless the user set it."""
    import subprocess
    import sys
    from pathlib import Path

    from common import machine
    from loadgen.peers import vllm_env

    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    code = (
        "import os, common\n"
        "assert 'THP_MEM_ALLOC_ENABLE' not in os.environ\n"
        "from services.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "import torch\n"
        "x = torch.ones(64 << 20, dtype=torch.uint8)\n"
        "print([int(l.split()[1]) for l in open('/proc/self/smaps_rollup') if l.startswith('AnonHugePages')][0])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    huge_kib = int(out.stdout.strip().splitlines()[-1])
    if "[never]" in mode:
        assert huge_kib == 0
    else:
        assert huge_kib >= 32 << 10, (mode, huge_kib)  # most of the 64 MiB buffer

    monkeypatch.delenv(machine.HUGE_PAGES_ENV, raising=False)
    monkeypatch.setattr(machine, "_huge_pages_set_here", False)
    machine.use_huge_pages()
    assert os.environ[machine.HUGE_PAGES_ENV] == "1" and machine.HUGE_PAGES_ENV not in vllm_env()
    monkeypatch.setenv(machine.HUGE_PAGES_ENV, "1")  # as a user sets it: the peer keeps it
    monkeypatch.setattr(machine, "_huge_pages_set_here", False)
    machine.use_huge_pages()
    assert vllm_env()[machine.HUGE_PAGES_ENV] == "1"


def test_the_small_batch_matmul_runs_where_amx_is():
    # the machines we test on have AMX (Sapphire Rapids and later); elsewhere the engine keeps oneDNN's matmul
    has_amx = "amx_bf16" in Path("/proc/cpuinfo").read_text()
    assert cpu_kernels.amx_bf16() == (has_amx and cpu_kernels.vectorized())


@pytest.mark.skipif(not cpu_kernels.amx_bf16(), reason="the small-batch matmul needs AMX (torch's brgemm)")
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (3072, 576), (64, 32)])
@pytest.mark.parametrize("rows", [1, 3, 17, 32])  # the engine takes it up to 32 rows
def test_small_batch_matmul_equals_onednn_bit_for_bit(shape, rows):
    g = torch.Generator().manual_seed(rows)
    n, k = shape
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    small = cpu_kernels.pack_small_batch(w)
    onednn = torch.ops.mkldnn._reorder_linear_weight(w, 16)
    for bias in (None, b):
        want = torch.ops.mkldnn._linear_pointwise(x, onednn, bias, "none", [], "")
        got = cpu_kernels.linear_small_batch(x, small, bias)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        assert torch.equal(got, want)
        assert torch.equal(got, torch.nn.functional.linear(x, w, bias))


def test_small_batch_matmul_refuses_what_it_cannot_take():
    with pytest.raises(RuntimeError, match=r"weight shape \[40, 64\] is not a multiple of 32"):
        cpu_kernels.pack_small_batch(torch.zeros(40, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16"):
        cpu_kernels.pack_small_batch(torch.zeros(64, 64))
    if cpu_kernels.amx_bf16():
        packed = cpu_kernels.pack_small_batch(torch.zeros(64, 64, dtype=torch.bfloat16))
        with pytest.raises(RuntimeError, match="x has 32 columns, the weight 64"):
            cpu_kernels.linear_small_batch(torch.zeros(1, 32, dtype=torch.bfloat16), packed)
        assert cpu_kernels.linear_small_batch(torch.zeros(0, 64, dtype=torch.bfloat16), packed).shape == (0, 64)


@pytest.mark.skipif(not cpu_kernels.amx_bf16(), reason="the prefill attention kernel needs AMX (torch's brgemm)")
@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(9, 3, 64), (4, 4, 32), (14, 2, 64), (2, 1, 80)])
@pytest.mark.parametrize("s", [1, 15, 64, 65, 300])
def test_prefill_attention_is_as_close_to_float32_as_sdpa(s, heads, kv_heads, d):
    """The kernel against float32 causal SDPA, next to bf16 SDPA's own distance from it (both round the attention
    weights to bf16 for the second matmul); q/k/v are strided views of one fused projection, as in the model."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(s * 7 + heads)
    qkv = torch.randn(s, (heads + 2 * kv_heads) * d, generator=g).to(torch.bfloat16)
    q = qkv[:, : heads * d].view(s, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(s, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d :].view(s, kv_heads, d)

    def sdpa(q, k, v):
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           is_causal=True, enable_gqa=True)
        return o[0].transpose(0, 1).float()

    exact = sdpa(q.float(), k.float(), v.float())
    got = cpu_kernels.prefill_attention(q, k, v, d**-0.5)
    assert got.shape == (s, heads, d) and got.dtype == torch.bfloat16
    err = (got.float() - exact).abs().max().item()
    ref = (sdpa(q, k, v) - exact).abs().max().item()
    assert err <= 2 * ref + 1e-3, (err, ref)
    if s == 1:  # one token attends to itself: its V, rounded
        assert torch.equal(got, v.repeat_interleave(heads // kv_heads, dim=1))


def test_a_build_lock_left_by_a_killed_compile_does_not_hang_the_next_load():
    """torch's build lock is a file; a compile killed mid-way (Ctrl-C during the first `make up`) leaves it, and
    torch then waits on it forever, even for a cached build. Loading removes such a lock."""
    import subprocess
    import sys

    d = cpu_kernels.build_dir()
    d.mkdir(parents=True, exist_ok=True)
    (d / "lock").touch()  # as a killed build leaves it
    code = "from common import cpu_kernels; print(cpu_kernels.available())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True)
    assert out.stdout.strip() == "True", out.stderr[-2000:]
    assert not (d / "lock").exists()

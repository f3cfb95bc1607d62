"""Tensor parallelism (common/tensor_parallel.py) on the CPU: two ranks in two processes over gloo, against one rank.

The model is the tiny dummy Llama (4 heads, 2 KV heads, 2 layers) in float32 with seeded random weights: TP=2 draws
the same full weights as TP=1 and keeps its halves, so the two compute the same function and differ only in the
order of the sums (the row-parallel matmuls end in an all-reduce)."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from common.config import EngineConfig
from common.cuda_graphs import DecodeStaging
from common.engine import LLMEngine
from common.hf_export import hf_config_dict
from common.loader import load_model_source
from common.model import LlamaModel
from common.model_runner import StepPlan
from common.sampling import SamplingParams
from common.tensor_parallel import _INLINE, _SLOTS, Op, Shard, StepChannel

# float32 logits of TP=2 against TP=1: the same products summed in another order
LOGIT_TOL = 1e-4
PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 50)), [7] * 17, list(range(300, 333))]
GREEDY = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny():
    return load_model_source("dummy:tiny-llama")


def engine_cfg(tp: int, **kw) -> EngineConfig:
    return EngineConfig(kv_cache_memory=16 << 20, tensor_parallel_size=tp, **kw)


@pytest.fixture(scope="module")
def single(tiny):
    return LLMEngine(tiny, engine_cfg(1))


# A process holds one tensor-parallel engine at a time (torch.distributed's default group is the process's): the
# TP=2 engine the comparisons share is made on first use, and closed by a test that needs the group for its own.
_PAIR: dict[str, LLMEngine] = {}


@pytest.fixture
def pair(tiny) -> LLMEngine:
    if "engine" not in _PAIR:
        _PAIR["engine"] = LLMEngine(tiny, engine_cfg(2))
    return _PAIR["engine"]


@pytest.fixture
def no_pair() -> None:
    """The shared TP=2 engine closed, so that this test can make its own."""
    eng = _PAIR.pop("engine", None)
    if eng is not None:
        eng.close()


@pytest.fixture(scope="module", autouse=True)
def _close_the_pair_at_the_end():
    yield
    eng = _PAIR.pop("engine", None)
    if eng is not None:
        eng.close()


def hf_weights(model: LlamaModel) -> dict[str, torch.Tensor]:
    """A one-rank model's weights under Hugging Face names (the fused matrices taken apart)."""
    cfg = model.cfg
    q, kv, i = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    out = {"model.embed_tokens.weight": model.embed_tokens, "model.norm.weight": model.norm,
           "lm_head.weight": model.lm_head}
    for li, layer in enumerate(model.layers):
        p = f"model.layers.{li}."
        out |= {p + "input_layernorm.weight": layer.input_norm, p + "post_attention_layernorm.weight": layer.post_norm,
                p + "self_attn.q_proj.weight": layer.qkv[:q], p + "self_attn.k_proj.weight": layer.qkv[q : q + kv],
                p + "self_attn.v_proj.weight": layer.qkv[q + kv :], p + "self_attn.o_proj.weight": layer.o_proj,
                p + "mlp.gate_proj.weight": layer.gate_up[:i], p + "mlp.up_proj.weight": layer.gate_up[i:],
                p + "mlp.down_proj.weight": layer.down}
        if cfg.attention_bias:
            b = layer.qkv_bias
            out |= {p + "self_attn.q_proj.bias": b[:q], p + "self_attn.k_proj.bias": b[q : q + kv],
                    p + "self_attn.v_proj.bias": b[q + kv :]}
    return {k: v.detach().clone() for k, v in out.items()}


def step_logits(engine: LLMEngine, prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    """Run greedy requests to the end, one engine step at a time; rank 0's logits of every step, float32 (the first
    step prefills every prompt, the others decode)."""
    seen: list[torch.Tensor] = []
    execute = engine.runner.execute

    def spy(out, *rest):
        logits = execute(out, *rest)
        seen.append(logits.float().clone())
        return logits

    engine.runner.execute = spy
    try:
        for i, p in enumerate(prompts):
            engine.add_request(f"logits-{i}", p, dataclasses.replace(GREEDY, max_tokens=steps))
        while engine.has_unfinished():
            engine.step()
    finally:
        del engine.runner.execute
    return seen


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# -- the sharded model (one process, no group) -------------------------------------------------------------------
@pytest.mark.parametrize("bias", [False, True])
def test_each_rank_holds_its_heads_and_mlp_slice_whether_loaded_or_random(tiny, bias):
    cfg = dataclasses.replace(tiny.config, attention_bias=bias)
    full = LlamaModel(cfg, torch.float32, "cpu")
    full.init_random(seed=3)
    if bias:
        for layer in full.layers:
            layer.qkv_bias.data.normal_()
    weights = hf_weights(full)
    q, kv, i, d = cfg.q_size, cfg.kv_size, cfg.intermediate_size, cfg.head_dim
    for rank in range(2):
        drawn = LlamaModel(cfg, torch.float32, "cpu", Shard(rank, 2))
        drawn.init_random(seed=3)
        loaded = LlamaModel(cfg, torch.float32, "cpu", Shard(rank, 2))
        loaded.load_weights(weights.items())
        assert (loaded.num_heads, loaded.num_kv_heads, loaded.q_size) == (2, 1, q // 2)
        for li, (f, a, b) in enumerate(zip(full.layers, drawn.layers, loaded.layers)):
            heads = slice(rank * q // 2, (rank + 1) * q // 2)
            kv_heads = slice(rank * kv // 2, (rank + 1) * kv // 2)
            mlp = slice(rank * i // 2, (rank + 1) * i // 2)
            qkv = torch.cat([f.qkv[:q][heads], f.qkv[q : q + kv][kv_heads], f.qkv[q + kv :][kv_heads]])
            gate_up = torch.cat([f.gate_up[:i][mlp], f.gate_up[i:][mlp]])
            for part in (a, b):
                assert torch.equal(part.qkv, qkv), (rank, li)
                assert torch.equal(part.gate_up, gate_up) and torch.equal(part.o_proj, f.o_proj[:, heads])
                assert torch.equal(part.down, f.down[:, mlp]) and torch.equal(part.input_norm, f.input_norm)
            if bias:
                b_full = f.qkv_bias
                expect = torch.cat([b_full[:q][heads], b_full[q : q + kv][kv_heads], b_full[q + kv :][kv_heads]])
                assert torch.equal(b.qkv_bias, expect)
        for part in (drawn, loaded):  # replicated
            assert torch.equal(part.embed_tokens, full.embed_tokens) and torch.equal(part.lm_head, full.lm_head)
        assert d * loaded.num_kv_heads == loaded.kv_size


def test_a_full_weight_of_the_wrong_shape_is_named():
    cfg = load_model_source("dummy:tiny-llama").config
    model = LlamaModel(cfg, torch.float32, "cpu", Shard(1, 2))
    with pytest.raises(ValueError, match=r"'layers.0.self_attn.o_proj.weight' has shape \(64, 32\), "
                                         r"expected \(64, 64\)"):
        model.load_weights([("model.layers.0.self_attn.o_proj.weight", torch.zeros(64, 32))])


def test_step_messages_round_trip():
    plan = StepPlan(ids=[5, 6, 7, 8], positions=[0, 1, 9, 3], slots=[0, 1, 73, 40], prefill_lens=[2, 1],
                    prefill_context_lens=[2, 10], prefill_tables=[None, [4, 2]], decode_context_lens=[4],
                    decode_tables=[[7, 0]], sample_indices=[1, 2, 3])
    assert StepPlan.unpack(plan.pack()) == plan
    empty = StepPlan([], [], [], [], [], [], [], [], [])
    assert StepPlan.unpack(empty.pack()) == empty
    # a CUDA-graph step's staged rows (plain host code): another rank's staging ends up with the same head and rows
    sent, got = (DecodeStaging(max_batch=8, width=6, block_size=16, num_layers=2, pin=False) for _ in range(2))

    class Seq:
        def __init__(self, blocks: list[int], n: int) -> None:
            self.block_ids, self.num_computed_tokens = blocks, n

        def input_token(self, i: int) -> int:
            return 100 + i

    decodes = [type("D", (), {"seq": Seq([3, 4, 5], 40)})(), type("D", (), {"seq": Seq([9], 2)})()]
    n = sent.fill(decodes, padded=4)
    assert got.load(sent.rows(4)) == (4, n)
    assert np.array_equal(got.head[:, :4], sent.head[:, :4])
    assert got.tables[0, :3].tolist() == [3, 4, 5] and got.tables[1, 0] == 9


def test_the_step_channel_delivers_in_order_through_a_full_ring_and_refuses_a_gone_reader():
    words = StepChannel.allocate(3)
    writer = StepChannel(words, 0, 3)
    readers = [StepChannel(words, r, 3) for r in (1, 2)]
    messages = [(Op.STEP, np.arange(i, i + 5 * i, dtype=np.int64)) for i in range(3 * _SLOTS)]
    messages.append((Op.GRAPH, np.arange(_INLINE + 7, dtype=np.int64)))  # longer than a slot: its head only
    got: dict[int, list] = {1: [], 2: []}

    def read(ch: StepChannel) -> None:
        for _ in messages:
            time.sleep(0.002)  # slower than the writer: the ring fills and the writer waits
            got[ch.rank].append(ch.recv())

    threads = [threading.Thread(target=read, args=(ch,)) for ch in readers]
    for t in threads:
        t.start()
    for op, data in messages:
        writer.send(op, data)
    for t in threads:
        t.join(10)
    for r in (1, 2):
        assert [(op, n) for op, n, _ in got[r]] == [(op, len(d)) for op, d in messages]
        assert all(np.array_equal(w, d[:_INLINE]) for (_, _, w), (_, d) in zip(got[r], messages))

    def gone() -> None:
        raise RuntimeError("rank 2 exited")

    writer.check = gone
    for _ in range(_SLOTS):  # reader 2 reads nothing more: the ring fills, then the writer asks check
        writer.send(Op.STEP, np.arange(3, dtype=np.int64))
    with pytest.raises(RuntimeError, match="rank 2 exited"):
        writer.send(Op.STEP, np.arange(3, dtype=np.int64))
    with pytest.raises(ValueError, match="at most 16 ranks"):
        StepChannel.allocate(17)


def test_with_gpu_all_reduces_rank_0_ends_its_process_when_another_rank_exits():
    """The peer-to-peer all-reduce would leave rank 0's kernels waiting for a dead rank: its watch ends the process
    (exit code 1, one critical line); a closed group's watch just returns."""
    code = (
        "import multiprocessing as mp\n"
        "from common.tensor_parallel import TensorParallelWorkers\n"
        "p = mp.get_context('spawn').Process(target=int)\n"
        "p.start(); p.join()\n"
        "w = TensorParallelWorkers.__new__(TensorParallelWorkers)\n"
        "w.procs, w._closed = [p], True\n"
        "w._exit_if_a_rank_dies()\n"
        "print('closed: returned')\n"
        "w._closed = False\n"
        "w._exit_if_a_rank_dies()\n"
        "print('not reached')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 1, (r.stdout, r.stderr[-2000:])
    assert "closed: returned" in r.stdout and "not reached" not in r.stdout
    assert "exited (code 0); the GPU all-reduces would wait for it forever" in r.stderr


# -- two ranks against one -----------------------------------------------------------------------------------------
def test_tp2_logits_equal_tp1_for_a_prefill_batch_and_decode_steps(single, pair):
    one = step_logits(single, PROMPTS, steps=6)
    two = step_logits(pair, PROMPTS, steps=6)
    assert len(one) == len(two) == 6 and one[0].shape == (len(PROMPTS), 512)
    diffs = [float((a - b).abs().max()) for a, b in zip(one, two)]
    assert max(diffs) < LOGIT_TOL, diffs
    assert float(one[0].abs().max()) > 0.1  # not a vacuous comparison
    # every position of each prompt (ModelRunner.score); 9,000 tokens: a step message over the inline buffer
    long = [[(7 * k + j) % 512 for j in range(1800)] for k in range(5)]
    for prompts in (PROMPTS, long):
        diffs = [float((a - b).abs().max()) for a, b in zip(single.runner.score(prompts), pair.runner.score(prompts))]
        assert max(diffs) < LOGIT_TOL, diffs
    assert pair.block_manager.num_free_blocks == pair.block_manager.num_blocks


def test_tp2_greedy_tokens_equal_tp1_over_64_steps(single, pair):
    one = single.generate(PROMPTS, GREEDY)
    two = pair.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in two] == [r.token_ids for r in one]
    assert all(len(r.token_ids) == 64 for r in two)
    # again, now from the prefix cache: the chunks after a cached prefix read it from each rank's own pool
    again = pair.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in again] == [r.token_ids for r in one]
    assert sum(r.num_cached_tokens for r in again) > 0


def test_a_long_prefill_step_and_loaded_weights_then_close_ends_the_workers(tiny, single, tmp_path, no_pair):
    """Weights from a Hugging Face directory (each rank loads and slices them), a 2,800-token step (its message
    takes a second broadcast), and ``close``: the rank processes exit and are gone."""
    from safetensors.torch import save_file

    save_file(hf_weights(single.runner.model), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(tiny.config)))
    long = [[(3 * k + j) % 512 for j in range(1400)] for k in range(2)]
    params = dataclasses.replace(GREEDY, max_tokens=8)
    expect = [r.token_ids for r in single.generate(PROMPTS + long, params)]
    eng = LLMEngine(load_model_source(str(tmp_path)), engine_cfg(2, max_num_batched_tokens=4096))
    try:
        pids = eng.tp.pids
        assert len(pids) == 1 and all(_alive(p) for p in pids)
        assert [r.token_ids for r in eng.generate(PROMPTS + long, params)] == expect
    finally:
        eng.close()
    assert not any(_alive(p) for p in pids)
    assert [p.exitcode for p in eng.tp.procs] == [0]  # left on the stop message, not killed
    eng.close()  # twice is fine


def test_a_rank_that_dies_fails_the_next_step_at_once_and_close_still_returns(tiny, no_pair):
    eng = LLMEngine(tiny, engine_cfg(2))
    try:
        [pid] = eng.tp.pids
        os.kill(pid, signal.SIGKILL)
        eng.tp.procs[0].join(10)
        with pytest.raises(RuntimeError, match="Connection closed by peer"):
            eng.generate([[1, 2, 3]], dataclasses.replace(GREEDY, max_tokens=4))
    finally:
        t0 = time.monotonic()
        eng.close()
        assert time.monotonic() - t0 < 10
    with LLMEngine(tiny, engine_cfg(2)) as again:  # the group is free for the next engine
        assert len(again.generate([[1, 2, 3]], dataclasses.replace(GREEDY, max_tokens=4))[0].token_ids) == 4


def test_the_workers_exit_when_the_engine_process_dies(tmp_path):
    script = (
        "import sys, time\n"
        "from common.config import EngineConfig\n"
        "from common.engine import LLMEngine\n"
        "if __name__ == '__main__':\n"
        "    eng = LLMEngine.from_spec('dummy:tiny-llama', EngineConfig(kv_cache_memory=16 << 20, "
        "tensor_parallel_size=2))\n"
        "    print(*eng.tp.pids, flush=True)\n"
        "    time.sleep(600)\n"
    )
    path = tmp_path / "engine.py"
    path.write_text(script)
    proc = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        line = proc.stdout.readline()
        assert line.strip(), "the engine process printed no worker pids"
        pids = [int(p) for p in line.split()]
        assert all(_alive(p) for p in pids)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)


# -- what is refused ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("tp", "message"), [
    (3, "tensor_parallel_size 3 does not divide num_attention_heads 4 of model tiny-llama"),
    (4, "tensor_parallel_size 4 does not divide num_key_value_heads 2 of model tiny-llama"),
])
def test_heads_that_do_not_divide_are_refused_with_the_numbers(tiny, tp, message):
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError) as e:
        LLMEngine(tiny, engine_cfg(tp))
    assert message in str(e.value) and "num_attention_heads 4, num_key_value_heads 2" in str(e.value)
    assert set(multiprocessing.active_children()) == before  # refused before any rank was started
    with pytest.raises(ValueError, match=message):
        LlamaModel(tiny.config, torch.float32, "cpu", Shard(0, tp))


def test_a_size_below_one_and_a_size_the_machine_lacks_are_refused(tiny):
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1, got 0"):
        engine_cfg(0)
    with pytest.raises(ValueError, match="noop_model runs no model: tensor_parallel_size must be 1, got 2"):
        engine_cfg(2, noop_model=True)
    if torch.cuda.device_count() < 2:
        with pytest.raises((ValueError, RuntimeError), match="CUDA device"):
            LLMEngine(tiny, EngineConfig(device="cuda", dtype="float32", tensor_parallel_size=2))


def test_tp2_with_async_scheduling_gives_tp1s_tokens_greedy_and_seeded(tiny, single, no_pair):
    """Async scheduling in a group: rank 0 launches each step before reading the last one's tokens and sends the
    other rank the fed ids (``TokenFeed`` → ``ReceivedIds``); a wrong or missing id there would change its shard's
    activations and so the group's logits. Greedy and seeded sampled requests, the same tokens as one synchronous
    rank's, and every block back."""
    seeded = [dataclasses.replace(GREEDY, temperature=0.8, top_p=0.9, seed=11 + i, max_tokens=24)
              for i in range(len(PROMPTS))]
    one_greedy = single.generate(PROMPTS, GREEDY)
    one_seeded = [single.generate([p], s)[0] for p, s in zip(PROMPTS, seeded)]
    eng = LLMEngine(tiny, engine_cfg(2, async_scheduling=True))
    try:
        assert eng.async_scheduling and eng.tp is not None
        two = eng.generate(PROMPTS, GREEDY)
        assert [r.token_ids for r in two] == [r.token_ids for r in one_greedy]
        both = [eng.generate([p], s)[0] for p, s in zip(PROMPTS, seeded)]
        assert [r.token_ids for r in both] == [r.token_ids for r in one_seeded]
        assert len({tuple(r.token_ids) for r in both}) > 1 and all(len(r.token_ids) == 24 for r in both)
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    finally:
        eng.close()


# -- the vocabulary split (engine.tp_vocab_parallel) ----------------------------------------------------------------
@pytest.mark.parametrize("tied", [False, True])
def test_a_vocab_split_rank_holds_its_rows_padded_whether_loaded_or_random(tiny, tied):
    cfg = dataclasses.replace(tiny.config, vocab_size=511, tie_word_embeddings=tied)  # odd: the last rank pads
    full = LlamaModel(cfg, torch.float32, "cpu")
    full.init_random(seed=5)
    weights = hf_weights(full)
    if tied:
        del weights["lm_head.weight"]
    for rank in range(2):
        drawn = LlamaModel(cfg, torch.float32, "cpu", Shard(rank, 2), vocab_parallel=True)
        drawn.init_random(seed=5)
        loaded = LlamaModel(cfg, torch.float32, "cpu", Shard(rank, 2), vocab_parallel=True)
        loaded.load_weights(weights.items())
        assert (loaded.vocab_rows, loaded.vocab_start) == (256, 256 * rank)
        rows = slice(256 * rank, 256 * rank + 256)
        for part in (drawn, loaded):
            assert part.embed_tokens.shape == (256, cfg.hidden_size)
            n = 256 if rank == 0 else 255
            assert torch.equal(part.embed_tokens[:n], full.embed_tokens[rows])
            assert torch.equal(part.lm_head[:n], full.lm_head[rows])
            if rank == 1:  # the padding row: zero, so its logit is 0 and it is cut before the sampler
                assert not part.embed_tokens[255].any() and not part.lm_head[255].any()
            assert (part.lm_head is part.embed_tokens) == tied
        # the other matrices' split is unchanged by the vocabulary's
        assert torch.equal(drawn.layers[0].qkv, loaded.layers[0].qkv)


def test_tp2_with_the_vocab_split_gives_tp1s_logits_and_greedy_tokens(tiny, single, no_pair):
    """Each rank looks up only its ids' embedding rows (summed over the ranks) and computes its logits' columns
    (all-gathered): the same function as one rank's, with one more all-reduce and a gather a step."""
    one = step_logits(single, PROMPTS, steps=6)
    one_tokens = single.generate(PROMPTS, GREEDY)
    eng = LLMEngine(tiny, engine_cfg(2, tp_vocab_parallel=True))
    try:
        assert eng.runner.model.vocab_parallel and eng.runner.model.embed_tokens.shape[0] == 256
        two = step_logits(eng, PROMPTS, steps=6)
        assert one[0].shape == two[0].shape == (len(PROMPTS), 512)
        diffs = [float((a - b).abs().max()) for a, b in zip(one, two)]
        assert max(diffs) < LOGIT_TOL, diffs
        assert [r.token_ids for r in eng.generate(PROMPTS, GREEDY)] == [r.token_ids for r in one_tokens]
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    finally:
        eng.close()

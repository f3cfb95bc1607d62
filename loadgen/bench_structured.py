"""``tokenmill bench structured``: what grammar-constrained decoding costs, on SmolLM2's tokenizer (49,152 tokens).

Two parts, one run:

- **libraries**: llguidance (what the engine uses) against xgrammar (vLLM's default), when xgrammar is importable:
  the time to build the tokenizer info, to compile each of the five JSON schemas below (llguidance builds lazily,
  so its figure includes the first mask), and the time to fill one row's token bitmask, per step, while 32 rows
  walk valid instances of the schemas token by token: one by one, in parallel (llguidance's executor), and in
  parallel while another thread runs Python, as a worker's asyncio and detokenizer threads do (the fill gives the
  GIL up and waits to take it back, up to a switch interval).
- **engine**: the real engine step at batch 32, every row decoding, with no row constrained against every row
  constrained (the five schemas, each wrapped in an array of at least 8 items so no row finishes inside the
  window). The forward is the same work in both, so the constrained cost is the growth of the median step, end to
  end. A round is one window of each, back to back (in turn free first and constrained first), and the cost is the
  median round's ratio: a host whose speed drifts during the run (a ~1 ms host-bound step of a small model on a
  GPU host moves by tens of percent) moves both windows of a round alike. The target: constrained rows cost less
  than 10% of an unconstrained step. Beside it, the host's update (mask fill, mask applied in the sampler, matchers
  advanced, and any wait for the device) is timed on its own, and a table splits the step into its phases: with
  async scheduling the host's extra work can take the place of time it spent waiting for the GPU, so the update's
  growth alone can understate the cost.

Run: ``tokenmill bench structured [--steps 32] [--rounds 2] [--dtype bfloat16] [--temperature 1]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from common.cluster_config import ClusterConfig

TARGET_OVERHEAD = 0.10
BATCH = 32

# Five schemas of the kinds callers send: flat records, nested arrays of objects, enums, patterns, nullable fields.
# Strings and arrays are bounded, so every output that follows a schema ends within a few hundred tokens.
SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 32}},
        "required": ["name", "age", "email"], "additionalProperties": False},
    "order": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99999},
        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "properties": {"sku": {"type": "string", "maxLength": 8},
                                             "qty": {"type": "integer", "minimum": 1, "maximum": 20}},
            "required": ["sku", "qty"], "additionalProperties": False}},
        "paid": {"type": "boolean"}},
        "required": ["id", "items", "paid"], "additionalProperties": False},
    "weather": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "temps": {"type": "array", "maxItems": 4, "items": {"type": "integer", "minimum": -50, "maximum": 50}}},
        "required": ["city", "unit", "temps"], "additionalProperties": False},
    "sentiment": {"type": "object", "properties": {
        "label": {"enum": ["positive", "negative", "neutral"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 100},
        "keywords": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 16}}},
        "required": ["label", "score", "keywords"], "additionalProperties": False},
    "event": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 30},
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "attendees": {"type": "array", "maxItems": 2, "items": {
            "type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                             "role": {"enum": ["host", "guest"]}},
            "required": ["name", "role"], "additionalProperties": False}},
        "location": {"anyOf": [{"type": "string", "maxLength": 20}, {"type": "null"}]}},
        "required": ["title", "date", "attendees", "location"], "additionalProperties": False},
}
# one valid instance of each, written as the model writes JSON: the rows the library part walks
INSTANCES: dict[str, Any] = {
    "person": {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com"},
    "order": {"id": 42, "items": [{"sku": "AB-1", "qty": 2}, {"sku": "ZZ9", "qty": 1}], "paid": True},
    "weather": {"city": "Paris", "unit": "celsius", "temps": [12, 14, -3]},
    "sentiment": {"label": "positive", "score": 92, "keywords": ["great", "fast"]},
    "event": {"title": "Launch party", "date": "2026-11-27",
              "attendees": [{"name": "Bob", "role": "host"}, {"name": "Eve", "role": "guest"}], "location": None},
}


def _walks(tok: Any, eos: int) -> dict[str, list[int]]:
    return {k: [*tok.encode(json.dumps(v, separators=(", ", ": ")), add_special_tokens=False), eos]
            for k, v in INSTANCES.items()}


def bench_llguidance(tok: Any, vocab: int, eos: int) -> dict[str, Any]:
    import llguidance as llg
    import torch

    from common.grammar_proc import make_tokenizer
    from common.structured import _JSON_OPTIONS

    words = (vocab + 31) // 32
    t = time.perf_counter()
    lltok = make_tokenizer(tok.tk.to_str(), vocab, [eos])
    init = time.perf_counter() - t
    grammars, compile_s = {}, {}
    one = torch.empty(1, words, dtype=torch.int32)
    for k, s in SCHEMAS.items():
        t = time.perf_counter()
        g = llg.LLMatcher.grammar_from_json_schema(s, defaults=_JSON_OPTIONS)
        m = llg.LLMatcher(lltok, g)
        m.unsafe_compute_mask_ptr(one.data_ptr(), words * 4)  # built lazily: the first mask is part of it
        compile_s[k] = time.perf_counter() - t
        assert not m.is_error(), m.get_error()
        grammars[k] = g
    walks = _walks(tok, eos)
    names = [list(SCHEMAS)[i % len(SCHEMAS)] for i in range(BATCH)]
    ms = [llg.LLMatcher(lltok, grammars[n]) for n in names]
    bm = torch.empty(BATCH, words, dtype=torch.int32)
    ex = llg.LLExecutor()
    serial, par = [], []
    for step in range(max(len(w) for w in walks.values()) - 1):
        live = [(i, m) for i, m in enumerate(ms) if step < len(walks[names[i]]) - 1]
        t = time.perf_counter()
        for i, m in live:
            m.unsafe_compute_mask_ptr(bm.data_ptr() + i * words * 4, words * 4)
        serial.append((time.perf_counter() - t) / len(live))
        t = time.perf_counter()
        ex.unsafe_compute_mask_ptr([(m, i) for i, m in live], bm.data_ptr(), words * 4, BATCH)
        par.append((time.perf_counter() - t) / len(live))
        for i, m in live:
            tk = walks[names[i]][step]
            assert (int(bm[i, tk // 32]) >> (tk % 32)) & 1 and m.consume_token(tk), (names[i], step)
    # the same parallel fills while another thread runs Python, as a worker's asyncio and detokenizer threads do:
    # the fill gives the GIL up and waits to take it back, up to a switch interval
    ms = [llg.LLMatcher(lltok, grammars[n]) for n in names]
    stop, spins = threading.Event(), [0]

    def spin() -> None:
        while not stop.is_set():
            spins[0] += 1

    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    contended = []
    try:
        for step in range(max(len(w) for w in walks.values()) - 1):
            live = [(i, m) for i, m in enumerate(ms) if step < len(walks[names[i]]) - 1]
            t = time.perf_counter()
            ex.unsafe_compute_mask_ptr([(m, i) for i, m in live], bm.data_ptr(), words * 4, BATCH)
            contended.append((time.perf_counter() - t) / len(live))
            for i, m in live:
                assert m.consume_token(walks[names[i]][step])
    finally:
        stop.set()
        spinner.join()
    return {"library": f"llguidance {llg.__version__}", "tokenizer_info_s": init, "compile_s": compile_s,
            "fill_us_mean": statistics.mean(serial) * 1e6, "fill_us_p50": statistics.median(serial) * 1e6,
            "fill_us_max": max(serial) * 1e6, "fill_par_us_mean": statistics.mean(par) * 1e6,
            "fill_par_busy_us_mean": statistics.mean(contended) * 1e6, "switch_interval_ms": sys.getswitchinterval() * 1e3}


def bench_batches(tok: Any, vocab: int, eos: int, gap_s: float = 1e-3, reps: int = 200,
                  sizes: tuple[int, ...] = (1, 2, 3, 4, 8), pools: tuple[int, ...] = (0, 2, 4)) -> dict[str, Any]:
    """A batch of k llguidance masks as the mask process fills them between decode steps (``gap_s`` apart, so a
    pool's threads go idle as they do there): one after the other on this thread, and on ``LLExecutor`` pools of
    n threads (0: llguidance's default). Each batch's rows: copies of the five schemas' matchers, walked to
    different places of their instances. Returns µs per batch, p50 and p90, by k and fill."""
    import llguidance as llg
    import numpy as np

    from common.grammar_proc import make_tokenizer
    from common.structured import _JSON_OPTIONS

    words = (vocab + 31) // 32
    lltok = make_tokenizer(tok.tk.to_str(), vocab, [eos])
    bases = {k: llg.LLMatcher(lltok, llg.LLMatcher.grammar_from_json_schema(s, defaults=_JSON_OPTIONS), log_level=0)
             for k, s in SCHEMAS.items()}
    walks, names = _walks(tok, eos), list(SCHEMAS)
    bm = np.zeros((max(sizes), words), dtype=np.int32)

    def rows(k: int, rep: int) -> list[tuple[Any, int]]:
        out = []
        for i in range(k):
            w = walks[names[i % len(names)]]
            m = bases[names[i % len(names)]].deep_copy()
            for t in w[: (rep * 7 + i * 3) % (len(w) - 1)]:
                assert m.consume_token(t)
            out.append((m, i))
        return out

    def timed(k: int, ex: Any, n: int) -> tuple[float, float]:
        ts = []
        for rep in range(n):
            rs = rows(k, rep)
            time.sleep(gap_s)
            t = time.perf_counter()
            if ex is None:
                for m, i in rs:
                    m.unsafe_compute_mask_ptr(bm.ctypes.data + i * words * 4, words * 4)
            else:
                ex.unsafe_compute_mask_ptr(rs, bm.ctypes.data, words * 4, k)
            ts.append((time.perf_counter() - t) * 1e6)
        ts.sort()
        return ts[len(ts) // 2], ts[int(len(ts) * 0.9)]

    timed(max(sizes), None, reps)  # the lexers' states built, as in a running mask process
    fills: dict[str, Any] = {"serial": None, **{f"pool {n or 'default'}": llg.LLExecutor(n or None) for n in pools}}
    out: dict[str, dict[int, tuple[float, float]]] = {name: {} for name in fills}
    for i, k in enumerate(sizes):
        print(f"  batches of {k} masks ({i + 1}/{len(sizes)}) ...", flush=True)
        for name, ex in fills.items():
            out[name][k] = timed(k, ex, reps)
    return {"gap_ms": gap_s * 1e3, "reps": reps, "us_p50_p90": out}


# documents of long lists (an extraction's output): a list of up to 50 records, 8-30 in each document
PEOPLE = {"type": "object", "properties": {"people": {"type": "array", "minItems": 1, "maxItems": 50, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                     "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                     "city": {"type": "string", "maxLength": 20}},
    "required": ["name", "age", "city"], "additionalProperties": False}}},
    "required": ["people"], "additionalProperties": False}
_NAMES = ("Ada Lovelace", "Alan Turing", "Grace Hopper", "Edsger Dijkstra", "Barbara Liskov", "Donald Knuth",
          "Ken Thompson", "Dennis Ritchie", "Margaret Hamilton", "John Backus", "Frances Allen", "Tim Berners-Lee")
_CITIES = ("London", "Paris", "New York", "Zurich", "Berlin", "Austin", "Boston", "Oslo", "Kyoto", "Lima")


def bench_places(tok: Any, vocab: int, eos: int, documents: int = 16) -> dict[str, Any]:
    """The mask process's cache of masks by place (``common/mask_cache.py``) against llguidance alone, one row
    walking ``documents`` seeded documents of :data:`PEOPLE` token by token: each mask from the cache where it has
    one, else llguidance's (kept for later rows); and every mask llguidance's."""
    import llguidance as llg
    import numpy as np

    from common.grammar_proc import make_tokenizer
    from common.mask_cache import MaskCache, PlaceKeys, token_bytes_of, token_reach
    from common.structured import _JSON_OPTIONS

    words = (vocab + 31) // 32
    lltok = make_tokenizer(tok.tk.to_str(), vocab, [eos])
    token_bytes = token_bytes_of(lltok)
    text = llg.LLMatcher.grammar_from_json_schema(PEOPLE, defaults=_JSON_OPTIONS)
    rng = random.Random(1)
    docs = [tok.encode(json.dumps({"people": [{"name": rng.choice(_NAMES), "age": rng.randint(18, 99),
                                               "city": rng.choice(_CITIES)} for _ in range(rng.randint(8, 30))]},
                                  separators=(", ", ": ")), add_special_tokens=False) for _ in range(documents)]
    row = np.zeros(words, dtype=np.int32)
    base = llg.LLMatcher(lltok, text)
    cache, keys = MaskCache(words), PlaceKeys(token_bytes, token_reach(token_bytes, vocab))
    seconds = {"cache": 0.0, "llguidance": 0.0}
    hits = 0
    for ids in docs:
        cached, alone = base.deep_copy(), base.deep_copy()
        keys.add(0, text, [])
        for t in ids:
            t0 = time.perf_counter()
            key, kept = keys.cached(0, cache)
            if kept is not None:
                row[:] = kept
                hits += 1
            else:
                cached.unsafe_compute_mask_ptr(row.ctypes.data, words * 4)
                if key is not None:
                    cache.put(key, row)
            t1 = time.perf_counter()
            alone.unsafe_compute_mask_ptr(row.ctypes.data, words * 4)
            seconds["llguidance"] += time.perf_counter() - t1
            seconds["cache"] += t1 - t0
            assert cached.consume_token(t) and alone.consume_token(t)
            keys.advance(0, t, True)
        keys.drop(0)
    masks = sum(map(len, docs))
    return {"documents": documents, "masks": masks, "cached_share": hits / masks,
            "ms_cache": seconds["cache"] * 1e3, "ms_llguidance": seconds["llguidance"] * 1e3}


def bench_xgrammar(tok: Any, vocab: int, eos: int) -> dict[str, Any] | None:
    try:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    t = time.perf_counter()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok.tk, eos_token=tok.eos_token)
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    init = time.perf_counter() - t
    compiled, compile_s = {}, {}
    for k, s in SCHEMAS.items():
        t = time.perf_counter()
        compiled[k] = compiler.compile_json_schema(json.dumps(s), any_whitespace=False, separators=(", ", ": "))
        compile_s[k] = time.perf_counter() - t
    walks = _walks(tok, eos)
    names = [list(SCHEMAS)[i % len(SCHEMAS)] for i in range(BATCH)]
    ms = [xgr.GrammarMatcher(compiled[n]) for n in names]
    bm = xgr.allocate_token_bitmask(BATCH, vocab)
    serial = []
    for step in range(max(len(w) for w in walks.values()) - 1):
        live = [(i, m) for i, m in enumerate(ms) if step < len(walks[names[i]]) - 1]
        t = time.perf_counter()
        for i, m in live:
            m.fill_next_token_bitmask(bm, i)
        serial.append((time.perf_counter() - t) / len(live))
        for i, m in live:
            tk = walks[names[i]][step]
            assert (int(bm[i, tk // 32]) >> (tk % 32)) & 1 and m.accept_token(tk), (names[i], step)
    return {"library": f"xgrammar {getattr(xgr, '__version__', '')}".strip(), "tokenizer_info_s": init,
            "compile_s": compile_s, "fill_us_mean": statistics.mean(serial) * 1e6,
            "fill_us_p50": statistics.median(serial) * 1e6, "fill_us_max": max(serial) * 1e6,
            "fill_par_us_mean": None, "fill_par_busy_us_mean": None}


def _long_schema(s: dict[str, Any]) -> str:
    """The schema as an array of at least 8 such objects: a row stays inside its grammar for the whole window."""
    return json.dumps({"type": "array", "items": s, "minItems": 8, "maxItems": 16})


def bench_engine(dtype: str, steps: int, rounds: int, temperature: float = 0.0, device: str = "cpu",
                 model: str | None = None, grammar_process: bool = False, threads: int = 0,
                 constrained_pick: str = "default", time_advance: bool = False,
                 tokenizer: str = "smollm2") -> dict[str, Any]:
    import torch

    from common import sampler as sampler_mod
    from common.config import EngineConfig
    from common.engine import LLMEngine
    from common.grammar_proc import MaskProcess
    from common.loader import load_model_source
    from common.sampling import SamplingParams, StructuredOutput
    from common.structured import GrammarMatcher, MaskTable

    t0 = time.perf_counter()
    cfg = EngineConfig(device=device, dtype=dtype, max_num_seqs=BATCH, kv_cache_memory=512 << 20,  # type: ignore[arg-type]
                       grammar_process=grammar_process, grammar_threads=threads,
                       async_scheduling=True if constrained_pick == "deferred" else None,
                       async_constrained={"default": None, "deferred": True, "sync": False}[constrained_pick])
    # a dummy (random weights at a real size) samples the tokenizer's ids (SmolLM2's by default), as the grammars do
    eng = LLMEngine(load_model_source(model, tokenizer if model and model.startswith("dummy:") else None), cfg)
    deferred = eng.async_scheduling and cfg.async_constrained is not False
    print(f"  engine ready in {time.perf_counter() - t0:.1f} s", flush=True)
    tok = eng.tokenizer
    assert tok is not None
    names = list(SCHEMAS)
    # short prompts: the window measures decode steps, and a prefill of 32 long prompts would cost more than it.
    # Each window's prompts and seeds are its own, so no window writes what an earlier one wrote: the mask process
    # keeps masks by place (common/mask_cache.py), and a window that repeated the last one's outputs would find
    # every one of them there
    windows = itertools.count()
    update_s: list[float] = []
    update = [0.0]  # this step's host work on outputs: the last step's tokens handed out, this one's pick queued
    # where a constrained step's extra time goes: the host's mask fill and the matchers' advance, per step
    parts = {"fill": 0.0, "advance": 0.0}
    fill_s: list[float] = []
    advance_s: list[float] = []
    # where a step's host time goes, phase by phase, and the GPU's forward (events around the launch)
    phase: dict[str, float] = {}
    phase_steps: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    gpu_marks: list[tuple[Any, Any]] = []
    cuda = eng.runner.device.type == "cuda"
    # (object, attribute, what it was, the timed one): on in the windows that time the phases, off in those that
    # time the steps end to end (each timer costs the host ~1 µs a call, and a constrained step makes more calls)
    patched: list[tuple[Any, str, Any, Any]] = []

    def patch(obj: Any, name: str, wrap: Any) -> None:
        real = getattr(obj, name)
        patched.append((obj, name, real, wrap(real)))

    def instrument(on: bool) -> None:
        for obj, name, real, timed_fn in (patched if on else reversed(patched)):
            setattr(obj, name, timed_fn if on else real)

    def into(acc: dict[str, float], name: str) -> Any:
        """A wrapper that adds its call's time to ``acc[name]``."""
        def wrap(fn: Any) -> Any:
            def run(*args: Any, **kw: Any) -> Any:
                t = time.perf_counter()
                try:
                    return fn(*args, **kw)
                finally:
                    acc[name] = acc.get(name, 0.0) + time.perf_counter() - t
            return run
        return wrap

    depth = [0]

    def timed(fn: Any) -> Any:
        """``fn`` with its time added to the step's update, unless it runs inside another timed call (``_launch``
        queues the pick through ``_queue_pick``; with async_constrained ``step`` calls ``_queue_pick`` itself)."""
        def run(*args: Any) -> Any:
            if depth[0]:
                return fn(*args)
            depth[0] += 1
            t = time.perf_counter()
            try:
                return fn(*args)
            finally:
                update[0] += time.perf_counter() - t
                depth[0] -= 1
        return run

    def step_timed(real_step: Any) -> Any:
        def run() -> Any:
            parts["fill"] = parts["advance"] = update[0] = 0.0
            phase.clear()
            res = real_step()
            update_s.append(update[0])
            fill_s.append(parts["fill"])
            advance_s.append(parts["advance"])
            return res
        return run

    def gpu_marked(real_execute: Any) -> Any:
        def run(*args: Any) -> Any:
            if not cuda:
                return real_execute(*args)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = real_execute(*args)
            b.record()
            gpu_marks.append((a, b))
            return out
        return run

    patch(eng, "step", step_timed)
    patch(eng, "_resolve", lambda f: into(phase, "tokens handed out")(timed(f)))
    patch(eng, "_launch", timed)
    patch(eng, "_queue_pick", lambda f: into(phase, "pick queued")(timed(f)))
    patch(eng.scheduler, "schedule", into(phase, "schedule"))
    patch(eng.runner, "stage", into(phase, "stage"))
    patch(eng.runner, "execute", lambda f: into(phase, "launch")(gpu_marked(f)))
    patch(sampler_mod.PendingSample, "result", into(phase, "wait for the device"))
    # inside the pick: the masks (their fill, or the wait for the mask process, and each row's row of the table),
    # the small uploads, the token readback, and the kernels' launches
    for k in ("_fill", "_device_masks"):
        patch(sampler_mod.Sampler, k, into(phase, f"pick: Sampler.{k}"))
    patch(sampler_mod._PickGraphs, "run", into(phase, "pick: the graph's loads and replay"))
    patch(sampler_mod._Readback, "__call__", into(phase, "pick: readback queued"))
    for k in ("tensor", "copy_into"):
        patch(sampler_mod.PinnedUploads, k, into(phase, "pick: pinned uploads"))
    ops = sampler_mod._cuda_ops(eng.runner.device)
    for k in ("masked_argmax", "apply_token_bitmask_") if ops is not None else ():
        patch(ops, k, into(phase, f"pick: triton_ops.{k}"))
    patch(MaskTable, "fill", into(parts, "fill"))
    patch(MaskProcess, "flush", into(parts, "advance"))
    if time_advance:  # two timer reads a row: host work that only constrained steps would carry
        patch(GrammarMatcher, "consume", into(parts, "advance"))
        patch(GrammarMatcher, "send", into(parts, "advance"))

    def window(constrained: bool, tag: str, n: int, timed_phases: bool = True) -> tuple[list[float], list[float]]:
        """``n`` steps of a batch of new requests; with ``timed_phases`` the phase timers are on (their steps' times
        carry the timers' cost), without, the steps' times are the engine's own."""
        instrument(timed_phases)
        w = next(windows)
        for i in range(BATCH):
            ids = tok.encode(f"JSON {names[i % 5]} records, batch {w * BATCH + i}:")
            so = StructuredOutput("json_schema", _long_schema(SCHEMAS[names[i % 5]])) if constrained else None
            eng.add_request(f"{tag}-{i}", ids, SamplingParams(max_tokens=steps + 4, temperature=temperature,
                                                              seed=w * BATCH + i, ignore_eos=True, structured=so))
        while any(not s.output_ids for s in eng._seqs.values()):  # prefills (and their first tokens)
            eng.step()
        times: list[float] = []
        update_s.clear()
        fill_s.clear()
        advance_s.clear()
        if masks is not None:
            masks.read_answers()  # the last window's, left out
            masks.batch_times.clear()
        gpu_marks.clear()
        for _ in range(n):
            t = time.perf_counter()
            outs = eng.step()
            times.append(time.perf_counter() - t)
            if timed_phases:
                phase_steps[constrained].append({**phase, "step": times[-1], "mask fill (or wait and copy)":
                                                 parts["fill"], ("matchers' advance and send" if time_advance else
                                                                 "send to the mask process"): parts["advance"]})
            assert len(outs) == BATCH and not any(o.finished for o in outs), "a row left the batch"
        instrument(False)
        if cuda and timed_phases:  # the GPU's forward, and the time from one forward's start to the next one's
            torch.cuda.synchronize()
            for k, (a, b) in enumerate(gpu_marks):
                phase_steps[constrained][k - len(gpu_marks)]["GPU: forward"] = a.elapsed_time(b) / 1e3
                if k:
                    phase_steps[constrained][k - len(gpu_marks)]["GPU: forward start to start"] = (
                        gpu_marks[k - 1][0].elapsed_time(a) / 1e3)
        upd = list(update_s)
        if constrained and timed_phases:
            masked_fill.extend(fill_s)
            masked_advance.extend(advance_s)
            if masks is not None:
                masks.read_answers()
                child_times.extend(masks.batch_times)
        print(f"  {tag}: median step {statistics.median(times) * 1e3:.1f} ms", flush=True)
        for i in range(BATCH):
            eng.abort(f"{tag}-{i}")
        return times, upd

    masked_fill: list[float] = []
    masked_advance: list[float] = []
    child_times: list[tuple[float, float, float, int]] = []  # the mask process's batches (MaskProcess.batch_times)
    masks: Any = None  # the engine's MaskProcess, once its child is ready
    try:
        with torch.inference_mode():
            window(False, "warm-a", 1)
            window(True, "warm-b", 1)
            masks = eng.grammars.masks
            if masks is not None:  # matchers made before the child was ready stay inline: time the ones after
                assert masks.wait_ready(), "the grammar mask process did not start"
                masks.read_answers()
                masks.remote_rows = masks.inline_rows = masks.cached_rows = 0
            masked_fill.clear()
            masked_advance.clear()
            child_times.clear()
            plain: list[float] = []
            masked: list[float] = []
            plain_u: list[float] = []
            masked_u: list[float] = []
            round_ratios: list[float] = []  # per round: its constrained window's median step ÷ its free window's
            for r in range(rounds):
                got = {}
                # the end-to-end windows (no timers), ABBA so drift cancels in pairs; then the two with the phases
                # timed
                for constrained in ((False, True) if r % 2 == 0 else (True, False)):
                    t, _ = window(constrained, f"{'masked' if constrained else 'plain'}-{r}", steps, False)
                    (masked if constrained else plain).extend(t)
                    got[constrained] = statistics.median(t)
                round_ratios.append(got[True] / got[False] - 1.0)
                for constrained in ((True, False) if r % 2 == 0 else (False, True)):
                    _, u = window(constrained, f"{'masked' if constrained else 'plain'}-{r}-timed", steps)
                    (masked_u if constrained else plain_u).extend(u)
    finally:
        instrument(False)
    med = statistics.median
    extra = med(masked_u) - med(plain_u)  # the mask fill, its application and the matchers' advance
    phases = {}
    for c in (False, True):
        rows = phase_steps[c][-len(plain_u):]  # the timed steps (the warm-up windows came first)
        keys = dict.fromkeys(k for r in rows for k in r)
        phases["constrained" if c else "none"] = {k: med(r.get(k, 0.0) for r in rows) * 1e3 for k in keys}
    if masks is not None:
        assert masks.remote_rows and not masks.inline_rows, (masks.remote_rows, masks.inline_rows)
        masks.read_answers()
    eng.close()
    return {"model": model or "SmolLM2-135M-Instruct", "dtype": dtype, "temperature": temperature, "batch": BATCH,
            "fill": "process" if masks is not None else "inline", "steps": len(plain),
            "async_scheduling": eng.async_scheduling, "pick": "deferred" if deferred else "sync", "phases_ms": phases,
            "step_ms_plain": med(plain) * 1e3,
            "step_ms_constrained": med(masked) * 1e3, "update_ms_plain": med(plain_u) * 1e3,
            "update_ms_constrained": med(masked_u) * 1e3, "overhead": extra / med(plain),
            # the cost: the median round's ratio (each round's two windows ran back to back, so a host whose speed
            # drifts over the run moves both alike); the pooled medians' ratio beside it
            "end_to_end": med(round_ratios), "round_ratios": round_ratios,
            "end_to_end_pooled": med(masked) / med(plain) - 1.0,
            "fill_ms": med(masked_fill) * 1e3, "advance_ms": med(masked_advance) * 1e3,
            "advance_timed": time_advance,
            "child_read_ms": med(c[0] for c in child_times) * 1e3 if child_times else None,
            "child_fill_ms": med(c[1] for c in child_times) * 1e3 if child_times else None,
            "child_fill_p90_ms": (sorted(c[1] for c in child_times)[int(0.9 * len(child_times))] * 1e3
                                  if child_times else None),
            # the process's advance of its matchers (median), and its batches' fill (advance included) by whether
            # llguidance computed any of their masks (the rest came from the cache): the share of such batches,
            # their p50 / p90, and the others' p90
            "child_advance_ms": med(c[2] for c in child_times) * 1e3 if child_times else None,
            **_fill_by_computed(child_times),
            # of the rows the process served, the share it took from its masks by place (common/mask_cache.py)
            "child_cached_share": masks.cached_rows / masks.remote_rows if masks is not None and masks.remote_rows
            else None}


def _fill_by_computed(child_times: list[tuple[float, float, float, int]]) -> dict[str, float | None]:
    """The mask process's batches split by whether llguidance computed a mask of theirs: the share that did, their
    fill p50 / p90 and the others' p90 (ms); the mean of masks it computed a batch."""
    some = sorted(c[1] for c in child_times if c[3])
    none = sorted(c[1] for c in child_times if not c[3])

    def q(xs: list[float], f: float) -> float | None:
        return xs[int(f * len(xs))] * 1e3 if xs else None

    return {"child_llg_share": len(some) / len(child_times) if child_times else None,
            "child_llg_rows_mean": statistics.fmean(c[3] for c in child_times) if child_times else None,
            "child_fill_llg_p50_ms": q(some, 0.5), "child_fill_llg_p90_ms": q(some, 0.9),
            "child_fill_cached_p90_ms": q(none, 0.9)}


def run(a: argparse.Namespace) -> int:
    from common.loader import load_tokenizer
    from common.machine import default_dtype

    # as a decode worker runs its engine: the GIL switch interval of the workers (common/worker.py)
    sys.setswitchinterval(a.switch_interval_ms / 1000)
    tok = load_tokenizer(a.tokenizer)
    eos = tok.tk.token_to_id(tok.eos_token) if tok.eos_token else None
    if eos is None:
        raise SystemExit(f"the tokenizer {a.tokenizer!r} names no EOS token")
    vocab = tok.vocab_size
    libs = [bench_llguidance(tok, vocab, eos)]
    xg = None if a.skip_libraries else bench_xgrammar(tok, vocab, eos)
    print(f"tokenizer {a.tokenizer}: {vocab} tokens; {os.cpu_count()} cores ({platform.processor() or platform.machine()})")
    print()
    print("| library | tokenizer info ms | compile ms: " + " / ".join(SCHEMAS) + " | total | fill µs/row mean | "
          f"p50 | max | parallel fill µs/row | the same beside a Python thread ({a.switch_interval_ms:g} ms switch) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in [*libs, *([xg] if xg else [])]:
        c = " / ".join(f"{r['compile_s'][k] * 1e3:.1f}" for k in SCHEMAS)
        par = f"{r['fill_par_us_mean']:.1f}" if r["fill_par_us_mean"] is not None else "-"
        busy = f"{r['fill_par_busy_us_mean']:.1f}" if r["fill_par_busy_us_mean"] is not None else "-"
        print(f"| {r['library']} | {r['tokenizer_info_s'] * 1e3:.0f} | {c} | {sum(r['compile_s'].values()) * 1e3:.1f}"
              f" | {r['fill_us_mean']:.1f} | {r['fill_us_p50']:.1f} | {r['fill_us_max']:.0f} | {par} | {busy} |")
    if xg is None:
        print("(xgrammar left out: " + ("--skip-libraries)" if a.skip_libraries else "not installed)"))
    places = batches = None
    if not a.skip_libraries:
        places = bench_places(tok, vocab, eos)
        print(f"\nmasks by place, one row through {places['documents']} documents of long lists (8-30 records): "
              f"{places['masks']} masks, {places['cached_share'] * 100:.0f}% from the cache; the cache and "
              f"llguidance {places['ms_cache']:.0f} ms, llguidance alone {places['ms_llguidance']:.0f} ms")
        print("\na batch of k llguidance masks, filled 1 ms after the last (as between decode steps) ...", flush=True)
        batches = bench_batches(tok, vocab, eos)
        fills = list(batches["us_p50_p90"])
        print("| k | " + " | ".join(f"{f} µs p50 / p90" for f in fills) + " |\n|---|" + "---|" * len(fills))
        for k in batches["us_p50_p90"]["serial"]:
            print(f"| {k} | " + " | ".join("{:.0f} / {:.0f}".format(*batches["us_p50_p90"][f][k]) for f in fills) + " |")
    dtype = a.dtype or default_dtype(a.device)
    print(f"\nengine step at batch {BATCH} on {a.device} ({a.model or 'SmolLM2-135M-Instruct'}, {dtype}, temperature {a.temperature}, {a.steps} steps × "
          f"{a.rounds} "
          f"rounds each) ...", flush=True)
    modes = {"inline": [False], "process": [True], "both": [False, True]}[a.fill]
    runs = []
    for mode in modes:
        print(f"  masks filled {'in the grammar mask process' if mode else 'inline'}", flush=True)
        runs.append(bench_engine(dtype, a.steps, a.rounds, a.temperature, a.device, a.model, grammar_process=mode,
                                 threads=a.grammar_threads, constrained_pick=a.constrained_pick,
                                 time_advance=a.time_advance, tokenizer=a.tokenizer))
    print()
    print("| batch | dtype | temperature | masks filled | pick | step ms: none constrained | all constrained | "
          "update ms (sample + stop checks): none | all | mask fill (or wait and copy) ms | advance (and send) ms | "
          "process: read after sending ms | its fill ms p50 / p90 | its masks by place | update growth ÷ step | "
          "constrained cost: step growth, end to end | target |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for e in runs:
        child = (f"{e['child_read_ms']:.3f} | {e['child_fill_ms']:.3f} / {e['child_fill_p90_ms']:.3f} | "
                 f"{e['child_cached_share'] * 100:.0f}%" if e.get("child_read_ms") is not None else "- | - | -")
        print(f"| {e['batch']} | {e['dtype']} | {e['temperature']:g} | {e['fill']} | {e['pick']} | "
              f"{e['step_ms_plain']:.1f} | "
              f"{e['step_ms_constrained']:.1f} | {e['update_ms_plain']:.2f} | {e['update_ms_constrained']:.2f} | "
              f"{e['fill_ms']:.3f} | {e['advance_ms']:.3f}{'' if e['advance_timed'] else ' (send only)'} | {child} | "
              f"{e['overhead'] * 100:.1f}% | {e['end_to_end'] * 100:+.1f}% | < {TARGET_OVERHEAD * 100:.0f}% |")
    for e in runs:
        print(f"rounds' cost ({e['fill']}): " + ", ".join(f"{x * 100:+.1f}%" for x in e["round_ratios"])
              + f"; the pooled medians' {e['end_to_end_pooled'] * 100:+.1f}%")
    for e in runs:
        print(f"\nwhere a step's time goes (ms, medians; masks filled {e['fill']}, pick {e['pick']}):")
        print("| phase | none constrained | all constrained |\n|---|---|---|")
        none, con = e["phases_ms"]["none"], e["phases_ms"]["constrained"]
        for k in dict.fromkeys([*none, *con]):
            print(f"| {k} | {none.get(k, 0.0):.3f} | {con.get(k, 0.0):.3f} |")
    for e in runs:
        if e.get("child_advance_ms") is not None:
            def ms(x: float | None) -> str:
                return "-" if x is None else f"{x:.3f}"
            print(f"\nthe mask process: advance {ms(e['child_advance_ms'])} ms (median); "
                  f"{e['child_llg_share'] * 100:.0f}% of batches had masks from llguidance "
                  f"({e['child_llg_rows_mean']:.1f} a batch on average): fill p50 / p90 "
                  f"{ms(e['child_fill_llg_p50_ms'])} / {ms(e['child_fill_llg_p90_ms'])} ms; the others' p90 "
                  f"{ms(e['child_fill_cached_p90_ms'])} ms")
    e = runs[-1]
    met = e["end_to_end"] < TARGET_OVERHEAD
    print(f"\ntarget {'met' if met else 'NOT met'} (masks filled {e['fill']}): all 32 rows constrained make the step "
          f"{e['end_to_end'] * 100:+.1f}% longer (medians of {e['steps']} steps each; the update alone grew by "
          f"{e['overhead'] * 100:.1f}% of the step)")
    if a.output:
        Path(a.output).write_text(json.dumps({"libraries": [*libs, *([xg] if xg else [])], "places": places,
                                              "mask_batches": batches,
                                              "engine": runs}, indent=1))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("structured", help="structured outputs: grammar libraries and the constrained step's cost",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=32,
                   help="timed decode steps per window (default 32: the rows get past their first key and into the "
                        "strings, where most of a JSON output's masks are)")
    p.add_argument("--rounds", type=int, default=2, help="alternating windows of each kind (default 2)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="the engine's dtype (default: the machine's, as tokenmill up picks it)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="every row's temperature (default 0: greedy; 1 samples from the masked distribution)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="the engine's device (default cpu)")
    p.add_argument("--model", default=None, help="the engine's model (default: SmolLM2; dummy:NAME for random weights "
                   "at a real size, e.g. dummy:llama-3.2-1b, under SmolLM2's tokenizer)")
    p.add_argument("--tokenizer", default="smollm2",
                   help="the tokenizer the grammars are compiled for, and a dummy model's: SmolLM2's (default), a "
                        "GGUF or a Hugging Face directory with tokenizer.json")
    p.add_argument("--skip-libraries", action="store_true", help="leave out the xgrammar comparison")
    p.add_argument("--fill", choices=["inline", "process", "both"], default="both",
                   help="where the engine fills the masks: inline, in the grammar mask process "
                        "(common/grammar_proc.py), or both, one after the other (default)")
    p.add_argument("--switch-interval-ms", type=float, default=ClusterConfig().worker_switch_interval_ms or 5.0,
                   help="the GIL switch interval of the engine's process (default: the workers' "
                        "worker_switch_interval_ms, 0.5)")
    p.add_argument("--grammar-threads", type=int, default=0,
                   help="threads that fill a step's masks (engine.grammar_threads; default 0: llguidance's, 80%% "
                        "of the cores up to 32)")
    p.add_argument("--constrained-pick", choices=["default", "deferred", "sync"], default="default",
                   help="a constrained step's pick: deferred to the next step() call, its masks filling beside the "
                        "forward (engine.async_constrained, with async scheduling, on the CPU too), sync (handed out "
                        "before the step returns), or the engine's default (deferred wherever async scheduling is "
                        "on: one GPU)")
    p.add_argument("--time-advance", action="store_true",
                   help="also time each matcher's advance and send (two timer reads a row, on constrained steps "
                        "only: they add to the cost measured); without it the advance column is the send to the "
                        "mask process alone, and the matchers' advance shows in the hand-out phase")
    p.add_argument("--output", help="write the results as JSON here")
    p.set_defaults(func=run)

"""The streaming output filter's cost per output token, against the detokenizer's own and a CPU decode step.

Everything runs in this process on SmolLM2's real tokenizer, the way the decode worker's detokenizer thread runs it:
``OutputProcessor.process`` fed one token per call (one engine step's delta), for ``--streams`` streams of
``--tokens`` tokens of English prose, code and numbers. Rows: the processor without a filter (the baseline: incremental
detokenization, stop-string bookkeeping), then with the built-in ``PatternPolicy`` at growing word lists and with
regexes; the filter's own cost is a row's time less the baseline's. Times are the thread's CPU time (one thread does
this work; on a shared machine wall time would count other jobs), best of ``--repeats``. The last column sets it
against one decode step of the real model on this CPU at ``--batch`` sequences (wall time, measured in the same
run), per token of the batch.

Run: ``tokenmill bench output-filter [--tokens 2000] [--streams 8] [--batch 8]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path
from typing import NotRequired, TypedDict

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
    "metal type, oil-based ink and a wooden press adapted from wine making. Within fifty years presses ran in more "
    "than two hundred cities, and the price of a book fell by two thirds. Scholars could compare editions, "
    "merchants printed price lists, and reformers spread pamphlets faster than authorities could ban them. "
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"
    "Call 555-0100 for details, or write to the office at 12 Market Street before 5 p.m. on Friday. "
)
REGEXES = (r"\b\d{3}-\d{2}-\d{4}\b", r"(?i)\bpassword\s*[:=]\s*\S+", r"\b(?:\d[ -]?){13,16}\b",
           r"(?i)\bapi[_-]?key\b", r"sk-[A-Za-z0-9]{20,}")


def _words(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct blocked words that never occur in TEXT (so every stream runs to the end)."""
    rng = random.Random(seed)
    letters = "bcdfghjklmnpqrstvwxz"
    out: set[str] = set()
    while len(out) < n:
        out.add("".join(rng.choice(letters) for _ in range(rng.randint(5, 9))))
    return sorted(out)


def _time_processor(tok, ids: list[int], prompt: list[int], streams: int, policy) -> float:
    """CPU seconds per token of ``OutputProcessor.process`` over ``streams`` interleaved streams."""
    from common.output_processor import OutputProcessor
    from common.sampling import SamplingParams

    proc = OutputProcessor(tok)
    params = SamplingParams(stop=("<|endoftext|>",))
    for s in range(streams):
        proc.add(f"s{s}", prompt, params, policy=policy)
    t0 = time.thread_time()  # CPU time of this thread: a shared machine's other jobs do not count
    for t in ids:
        for s in range(streams):
            d = proc.process(f"s{s}", [t], False, None)
            assert d is not None and not d.filter_reason
    dt = time.thread_time() - t0
    return dt / (len(ids) * streams)


def _decode_step(batch: int, steps: int) -> float:
    """Seconds per decode step of SmolLM2 (float32, this CPU) at ``batch`` running sequences."""
    from common.config import EngineConfig
    from common.engine import LLMEngine
    from common.sampling import SamplingParams

    eng = LLMEngine.from_spec("smollm2", EngineConfig(max_num_seqs=batch))
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"r{i}", [1 + i, 504, 3458, 282, 260, 5170], params)
    while any(not o.new_token_ids for o in eng.step()):  # prefill done, everyone decoding
        pass
    for _ in range(3):
        eng.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    dt = (time.perf_counter() - t0) / steps
    eng.close()
    return dt


class _Row(TypedDict):
    """A policy's row of the table and of the JSON; the filter's columns are filled as the table is printed."""

    case: str
    us_per_token: float
    filter_us_per_token: NotRequired[float]
    filter_share_of_step: NotRequired[float]  # with a decode step measured


def run(a: argparse.Namespace) -> int:
    from common.loader import load_tokenizer
    from common.output_filter import PatternPolicy

    tok = load_tokenizer("smollm2")
    ids = tok.encode(TEXT * 200, add_special_tokens=False)[: a.tokens]
    prompt = tok.encode("Tell me something.")
    cases: list[tuple[str, PatternPolicy | None]] = [("no filter (baseline)", None)]
    for n in a.words:
        cases.append((f"{n} words", PatternPolicy(words=_words(n))))
    cases.append((f"{len(REGEXES)} regexes", PatternPolicy(regexes=REGEXES)))
    cases.append((f"{a.words[-1]} words + {len(REGEXES)} regexes", PatternPolicy(words=_words(a.words[-1]),
                                                                               regexes=REGEXES)))
    print(f"{len(ids)} tokens × {a.streams} streams per row, {a.repeats} repeats (best kept) ...", flush=True)
    best = [float("inf")] * len(cases)
    for _ in range(a.repeats):  # rows interleaved, so a busy moment of the machine hits them all alike
        for i, (_name, policy) in enumerate(cases):
            best[i] = min(best[i], _time_processor(tok, ids, prompt, a.streams, policy))
    rows: list[_Row] = [{"case": name, "us_per_token": t * 1e6} for (name, _), t in zip(cases, best, strict=True)]
    base = rows[0]["us_per_token"]
    step = None
    if a.batch > 0:
        print(f"decode step of SmolLM2 at batch {a.batch} ({a.steps} steps) ...", flush=True)
        step = _decode_step(a.batch, a.steps)
    per_step_tok = step / a.batch * 1e6 if step else None
    print()
    head = "| policy | processor CPU µs/token | filter CPU µs/token | filter ÷ no-filter processor |"
    sep = "|---|---|---|---|"
    if per_step_tok:
        head += f" filter ÷ decode step per token (batch {a.batch}) |"
        sep += "---|"
    print(head)
    print(sep)
    for r in rows:
        extra = r["us_per_token"] - base
        r["filter_us_per_token"] = extra
        line = f"| {r['case']} | {r['us_per_token']:.2f} | {extra:.2f} | {extra / base:.0%} |"
        if per_step_tok:
            r["filter_share_of_step"] = extra / per_step_tok
            line += f" {extra / per_step_tok:.3%} |"
        print(line)
    if step:
        print(f"\ndecode step at batch {a.batch}: {step * 1e3:.1f} ms ({per_step_tok:.0f} µs per token of the batch)")
    if a.output:
        Path(a.output).write_text(json.dumps({"cores": os.cpu_count(), "tokens": len(ids), "streams": a.streams,
                                              "decode_step_s": step, "batch": a.batch, "rows": rows}, indent=1))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("output-filter", help="the output filter's cost per token against the detokenizer's and a "
                       "decode step", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2000, help="output tokens per stream (default 2000)")
    p.add_argument("--streams", type=int, default=8, help="interleaved streams (default 8)")
    p.add_argument("--words", type=int, nargs="+", default=[10, 100, 1000],
                   help="word-list sizes, one row each (default 10 100 1000)")
    p.add_argument("--repeats", type=int, default=5, help="runs per row, the fastest kept (default 5)")
    p.add_argument("--batch", type=int, default=8, help="decode step batch for the last column (0: skip it)")
    p.add_argument("--steps", type=int, default=20, help="decode steps timed (default 20)")
    p.add_argument("--output", help="write the results as JSON here")
    p.set_defaults(func=run)

"""Sampling parameters and the batched sampler.

Randomness is a pure function of (request seed, output position): each row draws its noise from a generator
seeded with both, so a seeded request gives the same tokens alone, in any batch, and after preemption.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

_MASK = float("-inf")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request generation controls (the OpenAI fields plus the ones vLLM users rely on)."""

    max_tokens: int | None = 16  # None: up to the context limit
    temperature: float = 1.0  # 0 → greedy
    top_k: int = 0  # 0 or -1 → off
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # None: no logprobs; N ≥ 0: the sampled token's plus the top N alternatives
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    extra: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError naming the bad field, its value and the allowed range."""
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not (0.0 <= self.temperature <= 100.0) or math.isnan(self.temperature):
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off), 0 (off) or positive, got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (-2.0 <= v <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
        if not (0.0 < self.repetition_penalty <= 2.0):
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        for t in self.stop_token_ids:
            if not (0 <= t < vocab_size):
                raise ValueError(f"stop_token_ids contains {t}, outside the vocabulary [0, {vocab_size})")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if len(self.stop) > 16:
            raise ValueError(f"at most 16 stop strings are allowed, got {len(self.stop)}")


@dataclass(slots=True)
class SampleRow:
    """What the sampler needs to know about one row."""

    params: SamplingParams
    seed: int  # the request's seed (drawn at arrival when the request gave none)
    position: int  # index of the token being sampled among the outputs
    prompt_ids: list[int]
    output_ids: list[int]
    eos_ids: tuple[int, ...]


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    # per row: (sampled logprob, [(token id, logprob) × top-n]) or None
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


def _row_noise(seed: int, position: int, vocab: int) -> torch.Tensor:
    g = torch.Generator(device="cpu")
    g.manual_seed((seed * 1_000_003 + position) & 0x7FFF_FFFF_FFFF_FFFF)
    return torch.empty(vocab, dtype=torch.float32).exponential_(generator=g)


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> SampleResult:
    """Pick one token per row of ``logits`` ([N, V], float32). Does not modify ``logits``' owner."""
    n, vocab = logits.shape
    want_lp = [r.params.logprobs is not None for r in rows]
    raw_lp = torch.log_softmax(logits, dim=-1) if any(want_lp) else None
    x = logits.clone()
    for i, r in enumerate(rows):
        p = r.params
        if p.repetition_penalty != 1.0:
            ids = torch.tensor(sorted(set(r.prompt_ids) | set(r.output_ids)), dtype=torch.long, device=x.device)
            vals = x[i, ids]
            x[i, ids] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and r.output_ids:
            out = torch.tensor(r.output_ids, dtype=torch.long, device=x.device)
            counts = torch.zeros(vocab, dtype=torch.float32, device=x.device).scatter_add_(
                0, out, torch.ones_like(out, dtype=torch.float32)
            )
            x[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        if len(r.output_ids) < p.min_tokens:
            banned = [t for t in (*r.eos_ids, *p.stop_token_ids) if 0 <= t < vocab]
            if banned:
                x[i, banned] = _MASK
    greedy_rows = [i for i, r in enumerate(rows) if r.params.greedy]
    tokens = [0] * n
    if greedy_rows:
        idx = torch.tensor(greedy_rows, device=x.device)
        for i, t in zip(greedy_rows, x[idx].argmax(dim=-1).tolist()):
            tokens[i] = t
    for i, r in enumerate(rows):
        if r.params.greedy:
            continue
        p = r.params
        row = x[i] / p.temperature
        if p.top_k > 0 and p.top_k < vocab:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, _MASK)
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sp, si = probs.sort(descending=True)
            cum = sp.cumsum(0)
            drop = (cum - sp) > p.top_p  # keep the smallest set whose mass reaches top_p
            probs = probs.scatter(0, si, sp.masked_fill(drop, 0.0))
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        noise = _row_noise(r.seed, r.position, vocab).to(probs.device)
        tokens[i] = int((probs / noise).argmax())
    lps: list[tuple[float, list[tuple[int, float]]] | None] = [None] * n
    if raw_lp is not None:
        for i, r in enumerate(rows):
            if r.params.logprobs is None:
                continue
            k = r.params.logprobs
            top: list[tuple[int, float]] = []
            if k > 0:
                v, ix = torch.topk(raw_lp[i], k)
                top = list(zip(ix.tolist(), v.tolist()))
            lps[i] = (float(raw_lp[i, tokens[i]]), top)
    return SampleResult(tokens, lps)

"""The batched sampler: one pass of batched tensor ops over a step's logits, on the logits' device.

Every row's randomness is ONE uniform number, a pure function of (request seed, output position) through a
counter-based hash (splitmix64), and the pick is the inverse CDF of the row's final distribution taken in
vocabulary order. So a row's token depends only on its own logits, seed and position: the same alone, in any
batch, after preemption, and whether the batch took the top-k candidate path or the full-vocabulary one (both sum
the same probabilities in the same vocabulary order). Requests without a seed get one drawn at arrival by the
engine, so every row draws the same way and no device generator is needed.

Penalties read per-request token counts kept on the device (:class:`Sampler` slots), updated with each step's
picks on the device; a row's slot is rebuilt from its token ids whenever the host's count of its outputs disagrees,
so a slot lost or evicted is only a rebuild, never a wrong answer.

One device→host copy per step returns the picked ids (and the asked logprobs with them).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common import cpu_kernels
from common.sampling import SamplingParams

_MASK = float("-inf")
_M64 = (1 << 64) - 1
# top-k at most this large is sampled among the top-k candidates only; a larger k (or none) takes the full vocabulary
_CANDIDATE_CAP = 1024
# columns of the per-step parameter tensor
_TEMP, _TOPK, _TOPP, _MINP, _REP, _PRES, _FREQ, _U, _SLOT = range(9)


@dataclass(slots=True)
class SampleRow:
    """What the sampler needs to know about one row. ``key`` (the request id) lets the sampler keep the row's
    token counts on the device across steps; without one, they are rebuilt for this call."""

    params: SamplingParams
    seed: int  # the request's seed (drawn at arrival when the request gave none)
    position: int  # index of the token being sampled among the outputs
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    eos_ids: tuple[int, ...]
    key: str | None = None


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    # per row: (sampled logprob, [(token id, logprob) × top-n]) or None
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


def _mix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def row_uniform(seed: int, position: int) -> float:
    """The row's uniform draw in [0, 1): 24 bits, exact in float32, from splitmix64 over (seed, position)."""
    return (_mix64(_mix64(seed & _M64) ^ (position & _M64)) >> 40) * 2.0**-24


def _argmax(x: torch.Tensor) -> list[int]:
    """Row-wise argmax, first index on ties; the C++ kernel on the CPU (torch's took 1 ms for 32 rows of 49,152)."""
    if x.device.type == "cpu" and cpu_kernels.available():
        return cpu_kernels.argmax_rows(x).tolist()
    return x.argmax(dim=-1).tolist()


def _plain_greedy(r: SampleRow) -> bool:
    """Greedy with nothing that reads or changes the logits first: the pick is the argmax of the raw logits."""
    p = r.params
    return (
        p.greedy and p.logprobs is None and p.repetition_penalty == 1.0 and not p.logit_bias
        and not ((p.presence_penalty or p.frequency_penalty) and r.output_ids)
        and len(r.output_ids) >= p.min_tokens
    )


def _needs_counts(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or bool(p.presence_penalty) or bool(p.frequency_penalty)


class _Slots:
    """Per-request token state on the device: ``seen`` (prompt ∪ outputs, for the repetition penalty) and
    ``counts`` (outputs, for presence and frequency). Slot 0 stays all-zero: rows without penalties read it; the
    last row is scratch: their picks are recorded there (one batched update, nothing selected on the host)."""

    def __init__(self, vocab: int, device: torch.device, capacity: int) -> None:
        self.vocab, self.device = vocab, device
        self.seen = torch.zeros(capacity + 2, vocab, dtype=torch.bool, device=device)
        self.counts = torch.zeros(capacity + 2, vocab, dtype=torch.int32, device=device)
        self.free = list(range(capacity, 0, -1))
        self.by_key: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self.counted: dict[int, int] = {}  # slot → outputs folded into counts

    @property
    def scratch(self) -> int:
        return self.seen.shape[0] - 1

    def _grow(self) -> None:
        old = self.scratch  # the old scratch row becomes a slot
        extra = old
        self.seen = torch.cat([self.seen, self.seen.new_zeros(extra, self.vocab)])
        self.counts = torch.cat([self.counts, self.counts.new_zeros(extra, self.vocab)])
        self.seen[old].zero_()
        self.counts[old].zero_()
        self.free.extend(range(old + extra - 1, old - 1, -1))

    def acquire(self, key: str | None, in_use: set[int]) -> int:
        """The slot of ``key`` (None: a fresh one for this call), evicting the least recently used slot that this
        step does not use when none is free."""
        if key is not None and key in self.by_key:
            self.by_key.move_to_end(key)
            return self.by_key[key]
        if not self.free:
            victim = next((k for k, s in self.by_key.items() if s not in in_use), None)
            if victim is None:
                self._grow()
            else:
                self.release(victim)
        slot = self.free.pop()
        self.counted[slot] = -1  # not built yet
        if key is not None:
            self.by_key[key] = slot
        return slot

    def release(self, key: str) -> None:
        slot = self.by_key.pop(key, None)
        if slot is not None:
            self.drop(slot)

    def drop(self, slot: int) -> None:
        self.counted.pop(slot, None)
        self.free.append(slot)

    def sync(self, slot: int, row: SampleRow) -> None:
        """Bring the slot up to the row's token ids: fold in new outputs, or rebuild when it is out of step."""
        n = len(row.output_ids)
        have = self.counted[slot]
        dev = self.device
        if have < 0 or have > n:
            self.seen[slot].zero_()
            self.counts[slot].zero_()
            if len(row.prompt_ids):
                self.seen[slot, torch.tensor(row.prompt_ids, dtype=torch.long).to(dev)] = True
            have = 0
        if n > have:
            new = torch.tensor(row.output_ids[have:], dtype=torch.long).to(dev)
            self.seen[slot, new] = True
            self.counts[slot].index_put_((new,), torch.ones_like(new, dtype=torch.int32), accumulate=True)
        self.counted[slot] = n

    def record(self, slots: torch.Tensor, tokens: torch.Tensor, host_slots: list[int]) -> None:
        """The step's picks join their rows' counts (on the device; no host sync). ``slots`` is every row's slot,
        0 for rows without: those go to the scratch row."""
        slots = torch.where(slots > 0, slots, self.scratch)
        self.seen[slots, tokens] = True
        self.counts.index_put_((slots, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)
        for s in host_slots:
            if s:
                self.counted[s] += 1


class Sampler:
    """Samples a step's rows in one batched pass on the logits' device. Keeps per-request token counts for the
    penalties between steps: call :meth:`release` when a request ends (a forgotten one is only evicted later)."""

    def __init__(self, vocab_size: int, device: torch.device | str, max_rows: int = 64) -> None:
        self._slots = _Slots(vocab_size, torch.device(device), max_rows)
        self.vocab_size = vocab_size

    def release(self, key: str) -> None:
        self._slots.release(key)

    @property
    def num_tracked(self) -> int:
        return len(self._slots.by_key)

    def sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> SampleResult:
        """Pick one token per row of ``logits`` ([N, V], V ≤ the vocab given at construction; float32, or the
        model's dtype: an all-greedy batch is picked from it as is). Does not modify ``logits``."""
        if all(_plain_greedy(r) for r in rows):
            return SampleResult(_argmax(logits), [None] * logits.shape[0])
        x, prm, spec, slot_t = self._process(logits, rows)
        tok: torch.Tensor | None = None
        if spec.any_greedy:
            tok = x.argmax(dim=-1)
        if spec.any_sampled:
            picked = _pick(x, prm, spec)
            tok = picked if tok is None else torch.where(prm[:, _TEMP] > 0, picked, tok)
        assert tok is not None
        if slot_t is not None:
            self._slots.record(slot_t, tok, spec.slot_of_row)
        for slot in spec.temp_slots:
            self._slots.drop(slot)
        return _fetch(tok, spec.raw_lp, spec)

    def processed_logits(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """The float32 logits the pick sees (penalties, logit_bias, min_tokens masks applied); samples nothing and
        leaves the kept counts as they were. For checks against a reference."""
        x, _, spec, _ = self._process(logits, rows)
        for slot in spec.temp_slots:
            self._slots.drop(slot)
        return x

    def _process(self, logits: torch.Tensor, rows: list[SampleRow]
                 ) -> tuple[torch.Tensor, torch.Tensor, _StepSpec, torch.Tensor | None]:
        dev = logits.device
        x = logits.float()
        if x.data_ptr() == logits.data_ptr():
            x = x.clone()
        vocab = x.shape[1]
        spec = _StepSpec(rows, self._slots, vocab)
        prm = torch.tensor(spec.table, dtype=torch.float32).to(dev, non_blocking=True)
        spec.raw_lp = torch.log_softmax(x[spec.lp_index(dev)], dim=-1) if spec.lp_rows else None
        slot_t = None
        if spec.count_rows:
            slot_t = prm[:, _SLOT].long()
            s = self._slots
            if spec.any_rep:
                rp = prm[:, _REP : _REP + 1]
                x = torch.where(s.seen[slot_t, :vocab], torch.where(x > 0, x / rp, x * rp), x)
            if spec.any_freq_pres:
                c = s.counts[slot_t, :vocab].float()
                x = x - prm[:, _FREQ : _FREQ + 1] * c - prm[:, _PRES : _PRES + 1] * (c > 0).float()
        if spec.bias:
            r_, t_, v_ = zip(*spec.bias)
            x.index_put_((torch.tensor(r_).to(dev), torch.tensor(t_).to(dev)),
                         torch.tensor(v_, dtype=torch.float32).to(dev), accumulate=True)
        if spec.bans:
            r_, t_ = zip(*spec.bans)
            x[torch.tensor(r_).to(dev), torch.tensor(t_).to(dev)] = _MASK
        return x, prm, spec, slot_t


class _StepSpec:
    """The host side of one step: per-row parameters as one table, and which stages any row needs."""

    def __init__(self, rows: list[SampleRow], slots: _Slots, vocab: int) -> None:
        self.table: list[list[float]] = []
        self.slot_of_row: list[int] = []
        self.bans: list[tuple[int, int]] = []
        self.bias: list[tuple[int, int, float]] = []
        self.lp_rows: list[int] = []
        self.lp_k: list[int] = []  # top logprobs asked, per row of lp_rows
        self.temp_slots: list[int] = []
        self.any_rep = self.any_freq_pres = self.any_greedy = self.any_sampled = False
        self.any_top_p = self.any_min_p = False
        self.top_ks: list[int] = []
        self.raw_lp: torch.Tensor | None = None  # log_softmax of the raw logits of lp_rows
        in_use: set[int] = set()
        for i, r in enumerate(rows):
            p = r.params
            slot = 0
            if _needs_counts(p):
                slot = slots.acquire(r.key, in_use)
                in_use.add(slot)
                slots.sync(slot, r)
                if r.key is None:
                    self.temp_slots.append(slot)
                self.any_rep |= p.repetition_penalty != 1.0
                self.any_freq_pres |= bool(p.presence_penalty or p.frequency_penalty)
            self.slot_of_row.append(slot)
            if len(r.output_ids) < p.min_tokens:
                self.bans += [(i, t) for t in {*r.eos_ids, *p.stop_token_ids} if 0 <= t < vocab]
            self.bias += [(i, t, b) for t, b in p.logit_bias if t < vocab]
            if p.logprobs is not None:
                self.lp_rows.append(i)
                self.lp_k.append(p.logprobs)
            k = p.top_k if 0 < p.top_k < vocab else 0
            if p.greedy:
                self.any_greedy = True
                temp = 0.0
            else:
                self.any_sampled = True
                temp = p.temperature
                self.top_ks.append(k)
                self.any_top_p |= p.top_p < 1.0
                self.any_min_p |= p.min_p > 0.0
            self.table.append([temp, float(k), p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty,
                               p.frequency_penalty, row_uniform(r.seed, r.position), float(slot)])
        self.count_rows = any(self.slot_of_row)
        # every sampled row has a small top-k: sample among the top candidates only
        self.candidates = max(self.top_ks) if self.top_ks and all(
            0 < k <= _CANDIDATE_CAP for k in self.top_ks) else 0

    def lp_index(self, dev: torch.device) -> torch.Tensor:
        return torch.tensor(self.lp_rows, dtype=torch.long).to(dev)


def _pick(x: torch.Tensor, prm: torch.Tensor, spec: _StepSpec) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, then the inverse-CDF pick in vocabulary order. Greedy rows' picks here
    are discarded (they take temperature 1 to stay finite)."""
    temp = prm[:, _TEMP : _TEMP + 1]
    temp = torch.where(temp > 0, temp, torch.ones_like(temp))
    k_row = prm[:, _TOPK : _TOPK + 1]
    if spec.candidates:
        vals, ids = torch.topk(x, spec.candidates, dim=-1)  # sorted, largest first
        rank = torch.arange(spec.candidates, device=x.device).unsqueeze(0)
        vals = (vals / temp).masked_fill(rank >= k_row, _MASK)
        probs = torch.softmax(vals, dim=-1)
        if spec.any_top_p:
            probs = probs.masked_fill(probs.cumsum(-1) - probs > prm[:, _TOPP : _TOPP + 1], 0.0)
        if spec.any_min_p:
            probs = probs.masked_fill(probs < prm[:, _MINP : _MINP + 1] * probs[:, :1], 0.0)
        order = ids.argsort(dim=-1)  # back to vocabulary order, so the pick matches the full-vocabulary path
        ids, probs = ids.gather(1, order), probs.gather(1, order)
        return ids.gather(1, _inverse_cdf(probs, prm)).squeeze(1)
    z = x / temp
    if any(spec.top_ks):
        kmax = max(spec.top_ks)
        top = torch.topk(z, kmax, dim=-1).values
        kth = top.gather(1, (k_row.long() - 1).clamp(min=0))
        z = z.masked_fill((k_row > 0) & (z < kth), _MASK)
    probs = torch.softmax(z, dim=-1)
    if spec.any_top_p:
        sp, si = probs.sort(dim=-1, descending=True)
        drop = sp.cumsum(-1) - sp > prm[:, _TOPP : _TOPP + 1]  # keep the smallest set whose mass reaches top_p
        probs = probs.scatter(1, si, sp.masked_fill(drop, 0.0))
    if spec.any_min_p:
        probs = probs.masked_fill(probs < prm[:, _MINP : _MINP + 1] * probs.amax(-1, keepdim=True), 0.0)
    return _inverse_cdf(probs, prm).squeeze(1)


def _inverse_cdf(probs: torch.Tensor, prm: torch.Tensor) -> torch.Tensor:
    """Index [N, 1] of the first entry whose running mass exceeds u × total: never an entry of probability 0."""
    cdf = probs.cumsum(-1)
    j = torch.searchsorted(cdf, prm[:, _U : _U + 1] * cdf[:, -1:], right=True)
    ar = torch.arange(probs.shape[1], device=probs.device)
    last = torch.where(probs > 0, ar, 0).amax(-1, keepdim=True)  # rounding can put u × total at the very end
    return torch.minimum(j, last)


def _fetch(tok: torch.Tensor, raw_lp: torch.Tensor | None, spec: _StepSpec) -> SampleResult:
    """One device→host copy: the picked ids, then the asked rows' sampled logprob and top-k ids and logprobs."""
    n = tok.shape[0]
    if raw_lp is None:
        return SampleResult(tok.tolist(), [None] * n)
    sel = raw_lp.gather(1, tok[spec.lp_index(tok.device)].unsqueeze(1)).squeeze(1)
    parts = [tok.double(), sel.double()]
    k = max(spec.lp_k)
    if k:
        tv, ti = torch.topk(raw_lp, k, dim=-1)
        parts += [ti.double().flatten(), tv.double().flatten()]
    flat = torch.cat(parts).tolist()
    m = len(spec.lp_rows)
    top_i, top_v = flat[n + m : n + m + m * k], flat[n + m + m * k :]
    lps: list[tuple[float, list[tuple[int, float]]] | None] = [None] * n
    for j, (i, own) in enumerate(zip(spec.lp_rows, spec.lp_k)):
        lps[i] = (flat[n + j], [(int(top_i[j * k + t]), top_v[j * k + t]) for t in range(own)])
    return SampleResult([int(t) for t in flat[:n]], lps)


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> SampleResult:
    """Sample without state kept between calls (each penalized row's counts are built from its ids)."""
    return Sampler(logits.shape[1], logits.device, max_rows=1).sample(logits, rows)

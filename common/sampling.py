"""Sampling parameters: plain data, no torch (the gateway and router import this). The sampler is
``common.sampler``."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

StructuredKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A constraint on the output (``common/structured.py`` compiles it): every sampled token keeps the text a
    prefix of something the constraint accepts, and EOS is allowed only once it is complete."""

    kind: StructuredKind
    spec: str = ""  # json_schema: the schema as JSON text; regex: the pattern; grammar: Lark or GBNF text
    choices: tuple[str, ...] = ()  # choice: exactly one of these strings


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request generation controls (the OpenAI fields plus the ones vLLM users rely on)."""

    max_tokens: int | None = 16  # None: up to the context limit
    temperature: float = 1.0  # 0 → greedy
    top_k: int | None = None  # None: off (0 and -1, the OpenAI clients' and vLLM's "off", are taken as None)
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
    # (token id, bias) pairs added to the logits before sampling, as OpenAI's logit_bias; a mapping is accepted
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured: StructuredOutput | None = None  # None: unconstrained
    extra: dict[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        lb = self.logit_bias
        pairs = lb.items() if isinstance(lb, Mapping) else lb
        try:
            norm = tuple(sorted((int(t), float(b)) for t, b in pairs))
        except (TypeError, ValueError) as e:
            raise ValueError(f"logit_bias must map token ids to numbers, got {lb!r}") from e
        object.__setattr__(self, "logit_bias", norm)
        if self.top_k in (0, -1):
            object.__setattr__(self, "top_k", None)

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
        if self.top_k is not None and self.top_k < 1:
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
        for t, b in self.logit_bias:
            if not (0 <= t < vocab_size):
                raise ValueError(f"logit_bias has token id {t}, outside the vocabulary [0, {vocab_size})")
            if not (-100.0 <= b <= 100.0) or math.isnan(b):
                raise ValueError(f"logit_bias values must be in [-100, 100], got {b} for token {t}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if len(self.stop) > 16:
            raise ValueError(f"at most 16 stop strings are allowed, got {len(self.stop)}")

"""Workloads: the request stream of a serving benchmark, built from the target's tokenizer so that input lengths
are exact, and seeded so that the same seed gives the same stream.

A prompt is a run of "word" tokens (a space and 2–12 lower-case letters) that each survive a decode → encode round
trip alone. The byte-level pre-tokenizer splits text before every such token, so their concatenation re-encodes to
exactly the same ids: ``encode(prompt_text) == prompt_ids``, and the gRPC target (ids) and the HTTP targets (text)
see the same number of input tokens.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from loadgen.sharegpt_lengths import INPUT_QUANTILES, OUTPUT_QUANTILES

_WORD = re.compile(r"^Ġ[a-z]{2,12}$")


@dataclass(frozen=True, slots=True)
class Tenant:
    """One tenant of a multi-tenant mix: its own API key, open-loop rate (requests/s), priority, and priority class
    (interactive, standard or batch; None: not sent, the tenant's default at the gateway)."""

    name: str
    rate: float = 1.0
    priority: int = 0
    api_key: str | None = None
    priority_class: str | None = None


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of the stream. ``input_len`` counts what the target counts: the prompt's tokens, or for a chat
    target in ``chat_length="total"`` mode the tokens after the chat template."""

    index: int
    prompt_ids: tuple[int, ...]
    prompt_text: str
    input_len: int
    output_len: int
    tenant: Tenant | None = None
    group: int | None = None  # shared-prefix group
    # the output's constraint: {"type": "json_schema", "name": N, "schema": S} or {"type": "json_object"}; None: free
    structured: dict[str, Any] | None = None


class PromptBuilder:
    """Exact-length prompts from a tokenizer (``common.tokenizer.TextTokenizer``-like: encode, decode, tk).

    ``prefix`` holds what the tokenizer puts before any text (a BOS for Llama 3, nothing for SmolLM2): a plain
    prompt of N tokens is ``prefix`` + N − len(prefix) word tokens, so the server's count is N either way."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        vocab = tokenizer.tk.get_vocab(with_added_tokens=False)
        cands = sorted(i for s, i in vocab.items() if _WORD.match(s))
        texts = [tokenizer.decode([i]) for i in cands]
        encs = tokenizer.tk.encode_batch(texts, add_special_tokens=False)
        self.words = np.array([i for i, e in zip(cands, encs) if e.ids == [i]], dtype=np.int64)
        if len(self.words) < 100:
            raise ValueError(f"the tokenizer has only {len(self.words)} plain-word tokens; cannot build prompts")
        probe = [int(self.words[0])]
        full = tokenizer.encode(tokenizer.decode(probe), add_special_tokens=True)
        self.prefix: tuple[int, ...] = tuple(full[: len(full) - 1])
        self._overhead: int | None = None

    def ids(self, n: int, rng: np.random.Generator) -> list[int]:
        """``n`` random word tokens."""
        return [int(x) for x in rng.choice(self.words, size=n)]

    def text(self, words: Sequence[int]) -> str:
        """The text of word tokens; raises ValueError if it would not re-encode to ``prefix`` + ``words``."""
        text = self.tok.decode(list(words))
        got = self.tok.encode(text, add_special_tokens=True)
        if got != [*self.prefix, *words]:  # a pre-tokenizer unlike byte-level BPE
            raise ValueError(f"a prompt of {len(words)} word tokens re-encodes to {len(got)} other tokens with "
                             "this tokenizer")
        return text

    def chat_overhead(self) -> int:
        """Tokens the chat template adds around one user message (system prompt, role markers, generation prompt)."""
        if self._overhead is None:
            one = self.tok.decode(self.ids(8, np.random.default_rng(0)))
            full = self.tok.encode(self.tok.apply_chat_template([{"role": "user", "content": one}]),
                                   add_special_tokens=False)
            self._overhead = len(full) - 8
        return self._overhead


class RandomIdsBuilder(PromptBuilder):
    """Token ids drawn from ``[10, vocab)`` without a tokenizer (``--tokenizer ids:VOCAB``), for models that have
    none (``dummy:…`` weights at a real size): gRPC targets only, the prompts have no text."""

    def __init__(self, vocab: int) -> None:  # no super().__init__: there is no tokenizer
        if vocab < 100:
            raise ValueError(f"ids:{vocab}: the vocabulary must have at least 100 ids")
        self.words = np.arange(10, vocab, dtype=np.int64)
        self.prefix = ()
        self._overhead = None

    def text(self, words: Sequence[int]) -> str:
        return ""

    def chat_overhead(self) -> int:
        raise ValueError("token-id prompts (--tokenizer ids:N) have no chat template")


def parse_range(s: str | int) -> tuple[int, int]:
    """``"128"`` → (128, 128); ``"100:500"`` → (100, 500) inclusive."""
    if isinstance(s, int):
        return s, s
    lo, _, hi = str(s).partition(":")
    a, b = int(lo), int(hi or lo)
    if a < 1 or b < a:
        raise ValueError(f"length range {s!r}: need 1 <= LO <= HI")
    return a, b


def ratio_range(n: int, ratio: float) -> tuple[int, int]:
    """vLLM's ``--random-range-ratio``: uniform in [n·(1−r), n·(1+r)]."""
    if not 0 <= ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {ratio}")
    return max(1, int(n * (1 - ratio))), int(n * (1 + ratio))


def _uniform(rng: np.random.Generator, lo_hi: tuple[int, int]) -> int:
    lo, hi = lo_hi
    return int(rng.integers(lo, hi + 1))


def _quantile_sample(rng: np.random.Generator, q: Sequence[int]) -> int:
    """Inverse-CDF sampling from quantiles at 0, 5, …, 100 %, linear between them."""
    return int(np.rint(np.interp(rng.random() * (len(q) - 1), np.arange(len(q)), q)))


@dataclass(frozen=True)
class WorkloadConfig:
    """What to generate. ``dataset``: random | sharegpt | shared-prefix | long-prompt."""

    dataset: str = "random"
    input_len: tuple[int, int] = (256, 256)
    output_len: tuple[int, int] = (128, 128)
    prefix_groups: int = 4
    prefix_len: int = 512
    long_input_len: tuple[int, int] = (2048, 4096)
    sharegpt_output_len: int | None = None
    chat: bool = False  # the prompt is a chat message (the ids are its content, no BOS)
    chat_length: str = "content"  # chat: "content": input_len counts the message; "total": after the template
    seed: int = 0
    # output constraints (RequestSpec.structured), cycled over the constrained requests; their share of requests.
    # Drawn from a stream of their own: the prompts are those of the same config without constraints
    structured: tuple[dict[str, Any], ...] = ()
    structured_ratio: float = 1.0


DATASETS = ("random", "sharegpt", "shared-prefix", "long-prompt")


def iter_requests(cfg: WorkloadConfig, builder: PromptBuilder, tenants: Sequence[Tenant] = ()
                  ) -> Iterator[RequestSpec]:
    """The request stream, endless: the first N requests are the same for the same config and seed, whatever N.

    Tenants (if any) are drawn with probabilities proportional to their rates: for Poisson arrivals at the summed
    rate this is exactly one Poisson process per tenant at its own rate (superposition)."""
    if cfg.dataset not in DATASETS:
        raise ValueError(f"unknown dataset {cfg.dataset!r}: one of {', '.join(DATASETS)}")
    rng = np.random.default_rng(cfg.seed)
    prefixes: list[list[int]] = []
    if cfg.dataset == "shared-prefix":
        if cfg.prefix_groups < 1 or cfg.prefix_len < 1:
            raise ValueError("shared-prefix needs --prefix-groups >= 1 and --prefix-len >= 1")
        prefixes = [builder.ids(cfg.prefix_len, rng) for _ in range(cfg.prefix_groups)]
    weights = np.array([t.rate for t in tenants], dtype=float)
    srng = np.random.default_rng(cfg.seed + 1)  # which requests are constrained
    n_structured = 0
    # tokens the target adds around the words: the chat template, or the tokenizer's BOS for a plain prompt
    lead: tuple[int, ...] = () if cfg.chat else builder.prefix
    overhead = (builder.chat_overhead() if cfg.chat_length == "total" else 0) if cfg.chat else len(lead)
    i = 0
    while True:
        group: int | None = None
        if cfg.dataset == "sharegpt":
            n_in = max(_quantile_sample(rng, INPUT_QUANTILES), overhead + 1)  # room for the template or BOS
            n_out = cfg.sharegpt_output_len or min(_quantile_sample(rng, OUTPUT_QUANTILES), 2048 - n_in)
        else:
            n_in = _uniform(rng, cfg.long_input_len if cfg.dataset == "long-prompt" else cfg.input_len)
            n_out = _uniform(rng, cfg.output_len)
        if prefixes:  # the input length is the suffix that follows the group's prefix
            group = int(rng.integers(len(prefixes)))
            words = prefixes[group] + builder.ids(n_in, rng)
            n_in = len(words) + overhead
        else:
            if n_in - overhead < 1:
                raise ValueError(f"input length {n_in} leaves no room after the chat template or BOS "
                                 f"({overhead} tokens)")
            words = builder.ids(n_in - overhead, rng)
        tenant = tenants[int(rng.choice(len(tenants), p=weights / weights.sum()))] if tenants else None
        structured = None
        if cfg.structured and srng.random() < cfg.structured_ratio:
            structured = cfg.structured[n_structured % len(cfg.structured)]
            n_structured += 1
        yield RequestSpec(i, (*lead, *words), builder.text(words), n_in, n_out, tenant, group, structured)
        i += 1


def build_requests(cfg: WorkloadConfig, builder: PromptBuilder, n: int, tenants: Sequence[Tenant] = ()
                   ) -> list[RequestSpec]:
    """The first ``n`` requests of the stream."""
    it = iter_requests(cfg, builder, tenants)
    return [next(it) for _ in range(n)]


def structured_output_valid(constraint: dict[str, Any], text: str) -> bool:
    """Whether ``text`` is what ``constraint`` (``RequestSpec.structured``) asked for: a JSON object for
    ``json_object``; for ``json_schema``, JSON that validates against the schema. Runs on the client's event loop at
    each constrained request's end, so a schema's validator is built once (:func:`_validator`)."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    if constraint["type"] == "json_object":
        return isinstance(value, dict)
    return _validator(json.dumps(constraint["schema"], sort_keys=True)).is_valid(value)


@functools.lru_cache(maxsize=64)
def _validator(schema: str) -> Any:
    """A schema's validator, by its JSON text (a ``jsonschema.SchemaError`` for a schema that is not one).
    Checking the schema and building its validator takes 2-4 ms for the five schemas of ``--structured schemas``
    on the 2-core VM, the validation alone 0.04-0.11 ms: built per request, at a few hundred requests a second, it
    would stall every stream the client reads."""
    import jsonschema

    s = json.loads(schema)
    cls = jsonschema.validators.validator_for(s)
    cls.check_schema(s)
    return cls(s)

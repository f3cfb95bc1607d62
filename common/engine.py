"""The engine: ``schedule() → execute() → update()``, plus request intake and output processing.

Knows nothing of gRPC or HTTP; services wrap it. Single-threaded: one loop calls ``step``.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from common.block_manager import BlockManager
from common.config import EngineConfig
from common.loader import ModelSource, load_model_source
from common.model_runner import ModelRunner
from common.sampling import SampleRow, SamplingParams, sample
from common.scheduler import Scheduler, SchedulerOutput
from common.sequence import FinishReason, Sequence, SequenceStatus
from common.tokenizer import IncrementalDetokenizer, TextTokenizer

log = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request the engine refuses; the message names the value and the limit."""


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request (a streaming delta; ``finished`` on the last one)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int


@dataclass(slots=True)
class CompletionResult:
    """A finished request, as ``generate`` returns it."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[TokenLogprob] | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class _TextState:
    """Incremental text of one request and how much of it has been streamed."""

    detok: IncrementalDetokenizer | None
    emitted: int = 0
    holdback: int = 0  # characters kept back while they could still start a stop string
    logprobs: list[TokenLogprob] | None = None


class LLMEngine:
    """Paged-KV, continuously batched inference over one model."""

    def __init__(self, source: ModelSource, cfg: EngineConfig | None = None) -> None:
        self.cfg = cfg or EngineConfig()
        self.source = source
        self.model_cfg = source.config
        self.tokenizer: TextTokenizer | None = source.tokenizer
        self.runner = ModelRunner(source, self.cfg)
        self.max_model_len = min(self.cfg.max_model_len or self.model_cfg.max_position_embeddings,
                                 self.model_cfg.max_position_embeddings)
        self.block_manager = BlockManager(
            self.runner.num_blocks, self.cfg.block_size, source.model_id, self.cfg.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager, self.cfg.max_num_batched_tokens, self.cfg.max_num_seqs, self.cfg.enable_chunked_prefill
        )
        self._seqs: dict[str, Sequence] = {}
        self._text: dict[str, _TextState] = {}
        self._counter = itertools.count()
        self._rng = random.Random(self.cfg.seed)
        self.num_steps = 0

    @classmethod
    def from_spec(cls, model: str | None = None, cfg: EngineConfig | None = None) -> LLMEngine:
        return cls(load_model_source(model), cfg)

    # -- intake ----------------------------------------------------------------------------------------
    def validate(self, prompt_ids: Seq[int], params: SamplingParams) -> int:
        """Check a request; return its effective max_tokens. Raises RequestError."""
        n = len(prompt_ids)
        if n == 0:
            raise RequestError("the prompt is empty; send at least one token")
        vocab = self.model_cfg.vocab_size
        bad = next((t for t in prompt_ids if not (0 <= int(t) < vocab)), None)
        if bad is not None:
            raise RequestError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        try:
            params.validate(vocab)
        except ValueError as e:
            raise RequestError(str(e)) from e
        limit = self.max_model_len
        if n >= limit:
            raise RequestError(
                f"the prompt is {n} tokens; this model accepts at most {limit} tokens including the output"
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - n
        if n + max_tokens > limit:
            raise RequestError(
                f"the prompt is {n} tokens and max_tokens is {max_tokens}: {n + max_tokens} exceeds this "
                f"model's context of {limit} tokens"
            )
        blocks = self.block_manager.blocks_needed(n + max_tokens)
        if blocks > self.block_manager.num_blocks:
            raise RequestError(
                f"the request needs {n + max_tokens} tokens of KV cache ({blocks} blocks) but the pool holds "
                f"{self.block_manager.num_blocks} blocks; lower max_tokens or raise --kv-cache-memory"
            )
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
        return max_tokens

    def add_request(
        self,
        request_id: str,
        prompt_ids: Seq[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str = "",
    ) -> None:
        """Queue a request. Raises RequestError for invalid input, ValueError for a duplicate id."""
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already running")
        max_tokens = self.validate(prompt_ids, params)
        seq = Sequence(
            request_id=request_id,
            prompt_ids=[int(t) for t in prompt_ids],
            params=params,
            seed=params.seed if params.seed is not None else self._rng.getrandbits(62),
            max_tokens=max_tokens,
            priority=priority,
            arrival_seq=next(self._counter),
            cache_salt=cache_salt,
        )
        detok = None
        if self.tokenizer is not None:
            detok = self.tokenizer.detokenizer(seq.prompt_ids, params.skip_special_tokens)
        hold = max((len(s) for s in params.stop), default=1) - 1
        self._text[request_id] = _TextState(detok, holdback=hold, logprobs=[] if params.logprobs is not None else None)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Cancel a request and free its blocks. Returns False if it is unknown or already finished."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = FinishReason.ABORT
        self._text.pop(request_id, None)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # -- the loop --------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine iteration: schedule → execute → update. Returns the deltas it produced."""
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        logits = self.runner.execute(out)
        self.num_steps += 1
        return self._update(out, logits)

    def _update(self, out: SchedulerOutput, logits: object) -> list[RequestOutput]:
        sampling = [it.seq for it in (*out.prefills, *out.decodes) if it.samples]
        self.scheduler.update_after_step(out)
        if not sampling:
            return []
        eos = () if self.model_cfg.eos_token_ids is None else self.model_cfg.eos_token_ids
        rows = [SampleRow(s.params, s.seed, len(s.output_ids), s.prompt_ids, s.output_ids, eos) for s in sampling]
        result = sample(logits, rows)  # type: ignore[arg-type]
        now = time.monotonic()
        outputs = []
        for s, tok, lp in zip(sampling, result.token_ids, result.logprobs):
            s.output_ids.append(tok)
            if s.first_token_time is None:
                s.first_token_time = now
            outputs.append(self._process_token(s, tok, lp))
        return outputs

    def _process_token(self, s: Sequence, tok: int, lp: tuple[float, list[tuple[int, float]]] | None) -> RequestOutput:
        st = self._text[s.request_id]
        p = s.params
        if lp is not None and st.logprobs is not None:
            st.logprobs.append(TokenLogprob(tok, lp[0], lp[1]))
        reason: FinishReason | None = None
        if (not p.ignore_eos and tok in self.model_cfg.eos_token_ids) or tok in p.stop_token_ids:
            reason = FinishReason.STOP
        text_end: int | None = None
        if st.detok is not None:
            before = len(st.detok.text)
            delta = st.detok.step(tok) if reason is None or not p.skip_special_tokens else ""
            if p.stop and delta and len(s.output_ids) >= p.min_tokens:
                text = st.detok.text
                search_from = max(0, before - st.holdback)
                for stop in p.stop:
                    i = text.find(stop, search_from)
                    if i >= 0 and (text_end is None or i < text_end):
                        text_end = i + (len(stop) if p.include_stop_str_in_output else 0)
                if text_end is not None:
                    reason = FinishReason.STOP
        if reason is None and (len(s.output_ids) >= s.max_tokens or s.num_tokens >= self.max_model_len):
            reason = FinishReason.LENGTH
        new_text = ""
        if st.detok is not None:
            text = st.detok.text
            if text_end is not None:
                st.detok.text = text = text[:text_end]
            upto = len(text) if reason is not None else max(st.emitted, len(text) - st.holdback)
            new_text = text[st.emitted : upto]
            st.emitted = upto
        finished = reason is not None
        if finished:
            s.status = SequenceStatus.FINISHED
            s.finish_reason = reason
            self.scheduler.remove(s)
            self._seqs.pop(s.request_id, None)
            self._text.pop(s.request_id, None)
        return RequestOutput(
            request_id=s.request_id,
            new_token_ids=[tok],
            new_text=new_text,
            logprobs=[st.logprobs[-1]] if st.logprobs else None,
            finished=finished,
            finish_reason=reason,
            num_prompt_tokens=s.num_prompt_tokens,
            num_output_tokens=len(s.output_ids),
            num_cached_tokens=s.num_cached_tokens,
        )

    # -- offline convenience ---------------------------------------------------------------------------
    def generate(
        self,
        prompts: Iterable[Seq[int]],
        params: SamplingParams | Seq[SamplingParams],
        progress: bool = False,
    ) -> list[CompletionResult]:
        """Run every prompt to completion; results in input order. Raises RequestError before any work."""
        prompts = [list(p) for p in prompts]
        plist = list(params) if isinstance(params, list | tuple) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        for ids, p in zip(prompts, plist):
            self.validate(ids, p)
        ids = [f"gen-{next(self._counter)}" for _ in prompts]
        acc: dict[str, CompletionResult] = {}
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
            acc[rid] = CompletionResult(rid, prompt, [], "", "", [] if p.logprobs is not None else None)
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(prompts), desc="generate", unit="req", dynamic_ncols=True)
        done = 0
        while done < len(prompts):
            for o in self.step():
                r = acc[o.request_id]
                r.token_ids.extend(o.new_token_ids)
                r.text += o.new_text
                if o.logprobs and r.logprobs is not None:
                    r.logprobs.extend(o.logprobs)
                if o.finished:
                    r.finish_reason = o.finish_reason.value if o.finish_reason else ""
                    r.num_cached_tokens = o.num_cached_tokens
                    done += 1
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [acc[r] for r in ids]

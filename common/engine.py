"""The engine: ``schedule() → execute() → sample → update``, plus request intake and output processing.

Knows nothing of gRPC or HTTP; services wrap it. Single-threaded: one loop calls ``step``.

With async scheduling (``engine.async_scheduling``, on on CUDA) a step does not wait for its own tokens: it
schedules step N, launches its forward (a decode whose token step N-1 sampled reads it from the device), then reads
step N-1's tokens, which the GPU finished before starting step N, and hands them out: appended, stop checks,
finished requests freed, grammar matchers advanced. Only then does it queue step N's sampling, so the sampler sees
every row's outputs and matchers as a synchronous engine would, and the same tokens come out. ``step`` returns
step N-1's outputs; the host's work on them, and the next schedule, run while the GPU computes step N. What it
costs: a request that step N-1 finished (EOS, a stop token) still ran its row in step N, whose pick is dropped; a
request whose token ends it whatever it is (``max_tokens``) is not scheduled again. A step with a constrained
row (structured outputs) cannot be picked before the row's grammar mask is filled, and that mask needs the row's
last token, so its pick waits (``engine.async_constrained``, on with async scheduling): the next call schedules
step N+1 and stages its inputs, then queues step N's pick (its masks filled meanwhile, beside step N's forward),
then launches step N+1's forward and reads step N's tokens, so the masks of step N+1's pick fill while its
forward runs and while the host hands out step N's tokens, schedules step N+2 and stages it. Where the GPU is idle
by the time step N's pick is queued (a small model: the host is the bound), the engine waits for that pick and
sends its tokens to the grammar mask process before step N+1's launch, giving the masks that much longer. With it off,
such a step hands its tokens out before it returns, as a synchronous engine does, and its rows' next masks fill
beside the next schedule and forward only.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import torch

from common.block_manager import BlockManager
from common.config import EngineConfig
from common.loader import ModelSource, load_model_source
from common.model import LlamaModel
from common.model_runner import ModelRunner, TokenFeed
from common.output_processor import OutputProcessor
from common.sampler import PendingSample, PinnedUploads, Sampler, SampleRow
from common.sampling import SamplingParams
from common.scheduler import Scheduler, SchedulerOutput
from common.sequence import DEFAULT_TENANCY, FinishReason, PriorityClass, Sequence, SequenceStatus, Tenancy
from common.structured import GrammarCompiler, GrammarError, GrammarMatcher
from common.tensor_parallel import SINGLE, TensorParallelWorkers
from common.tokenizer import TextTokenizer

log = logging.getLogger(__name__)

# where an engine step's host time goes (LLMEngine.step_phases(), seconds summed over the steps): schedule (the
# scheduler, and the step's bookkeeping before the forward), launch (inputs staged, the forward launched: a graph
# replay, or eager kernels), wait (blocked on the device for a step's picked tokens), outputs (the tokens handed out:
# appended, stop checks, finished requests freed), sample (the pick queued), other (the rest of step_seconds)
STEP_PHASES = ("schedule", "launch", "wait", "outputs", "sample", "other")

# a decode worker's own prompts beside its decoding sequences, in a disaggregated layout (LLMEngine.pulls_kv;
# docs/benchmarks.md, "GPU: prefill and decode on two GPUs")
DISAGG_PROMPT_TOKENS_BESIDE_DECODES = 1024


class RequestError(ValueError):
    """A request the engine refuses; the message names the value and the limit."""


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """The engine's checks of a request that read only what is fixed once it is up (its vocabulary, context and KV
    pool), so a worker's front runs them in its own process (``WorkerBase.validate``); a grammar's compile is the
    engine's (``LLMEngine.validate``)."""

    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    has_tokenizer: bool

    def check(self, prompt_ids: Seq[int], params: SamplingParams) -> int:
        """Check a request; return its effective max_tokens. Raises RequestError."""
        n = len(prompt_ids)
        if n == 0:
            raise RequestError("the prompt is empty; send at least one token")
        vocab = self.vocab_size
        lo, hi = min(prompt_ids), max(prompt_ids)  # one pass each in C, not a Python loop per token
        if lo < 0 or hi >= vocab:
            raise RequestError(f"prompt token id {lo if lo < 0 else hi} is outside the vocabulary [0, {vocab})")
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
        blocks = -(-(n + max_tokens) // self.block_size)
        if blocks > self.num_blocks:
            raise RequestError(
                f"the request needs {n + max_tokens} tokens of KV cache ({blocks} blocks) but the pool holds "
                f"{self.num_blocks} blocks; lower max_tokens or raise --kv-cache-memory"
            )
        if params.stop and not self.has_tokenizer:
            raise RequestError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
        return max_tokens


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request, in token ids (text is the OutputProcessor's job).

    A request ends one of two ways: ``finished`` (its blocks are freed, ``finish_reason`` says why), or, for a
    prefill-only request whose first token does not end it, ``leased``: not finished, its prompt's blocks
    (``kv_block_ids``) stay allocated until ``release`` while another worker decodes it."""

    request_id: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    leased: bool = False
    kv_block_ids: list[int] | None = None  # leased only: the blocks holding the prompt's KV

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickled as its fields in order: a step's outputs cross from the engine core's process to its front every
        step, and this takes a third of the default's time (slotted dataclasses pickle through ``__getstate__``)."""
        return RequestOutput, (self.request_id, self.new_token_ids, self.logprobs, self.finished, self.finish_reason,
                               self.num_prompt_tokens, self.num_output_tokens, self.num_cached_tokens, self.leased,
                               self.kv_block_ids)


class OutputBatch(list[RequestOutput]):
    """One step's outputs on their way to the worker's front (the engine core's process to its own, every step).
    Pickled as columns where an output is the common case, one new token, no logprobs, not finished and not
    leased, and whole otherwise: 64 outputs pickle in 18 µs where the objects took 56 µs (2-core VM), on the
    engine thread between two steps. Unpickled as a plain list, in the same order."""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        rids: list[str] = []
        toks: list[int] = []
        n_out: list[int] = []
        n_prompt: list[int] = []
        n_cached: list[int] = []
        rest: list[tuple[int, RequestOutput]] = []
        for i, o in enumerate(self):
            ids = o.new_token_ids
            if o.logprobs is None and not o.finished and not o.leased and len(ids) == 1:
                rids.append(o.request_id)
                toks.append(ids[0])
                n_out.append(o.num_output_tokens)
                n_prompt.append(o.num_prompt_tokens)
                n_cached.append(o.num_cached_tokens)
            else:
                rest.append((i, o))
        return _unpack_outputs, (rids, toks, n_out, n_prompt, n_cached, rest)


def _unpack_outputs(rids: list[str], toks: list[int], n_out: list[int], n_prompt: list[int], n_cached: list[int],
                    rest: list[tuple[int, RequestOutput]]) -> list[RequestOutput]:
    """``OutputBatch``'s columns back into outputs; the others go back to their places (in ascending order, each
    insert lands where it was)."""
    outs = [RequestOutput(r, [t], None, False, None, p, n, c) for r, t, n, p, c in zip(rids, toks, n_out, n_prompt,
                                                                                       n_cached)]
    for i, o in rest:
        outs.insert(i, o)
    return outs


@dataclass(slots=True)
class KvImport:
    """Where a prefilled request's KV goes on this worker.

    ``local_block_ids[i]`` receives the remote prompt block ``num_cached_blocks + i``; the first
    ``num_cached_blocks`` blocks were already in this worker's prefix cache and are not pulled."""

    request_id: str
    local_block_ids: list[int]
    num_cached_blocks: int


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
class _InFlight:
    """A step whose picks are queued on the device and not read yet, or (``picks`` None) not queued yet: its
    sampling sequences, in row order."""

    seqs: list[Sequence]
    picks: PendingSample | None
    rows: dict[int, int]  # id(seq) → its row in ``picks.tokens``
    # left on the device while the next step launches (async scheduling; a step with a constrained row only with
    # async_constrained, its pick queued by the next call; without it such a step hands its tokens out now, and
    # their masks fill beside the next schedule and forward)
    overlap: bool
    logits: torch.Tensor | None = None  # a pick not queued yet: its rows' logits


class LLMEngine:
    """Paged-KV, continuously batched inference over one model. Token ids in, token ids out.

    With ``tensor_parallel_size`` N > 1 this process is rank 0 and the engine spawns N - 1 processes for the other
    ranks (``common/tensor_parallel.py``); ``close`` (or leaving a ``with`` block) stops them."""

    def __init__(self, source: ModelSource, cfg: EngineConfig | None = None, model: LlamaModel | None = None) -> None:
        """``model``: reuse another engine's loaded weights (same source, dtype and device); it is read-only.
        Raises ValueError for a tensor-parallel size the model's heads or the machine's GPUs cannot take."""
        self.cfg = cfg or EngineConfig()
        self.source = source
        self.model_cfg = source.config
        self.tokenizer: TextTokenizer | None = source.tokenizer
        self.tp: TensorParallelWorkers | None = None
        self._grammars: GrammarCompiler | None = None  # built at the first constrained request
        self._grammars_lock = threading.Lock()
        if self.cfg.tensor_parallel_size > 1:
            if model is not None:
                raise ValueError("a shared model cannot serve a tensor-parallel engine: each rank loads its own part")
            self.tp = TensorParallelWorkers(source, self.cfg)
        try:
            self.runner = ModelRunner(source, self.cfg, model, self.tp.shard if self.tp else SINGLE)
        except BaseException:
            self.close()
            raise
        self.max_model_len = min(self.cfg.max_model_len or self.model_cfg.max_position_embeddings,
                                 self.model_cfg.max_position_embeddings)
        self.block_manager = BlockManager(
            self.runner.num_blocks, self.cfg.block_size, source.model_id, self.cfg.enable_prefix_caching,
            self.cfg.kv_run_window,
        )
        self.scheduler = Scheduler(
            self.block_manager, self.cfg.max_num_batched_tokens, self.cfg.max_num_seqs, self.cfg.enable_chunked_prefill,
            self.cfg.batch_prefill_tokens_beside_urgent, self.cfg.prompt_tokens_beside_decodes,
            self.cfg.batch_decode_rows_beside_urgent, self.cfg.batch_yield_max_steps,
        )
        self._seqs: dict[str, Sequence] = {}  # waiting or running
        self._pending_kv: dict[str, Sequence] = {}  # prefilled elsewhere, KV on its way
        self._leased: dict[str, Sequence] = {}  # prefill-only, done: blocks held for a decode worker
        self._prefill_only: set[str] = set()
        self._counter = itertools.count()
        self._rng = random.Random(self.cfg.seed)
        # a tokenizer smaller than the model's vocabulary (a dummy model with another model's tokenizer): sample
        # only ids it can decode
        vocab = self.model_cfg.vocab_size
        self.sample_vocab = min(vocab, self.tokenizer.vocab_size) if self.tokenizer is not None else vocab
        if self.cfg.noop_model:
            self.sample_vocab = 1  # its logits have one column
        self.sampler = Sampler(self.sample_vocab, self.runner.device, self.cfg.max_num_seqs,
                               cuda_graphs=self.cfg.cuda_graphs and self.cfg.cuda_fast_path)
        asked = self.cfg.async_scheduling
        self.async_scheduling = self.runner.device.type == "cuda" if asked is None else asked
        self._inflight: _InFlight | None = None  # async scheduling: the last step, its tokens not read yet
        self._feed_uploads = PinnedUploads(self.runner.device)
        # the last feed's (decode row, pick row) pairs and their index on the device (``_feed``)
        self._feed_index: tuple[list[tuple[int, int]], torch.Tensor] | None = None
        self.num_generated_tokens = 0
        self.track_latencies = False  # keep each queue time and time to first token for ``drain_latencies``
        self.reset_step_counters()

    @classmethod
    def from_spec(cls, model: str | None = None, cfg: EngineConfig | None = None) -> LLMEngine:
        return cls(load_model_source(model), cfg)

    def close(self) -> None:
        """Stop the other tensor-parallel ranks' processes (nothing to do with one rank). The engine cannot step
        afterwards. Safe to call twice."""
        if self.tp is not None:
            self.tp.close()
        if self._grammars is not None:
            self._grammars.close()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- intake ----------------------------------------------------------------------------------------
    @property
    def limits(self) -> RequestLimits:
        """The checks of a request that read only what is fixed once the engine is up."""
        return RequestLimits(self.model_cfg.vocab_size, self.max_model_len, self.block_manager.block_size,
                             self.block_manager.num_blocks, self.tokenizer is not None)

    def validate(self, prompt_ids: Seq[int], params: SamplingParams) -> int:
        """Check a request (``RequestLimits.check``, then its grammar compiled and cached); return its effective
        max_tokens. Raises RequestError."""
        max_tokens = self.limits.check(prompt_ids, params)
        if params.structured is not None:
            try:  # compiled (and cached) here, off the engine thread in the workers: a bad one is refused
                self.grammars.compile(params.structured)
            except GrammarError as e:
                raise RequestError(str(e)) from e
        return max_tokens

    @property
    def grammars(self) -> GrammarCompiler:
        """The worker's grammar compiler and cache (``common/structured.py``). Raises RequestError without a
        tokenizer. Thread-safe."""
        with self._grammars_lock:
            if self._grammars is None:
                if self.tokenizer is None or self.cfg.noop_model:
                    raise RequestError("structured outputs need the model's tokenizer; this model has none")
                # the model's EOS ids the tokenizer has; a model run under a smaller tokenizer (a dummy under
                # SmolLM2's) ends a grammar on the tokenizer's own EOS
                eos = [i for i in self.model_cfg.eos_token_ids if i < self.sample_vocab]
                own = self.tokenizer.tk.token_to_id(self.tokenizer.eos_token) if self.tokenizer.eos_token else None
                if not eos and own is not None:
                    eos = [own]
                self._grammars = GrammarCompiler(self.tokenizer.tk.to_str(), self.sample_vocab, eos,
                                                 fill_process=self.cfg.grammar_process,
                                                 threads=self.cfg.grammar_threads, max_rows=self.cfg.max_num_seqs)
            return self._grammars

    def grammar_matcher(self, params: SamplingParams, prior: Seq[int] = ()) -> GrammarMatcher | None:
        """A fresh matcher for a request's constraint, advanced past ``prior``; None when it has none. Raises
        RequestError naming what is wrong with the constraint."""
        if params.structured is None:
            return None
        try:
            return self.grammars.matcher(params.structured, prior)
        except GrammarError as e:
            raise RequestError(str(e)) from e

    def _new_seq(
        self, request_id: str, prompt_ids: Seq[int], params: SamplingParams, priority: int, cache_salt: str,
        prior_output_ids: Seq[int] = (), tenancy: Tenancy = DEFAULT_TENANCY,
    ) -> Sequence:
        if request_id in self._seqs or request_id in self._pending_kv or request_id in self._leased:
            raise ValueError(f"request id {request_id!r} is already running")
        max_tokens = self.validate(prompt_ids, params)
        if len(prior_output_ids) >= max_tokens:
            raise RequestError(f"{len(prior_output_ids)} tokens were already generated and max_tokens is "
                               f"{max_tokens}: nothing is left to generate")
        return Sequence(
            matcher=self.grammar_matcher(params, prior_output_ids),
            output_ids=[int(t) for t in prior_output_ids],
            request_id=request_id,
            prompt_ids=[int(t) for t in prompt_ids],
            params=params,
            seed=params.seed if params.seed is not None else self._rng.getrandbits(62),
            max_tokens=max_tokens,
            priority=priority,
            arrival_seq=next(self._counter),
            cache_salt=cache_salt,
            tenancy=tenancy,
        )

    def add_request(
        self,
        request_id: str,
        prompt_ids: Seq[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str = "",
        prefill_only: bool = False,
        prior_output_ids: Seq[int] = (),
        tenancy: Tenancy = DEFAULT_TENANCY,
    ) -> None:
        """Queue a request. Raises RequestError for invalid input, ValueError for a duplicate id.

        ``tenancy``: whose request it is, its class, the tenant's weight and cap (the scheduler's fair share).

        ``prefill_only``: compute the prompt, sample the first token, then keep the prompt's blocks under a lease
        (its output is ``leased`` and carries ``kv_block_ids``) until ``release``. ``prior_output_ids``: tokens this request already
        generated elsewhere (a stream moved off a failed worker): they count as outputs (max_tokens, penalties,
        a seeded row's positions), are recomputed with the prompt, and only what follows them is returned."""
        seq = self._new_seq(request_id, prompt_ids, params, priority, cache_salt, prior_output_ids, tenancy)
        self._seqs[request_id] = seq
        if prefill_only:
            self._prefill_only.add(request_id)
        self.scheduler.add(seq)

    def pulls_kv(self) -> None:
        """This engine receives prompts' KV from prefill workers (a decode worker of a disaggregated layout): its
        allocations look for contiguous runs (fewer descriptors a READ), and the prompts it still computes itself
        (those the router could not send to a prefill worker) get at most ``DISAGG_PROMPT_TOKENS_BESIDE_DECODES``
        tokens a step beside its decoding sequences unless ``prompt_tokens_beside_decodes`` is configured."""
        self.block_manager.find_runs = True
        if self.cfg.prompt_tokens_beside_decodes is None:
            self.scheduler.prompt_tokens_beside_decodes = DISAGG_PROMPT_TOKENS_BESIDE_DECODES

    def add_prefilled(
        self,
        request_id: str,
        prompt_ids: Seq[int],
        first_token: int,
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str = "",
        first_logprob: TokenLogprob | None = None,
        tenancy: Tenancy = DEFAULT_TENANCY,
    ) -> tuple[RequestOutput, KvImport | None]:
        """A request whose prompt another worker computed. Returns the first token's output and, when it goes
        on, the local blocks to fill (``kv_ready`` / ``kv_failed`` afterwards). With no room for its blocks now, it
        is queued to recompute locally instead (KvImport is None, same output)."""
        seq = self._new_seq(request_id, prompt_ids, params, priority, cache_salt, tenancy=tenancy)
        if seq.matcher is not None and not seq.matcher.accept(int(first_token)):
            assert params.structured is not None  # the matcher was compiled from it
            raise RequestError(f"the first token {first_token} does not follow the request's "
                               f"{params.structured.kind.replace('_', ' ')} constraint")
        seq.output_ids.append(int(first_token))
        out = self._token_output(seq, int(first_token), first_logprob)
        if out.finished:
            return out, None
        bm = self.block_manager
        bm.admit(seq)  # this worker's own prefix cache: blocks it need not pull
        cached = len(seq.block_ids)
        if not bm.can_allocate(bm.blocks_needed(seq.num_prompt_tokens) - cached):
            bm.free(seq)
            seq.num_computed_tokens = 0
            self._seqs[request_id] = seq
            self.scheduler.add(seq)
            return out, None
        bm.allocate(seq, seq.num_prompt_tokens)
        self._pending_kv[request_id] = seq
        return out, KvImport(request_id, seq.block_ids[cached:], cached)

    def kv_ready(self, request_id: str) -> None:
        """The pulled KV landed: the request joins the running batch at the next step."""
        seq = self._pending_kv.pop(request_id)
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.block_manager.commit_full_blocks(seq)
        seq.status = SequenceStatus.RUNNING
        self.scheduler.add_running(seq)
        self._seqs[request_id] = seq

    def kv_failed(self, request_id: str) -> None:
        """The pull failed or its lease expired: recompute the prompt here (the output is the same)."""
        seq = self._pending_kv.pop(request_id)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    def release(self, request_id: str) -> bool:
        """Free a prefill-only request's leased blocks. False if it holds none."""
        seq = self._leased.pop(request_id, None)
        if seq is None:
            return False
        self.block_manager.free(seq)
        return True

    def abort(self, request_id: str) -> bool:
        """Cancel a request wherever it is and free its blocks. False if it is unknown or finished."""
        self._prefill_only.discard(request_id)
        seq = self._seqs.pop(request_id, None) or self._pending_kv.pop(request_id, None)
        if seq is None:
            return self.release(request_id)
        self.sampler.release(request_id)
        self.scheduler.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = FinishReason.ABORT
        return True

    def has_unfinished(self) -> bool:
        """Work to schedule, or tokens on the device not handed out yet (of requests not aborted since)."""
        if self._inflight is not None and not any(self._live(s) for s in self._inflight.seqs):
            self._inflight = None  # every row was aborted: nothing to hand out
        return self.scheduler.has_work() or self._inflight is not None

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def num_by_class(self, klass: PriorityClass) -> tuple[int, int]:
        """(waiting, running) sequences of ``klass``."""
        return self.scheduler.waiting.num_waiting_by_class[klass], self.scheduler.num_running_by_class[klass]

    @property
    def num_leased(self) -> int:
        return len(self._leased)

    def reset_step_counters(self) -> None:
        """Steps, and every step's wall time, decode rows and prompt tokens, summed (/metrics:
        ``tokenmill:engine_step*``), from zero."""
        self.num_steps = 0
        self.step_seconds = 0.0
        self.step_phase_seconds = dict.fromkeys(STEP_PHASES[:-1], 0.0)  # timed; "other" is what is left
        self.step_decode_rows = 0
        self.step_prompt_tokens = 0
        # requests: arrival to the first step that computes their prompt (``queued``), and arrival to a first token
        # computed here (prefilled elsewhere: not counted); sums and counts, and with ``track_latencies`` each one
        # kept until ``drain_latencies`` (/metrics: tokenmill:request_queue_time_seconds,
        # tokenmill:engine_time_to_first_token_seconds)
        self.queue_seconds = 0.0
        self.num_queued = 0
        self.first_token_seconds = 0.0
        self.num_first_tokens = 0
        self._queue_times: list[float] = []
        self._first_token_times: list[float] = []

    def drain_latencies(self) -> tuple[list[float], list[float]]:
        """The queue times and times to first token since the last call (``track_latencies``)."""
        out = self._queue_times, self._first_token_times
        self._queue_times, self._first_token_times = [], []
        return out

    # -- the loop --------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine iteration: schedule → execute → sample → update. Returns the tokens it produced; with async
        scheduling, those of the step before (its own are read by the next call: ``has_unfinished`` stays true
        until they are)."""
        t0 = time.perf_counter()
        phase = self.step_phase_seconds
        prev, self._inflight = self._inflight, None
        out = self.scheduler.schedule()
        deferred = prev is not None and prev.picks is None  # its masks fill while the host schedules this step
        if deferred:
            assert prev is not None
            prev = self._live_rows(prev)  # rows aborted since its step() call are dropped
        if out.is_empty:
            if prev is None:  # nothing to run: no step, in no counter
                return []
            t1 = time.perf_counter()
            phase["schedule"] += t1 - t0
            if deferred:
                self._queue_pick(prev)
                phase["sample"] += time.perf_counter() - t1
            outputs = self._resolve(prev)
            self.step_seconds += time.perf_counter() - t0
            return outputs
        if self._grammars is not None:
            self._grammars.mirror_strays()
            self._grammars.flush()  # matchers made since the last step: their first masks fill beside the forward
        for it in out.prefills:
            seq = it.seq
            if seq.first_scheduled is None:
                seq.first_scheduled = now = time.monotonic()
                self.queue_seconds += now - seq.arrival
                self.num_queued += 1
                if self.track_latencies:
                    self._queue_times.append(now - seq.arrival)
        sampling = [it.seq for it in (*out.prefills, *out.decodes) if it.samples]
        t1 = time.perf_counter()
        phase["schedule"] += t1 - t0
        staged = None
        if deferred and prev is not None:
            # this step's rows staged first, so the masks have that long too (on a GPU the host does not wait for
            # them: the device does); then the pick, then the launch
            staged = self.runner.stage(out)
            self._queue_pick(prev)
        logits = self.runner.execute(out, self._feed(out, prev), staged)
        phase["launch"] += time.perf_counter() - t1  # the deferred pick queued above counts here too
        self.num_steps += 1
        outputs = self._resolve(prev) if prev is not None else []
        self.scheduler.update_after_step(out)
        t2 = time.perf_counter()
        picks = self._launch(sampling, logits)
        phase["sample"] += time.perf_counter() - t2
        if picks is not None:
            if picks.overlap:
                self._inflight = picks
            else:
                outputs += self._resolve(picks)
        self.step_decode_rows += len(out.decodes)
        self.step_prompt_tokens += out.num_tokens - len(out.decodes)
        self.step_seconds += time.perf_counter() - t0
        return outputs

    def grammar_mask_counts(self) -> dict[str, int]:
        """The constrained rows' masks so far by where they came from (``GrammarCompiler.mask_counts``); empty
        before the first constrained request."""
        g = self._grammars
        return g.mask_counts() if g is not None else {}

    def grammar_fill_stats(self) -> dict[str, float]:
        """The grammar mask process's batches and fill time (``GrammarCompiler.fill_stats``); empty without it."""
        g = self._grammars
        return g.fill_stats() if g is not None else {}

    def step_phases(self) -> dict[str, float]:
        """Seconds of the steps' host time by phase (STEP_PHASES), "other" the rest of ``step_seconds``."""
        timed = self.step_phase_seconds
        return {**timed, "other": max(0.0, self.step_seconds - sum(timed.values()))}

    def _feed(self, out: SchedulerOutput, prev: _InFlight | None) -> TokenFeed | None:
        """The decodes whose input id the previous step sampled and the host has not read yet."""
        if prev is None:
            return None
        pairs = [(i, prev.rows[id(d.seq)]) for i, d in enumerate(out.decodes) if d.seq.pending]
        if not pairs:
            return None
        last = self._feed_index
        if last is not None and last[0] == pairs:  # a steady batch: the same rows as the step before, not sent again
            index = last[1]
        else:
            index = self._feed_uploads.tensor("feed", [[i for i, _ in pairs], [j for _, j in pairs]], torch.long)
            self._feed_index = (pairs, index)
        assert prev.picks is not None  # queued by now (``step``)
        return TokenFeed(prev.picks.tokens, index, self.runner.shard)

    def _launch(self, sampling: list[Sequence], logits: torch.Tensor | None) -> _InFlight | None:
        """Queue the pick of each sampling sequence that is still live (one finished or aborted since it was
        scheduled has its row dropped); with async_constrained (the default with async scheduling), a step with a
        constrained row is only marked pending here, its pick queued by the next call (``step``)."""
        if not sampling or logits is None:
            return None
        step = self._live_rows(_InFlight(sampling, None, {}, False, logits))
        if step is None:
            return None
        constrained = any(s.matcher is not None for s in step.seqs)
        step.overlap = self.async_scheduling and (not constrained or self.cfg.async_constrained is not False)
        if step.overlap:
            for s in step.seqs:
                s.pending = 1
                n = len(s.output_ids) + 1
                s.pending_final = (s.request_id in self._prefill_only or n >= s.max_tokens
                                   or s.num_tokens + 1 >= self.max_model_len)
            if constrained:
                return step
        self._queue_pick(step)
        return step

    def _live_rows(self, step: _InFlight) -> _InFlight | None:
        """``step`` without the rows finished (an abort finishes one too) since it was scheduled (None: none left)."""
        live = [i for i, s in enumerate(step.seqs) if s.status is not SequenceStatus.FINISHED]
        if len(live) == len(step.seqs):
            return step
        if not live:
            return None
        assert step.logits is not None
        step.logits = step.logits.index_select(0, self._feed_uploads.tensor("live", live, torch.long))
        step.seqs = [step.seqs[i] for i in live]
        return step

    def _queue_pick(self, step: _InFlight) -> None:
        """Queue the pick of ``step``'s rows on the device (``step.picks``)."""
        logits = step.logits
        assert logits is not None
        eos = self.model_cfg.eos_token_ids
        rows = [SampleRow(s.params, s.seed, len(s.output_ids), s.prompt_ids, s.output_ids, eos, s.request_id,
                          s.matcher) for s in step.seqs]
        if logits.shape[1] > self.sample_vocab:
            logits = logits[:, : self.sample_vocab]
        with torch.inference_mode():
            step.picks = self.sampler.launch(logits, rows)
        step.rows = {id(s): j for j, s in enumerate(step.seqs)}
        step.logits = None

    def _resolve(self, step: _InFlight) -> list[RequestOutput]:
        """Read a step's tokens and hand them out: appended, stop checks, finished requests freed."""
        assert step.picks is not None
        t0 = time.perf_counter()
        result = step.picks.result()
        t1 = time.perf_counter()
        self.step_phase_seconds["wait"] += t1 - t0
        sampling, toks, lps = step.seqs, result.token_ids, result.logprobs
        for s in sampling:
            s.pending, s.pending_final = 0, False
        live = self._seqs.get
        keep = [j for j, s in enumerate(sampling) if live(s.request_id) is s]  # ``_live``, inline: every row
        if len(keep) < len(sampling):  # aborted while its token was on the device
            sampling, toks, lps = [sampling[j] for j in keep], [toks[j] for j in keep], [lps[j] for j in keep]
        self._send_tokens(sampling, toks)  # the next masks start before the rows below
        now = time.monotonic()
        outputs = []
        for s, tok, lp in zip(sampling, toks, lps):
            broken = s.matcher is not None and not s.matcher.consume(tok)
            if broken:  # cannot happen while the mask holds; ends the request rather than the engine
                log.error("request %s: token %d does not follow its grammar; finishing it", s.request_id, tok)
                s.matcher = None
            s.output_ids.append(tok)
            if s.first_token_time is None:
                s.first_token_time = now
                if len(s.output_ids) == 1:  # computed here (a prefilled or moved stream came with its first)
                    self.first_token_seconds += now - s.arrival
                    self.num_first_tokens += 1
                    if self.track_latencies:
                        self._first_token_times.append(now - s.arrival)
            o = self._token_output(s, tok, TokenLogprob(tok, lp[0], lp[1]) if lp is not None else None)
            if broken and not o.finished:
                s.status, s.finish_reason = SequenceStatus.FINISHED, FinishReason.STOP
                o.finished, o.finish_reason = True, FinishReason.STOP
            prefill_only = bool(self._prefill_only) and s.request_id in self._prefill_only
            if o.finished or prefill_only:
                self.sampler.release(s.request_id)
            if prefill_only:
                self._finish_prefill_only(s, o)
            elif o.finished:
                self.scheduler.remove(s)
                self._seqs.pop(s.request_id, None)
            outputs.append(o)
        self.num_generated_tokens += len(outputs)
        self.step_phase_seconds["outputs"] += time.perf_counter() - t1
        return outputs

    def _send_tokens(self, seqs: list[Sequence], toks: list[int]) -> None:
        """The constrained rows' tokens to the grammar mask process, which starts on their next masks."""
        if self._grammars is not None and self._grammars.masks is not None:
            GrammarMatcher.send_all([s.matcher for s in seqs], toks, self._grammars.masks)
            self._grammars.flush()

    def _live(self, s: Sequence) -> bool:
        """Not aborted: still the engine's sequence under its id (a new request may reuse an aborted one's id)."""
        return self._seqs.get(s.request_id) is s

    def _token_output(self, s: Sequence, tok: int, lp: TokenLogprob | None) -> RequestOutput:
        """Token-level stop checks (EOS, stop token ids, max_tokens, context) for the token just appended."""
        p = s.params
        reason: FinishReason | None = None
        stop_tok = (not p.ignore_eos and tok in self.model_cfg.eos_token_ids) or tok in p.stop_token_ids
        n_out = len(s.output_ids)
        at_limit = n_out >= s.max_tokens or len(s.prompt_ids) + n_out >= self.max_model_len
        grammar_done = False
        if s.matcher is not None and self._grammars is not None:
            # a grammar allows EOS only where it is complete, and EOS only once it is complete (or broken); at the
            # length limit a complete grammar ends with stop too (its matcher catches up: once a request)
            grammar_done = tok in self._grammars.eos_ids or (at_limit and s.matcher.terminated)
        if (stop_tok and n_out >= p.min_tokens) or grammar_done:
            reason = FinishReason.STOP
        if reason is None and at_limit:
            reason = FinishReason.LENGTH
        if reason is not None:
            s.status = SequenceStatus.FINISHED
            s.finish_reason = reason
        return RequestOutput(
            request_id=s.request_id,
            new_token_ids=[tok],
            logprobs=[lp] if lp is not None else None,
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=len(s.prompt_ids),
            num_output_tokens=n_out,
            num_cached_tokens=s.num_cached_tokens,
        )

    def _finish_prefill_only(self, s: Sequence, o: RequestOutput) -> None:
        """Hand the prompt's blocks to a lease; they stay allocated until ``release``.

        If the first token already ends the request, there is nothing to decode: the blocks are freed."""
        self._prefill_only.discard(s.request_id)
        self._seqs.pop(s.request_id, None)
        s.matcher = None  # the decode worker replays the first token on its own matcher
        if o.finished:
            self.scheduler.remove(s)
            return
        self.scheduler.detach(s)
        prompt_blocks = self.block_manager.blocks_needed(s.num_prompt_tokens)
        o.kv_block_ids = s.block_ids[:prompt_blocks]
        o.leased = True
        self._leased[s.request_id] = s

    # -- offline convenience ---------------------------------------------------------------------------
    def generate(
        self,
        prompts: Iterable[Seq[int]],
        params: SamplingParams | Seq[SamplingParams],
        progress: bool = False,
    ) -> list[CompletionResult]:
        """Run every prompt to completion; results in input order. Raises RequestError before any work."""
        lists = [list(p) for p in prompts]
        plist = [params] * len(lists) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(lists):
            raise ValueError(f"{len(lists)} prompts but {len(plist)} sampling params")
        for ids, p in zip(lists, plist):
            self.validate(ids, p)
        texts = OutputProcessor(self.tokenizer)
        rids = [f"gen-{next(self._counter)}" for _ in lists]
        acc: dict[str, CompletionResult] = {}
        for rid, prompt, p in zip(rids, lists, plist):
            self.add_request(rid, prompt, p)
            texts.add(rid, prompt, p)
            acc[rid] = CompletionResult(rid, prompt, [], "", "", [] if p.logprobs is not None else None)
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(lists), desc="generate", unit="req", dynamic_ncols=True)
        done = 0
        while done < len(lists):
            for o in self.step():
                d = texts.process(o.request_id, o.new_token_ids, o.finished, o.finish_reason)
                if d is None:
                    continue  # a stop string already ended it
                r = acc[o.request_id]
                r.token_ids.extend(d.token_ids)
                r.text += d.text
                if o.logprobs and r.logprobs is not None:
                    r.logprobs.extend(o.logprobs)
                if d.finished:
                    if d.stopped_by_string:
                        self.abort(o.request_id)
                    r.finish_reason = d.finish_reason.value if d.finish_reason else ""
                    r.num_cached_tokens = o.num_cached_tokens
                    done += 1
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [acc[r] for r in rids]

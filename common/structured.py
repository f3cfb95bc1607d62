"""Grammar-constrained decoding with llguidance: constraints compiled to grammars, one matcher per sequence, and
the per-step token bitmask the sampler applies (``common/sampler.py``).

llguidance was chosen over xgrammar by measurement on SmolLM2's tokenizer (docs/architecture.md, "Structured
outputs"): it builds a JSON-schema grammar in about a millisecond where xgrammar's compile takes tens to hundreds,
and its per-row mask costs less on average. It has no Python dependencies. No torch here: the gateway imports this
module to validate a constraint before dispatch.
"""

from __future__ import annotations

import functools
import json
import logging
import mmap
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import llguidance as llg
import numpy as np
from llguidance.gbnf_to_lark import gbnf_to_lark

from common.grammar_proc import READY_BYTES, MaskProcess, compute_masks, make_executor, make_tokenizer
from common.sampling import StructuredOutput

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # declared in the stub only

log = logging.getLogger(__name__)

# JSON is generated with the separators the model writes itself (``{"a": 1, "b": 2}``) and no free whitespace:
# the model cannot pad an object with spaces until max_tokens runs out.
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_MAX_ERROR = 400  # characters of llguidance's message kept in an error (it appends its whole state)


class GrammarError(ValueError):
    """The constraint cannot be compiled; the message names the problem."""


@functools.lru_cache(maxsize=256)
def grammar_text(so: StructuredOutput) -> str:
    """The llguidance grammar (its JSON form) of ``so``. Raises GrammarError for text that is not JSON, an empty
    choice list, or a kind it does not know; the grammar itself is checked by :func:`check`. The last ones are
    remembered: a worker makes a matcher, and sends the mask process its grammar, for every constrained request
    (50 µs a JSON schema on the 2-core VM)."""
    if so.kind == "json_schema":
        try:
            schema = json.loads(so.spec)
        except ValueError as e:
            raise GrammarError(f"json_schema is not valid JSON: {e}") from e
        if not isinstance(schema, dict):
            raise GrammarError(f"json_schema must be a JSON object, got {type(schema).__name__}")
        return llg.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    if so.kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    if so.kind == "regex":
        return llg.LLMatcher.grammar_from_regex(so.spec)
    if so.kind == "choice":
        if not so.choices:
            raise GrammarError("choice needs at least one string")
        if any(not c for c in so.choices):
            raise GrammarError("choice strings must be non-empty")
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in so.choices))
    if so.kind == "grammar":
        text = so.spec
        if "::=" in text:  # GBNF (llama.cpp's and xgrammar's EBNF); Lark uses ':'
            try:
                text = gbnf_to_lark(text)
            except Exception as e:  # the converter raises plain exceptions on malformed input
                raise GrammarError(f"grammar is not valid GBNF: {e}") from e
        return llg.LLMatcher.grammar_from_lark(text)
    raise GrammarError(f"unknown structured output kind {so.kind!r}")


def _describe(so: StructuredOutput, error: str) -> str:
    head = error.split("<state>")[0].split("<grammar>")[0]
    text = " ".join(head.split()) or "rejected by the grammar compiler"
    return f"invalid {so.kind.replace('_', ' ')}: {text[:_MAX_ERROR]}"


def check(so: StructuredOutput) -> None:
    """Check the constraint without a tokenizer (the gateway, before dispatch). Raises GrammarError. The last
    answers are remembered: the n choices of a request, and clients that repeat a schema, check once."""
    err = _check(so)
    if err:
        raise GrammarError(err)


@functools.lru_cache(maxsize=256)
def _check(so: StructuredOutput) -> str:
    try:
        err = llg.LLMatcher.validate_grammar(grammar_text(so))
    except GrammarError as e:
        return str(e)
    return _describe(so, err) if err and not err.startswith("WARNING") else ""


class MaskTable:
    """Where a compiler's matchers' masks are read from: int32 rows of ``words`` (bit ``t % 32`` of word ``t // 32``
    set when token t is allowed next), in host memory that a GPU reads in place (the sampler registers it), so a
    step's masks are never copied. With the grammar mask process: its shared rows, one per mirrored matcher (its
    slot), then ``inline`` rows the engine thread fills for the other matchers; without the process, those only.

    A step's rows are read by its pick on the device before the matchers advance again (the engine reads the
    pick's tokens first), so the next fill never writes under a pick still reading.

    ``shared``: the whole memory as int32, for the device to read in place: the rows, and at its end ``answered``
    (int64: the last batch the mask process has answered; ``grammar_proc.READY_BYTES``)."""

    def __init__(self, words: int, inline: int, remote: MaskProcess | None, threads: int) -> None:
        self.remote, self.inline = remote, inline
        self.executor = _Executor(threads) if threads != 1 else None
        self.filled_here = 0  # masks filled by the engine's thread (rows the mask process does not serve), summed
        if remote is not None:
            self.shared, self.host, self.answered, self.base = remote.shared, remote.rows, remote.answered, remote.capacity
        else:
            nbytes = -(-inline * words * 4 // READY_BYTES) * READY_BYTES + READY_BYTES
            mem = mmap.mmap(-1, nbytes)
            self.shared = np.frombuffer(mem, np.int32)
            self.host = self.shared[: inline * words].reshape(inline, words)
            self.answered = np.frombuffer(mem, np.int64, count=1, offset=nbytes - READY_BYTES)
            self.base = 0

    def fill(self, matchers: Sequence[GrammarMatcher], wait: bool = True) -> tuple[list[int], int]:
        """The row of ``host`` with each matcher's next mask: the mask process's, else filled here, several in
        parallel without the GIL; and the batch of the mask process's that those rows need, 0 for none. With
        ``wait`` it has been answered already; without, the reader waits until ``answered`` reaches it."""
        at, need = self.remote.locate(matchers, wait) if self.remote is not None else ([-1] * len(matchers), 0)
        if not at or min(at) >= 0:  # every row the mask process's (a decode batch's steady state)
            return at, need
        todo = [i for i, a in enumerate(at) if a < 0]
        if len(todo) > self.inline:
            raise ValueError(f"{len(todo)} constrained rows in one pick; the mask table has {self.inline} rows "
                             f"(GrammarCompiler's max_rows)")
        for k, i in enumerate(todo):
            at[i] = self.base + k
        if todo:
            self.filled_here += len(todo)
            compute_masks(self.executor, [(matchers[i].raw, at[i]) for i in todo], self.host.ctypes.data,
                          self.host.shape[1] * 4)
        return at, need


class _Executor:
    """llguidance's parallel executor (its thread pool), made at the first fill of several rows inline."""

    def __init__(self, threads: int) -> None:
        self.threads = threads  # 0: llguidance's default
        self._ex: llg.LLExecutor | None = None

    def unsafe_compute_mask_ptr(self, rows: list[tuple[llg.LLMatcher, int]], base: int, row_bytes: int,
                                batch: int) -> None:
        if self._ex is None:
            self._ex = make_executor(self.threads)
        self._ex.unsafe_compute_mask_ptr(rows, base, row_bytes, batch)


class GrammarMatcher:
    """One sequence's position in its grammar. Not thread-safe: the engine thread advances it.

    A matcher mirrored in the grammar mask process (``common/grammar_proc.py``) sends it every token the sequence
    takes, and leaves the advance to the mirror: its own llguidance matcher, 1-80 µs a token, catches up only when
    the engine needs it (an inline fill, ``terminated``, ``accept``). The engine never has to ask it: a grammar that
    is complete, or that a token broke, masks every token but EOS (llguidance's mask for a stopped or failed
    matcher), so the sequence ends on the EOS its next pick takes."""

    __slots__ = ("__weakref__", "_lag", "_m", "_remote", "_slot", "stray", "table")

    def __init__(self, m: llg.LLMatcher, table: MaskTable) -> None:
        self._m = m
        self.table = table  # its compiler's: where its masks are filled
        self._remote: MaskProcess | None = None
        self._slot = -1
        self._lag: list[int] = []  # tokens the mirror took and this matcher has not
        # a matcher the mask process could not take when it was made (not ready yet, no slot free): its grammar's
        # text and every token it has taken, to mirror it later (``GrammarCompiler.mirror_strays``)
        self.stray: tuple[str, list[int]] | None = None

    def mirror(self, remote: MaskProcess, slot: int) -> None:
        self._remote, self._slot = remote, slot
        self.stray = None

    def slot_in(self, remote: MaskProcess) -> int | None:
        return self._slot if self._remote is remote else None

    def accept(self, token: int) -> bool:
        """Advance by one token, checked here; False if the grammar does not allow it (the matcher is then
        broken)."""
        self.send(token)
        return self._own(token)

    def send(self, token: int) -> None:
        """The first half of ``consume``: the token to the mirror (sent at the next flush), if there is one."""
        if self._remote is not None:
            self._remote.advance(self._slot, token)

    @staticmethod
    def send_all(matchers: Sequence[GrammarMatcher | None], tokens: Sequence[int], remote: MaskProcess) -> None:
        """``send`` for a step's rows at once (None: a row without a constraint), in one pass: the matchers
        mirrored in ``remote``, their compiler's mask process, the only one they can be mirrored in."""
        remote.advance_all([m._slot << 32 | t for m, t in zip(matchers, tokens) if m is not None and m._remote is remote])

    def consume(self, token: int) -> bool:
        """The second half: this matcher's own advance, left to a live mirror (True), else done here (False: the
        grammar does not allow the token)."""
        if self._remote is not None and not self._remote.dead:
            self._lag.append(token)
            return True
        return self._own(token)

    def _own(self, token: int) -> bool:
        """This matcher's own advance (caught up first)."""
        if self.stray is not None:
            self.stray[1].append(token)
        return self._catch_up() and self._m.consume_token(token)

    def _catch_up(self) -> bool:
        if self._lag:
            lag, self._lag = self._lag, []
            return all(self._m.consume_token(t) for t in lag)
        return True

    @property
    def terminated(self) -> bool:
        """The grammar is complete and allows nothing more (its mask allows EOS only)."""
        self._catch_up()
        return self._m.is_stopped()

    @property
    def raw(self) -> llg.LLMatcher:
        """llguidance's matcher, caught up."""
        self._catch_up()
        return self._m


class GrammarCompiler:
    """A worker's grammars, compiled against its tokenizer and cached by constraint (LRU of ``capacity``).
    ``fill_process``: the matchers' masks are filled in a process beside the engine (``common/grammar_proc.py``).

    Thread-safe: workers validate (and so compile) off the engine thread."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Sequence[int], capacity: int = 256,
                 fill_process: bool = False, threads: int = 0, max_rows: int = 256) -> None:
        self._tok = make_tokenizer(tokenizer_json, vocab_size, eos_ids)
        self.eos_ids = frozenset(eos_ids)  # a grammar's end: the only tokens a complete grammar's mask allows
        self.masks: MaskProcess | None = None
        if fill_process:
            try:
                self.masks = MaskProcess(tokenizer_json, vocab_size, eos_ids, inline_rows=max_rows, threads=threads)
            except (OSError, AttributeError) as e:  # no memfd (not Linux), or no process could start
                log.warning("grammar masks are filled inline: the mask process could not start (%s)", e)
        # ``max_rows``: the most constrained rows one pick has (the engine's max_num_seqs)
        self.table = MaskTable((vocab_size + 31) // 32, max_rows, self.masks, threads)
        self.vocab_size = vocab_size
        self.capacity = capacity
        self._cache: OrderedDict[StructuredOutput, llg.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0
        # matchers made while the mask process could not take them, mirrored once it can (``mirror_strays``)
        self._strays: weakref.WeakSet[GrammarMatcher] = weakref.WeakSet()

    def mask_counts(self) -> dict[str, int]:
        """The constrained rows' masks so far, by where they came from (``/metrics``: tokenmill:grammar_masks):
        the mask process's cache of masks by place, llguidance in the mask process, the engine's own thread."""
        m = self.masks
        if m is not None:
            m.read_answers()
        cached = m.cached_rows if m is not None else 0
        return {"cache": cached, "process": (m.remote_rows - cached) if m is not None else 0,
                "inline": self.table.filled_here}

    def fill_stats(self) -> dict[str, float]:
        """The mask process's answered batches, the seconds it took to advance and fill them, summed, and those
        that took over ``grammar_proc.SLOW_FILL_S`` (``/metrics``: tokenmill:grammar_mask_*); empty without it."""
        m = self.masks
        if m is None:
            return {}
        m.read_answers()
        return {"batches": m.batches, "fill_seconds": m.fill_seconds, "slow_batches": m.slow_batches}

    def compile(self, so: StructuredOutput) -> llg.LLMatcher:
        """The constraint's initial matcher (shared: copy it). Raises GrammarError naming the problem."""
        with self._lock:
            m = self._cache.get(so)
            if m is not None:
                self._cache.move_to_end(so)
                self.hits += 1
                return m
        m = llg.LLMatcher(self._tok, grammar_text(so), log_level=0)
        if m.is_error():
            raise GrammarError(_describe(so, m.get_error()))
        with self._lock:
            self.misses += 1
            self._cache[so] = m
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        return m

    def matcher(self, so: StructuredOutput, prior: Sequence[int] = ()) -> GrammarMatcher:
        """A fresh matcher for one sequence, advanced past ``prior`` (tokens it already generated). Raises
        GrammarError for a bad constraint, or when ``prior`` does not follow it."""
        m = GrammarMatcher(self.compile(so).deep_copy(), self.table)
        for i, t in enumerate(prior):
            if not m.accept(int(t)):
                raise GrammarError(f"output token {i} ({t}) does not follow the {so.kind.replace('_', ' ')} "
                                   f"constraint")
        if self.masks is not None and not self.masks.register(m, text := grammar_text(so), prior):
            m.stray = (text, [int(t) for t in prior])
            self._strays.add(m)
        return m

    def flush(self) -> None:
        """Send what the matchers queued for the mask process (new matchers, accepted tokens): the engine calls it
        before each forward and right after each pick, so the next masks fill while it goes on."""
        if self.masks is not None:
            self.masks.flush()

    def mirror_strays(self) -> None:
        """Mirror the matchers the mask process could not take when they were made (a burst of requests before it
        was ready, no slot free), with every token they have taken, where it can now. Only where no matcher is
        between ``send`` and ``consume`` of a token (the engine: before a step's flush)."""
        if self.masks is None or not self._strays or self.masks.dead:
            return
        for m in list(self._strays):
            assert m.stray is not None
            text, taken = m.stray
            if not self.masks.register(m, text, taken):
                return
            self._strays.discard(m)

    def close(self) -> None:
        if self.masks is not None:
            self.masks.close()


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
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import llguidance as llg
import numpy as np
from llguidance.gbnf_to_lark import gbnf_to_lark

from common.grammar_proc import MaskProcess, compute_masks, make_executor, make_tokenizer
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


def grammar_text(so: StructuredOutput) -> str:
    """The llguidance grammar (its JSON form) of ``so``. Raises GrammarError for text that is not JSON, an empty
    choice list, or a kind it does not know; the grammar itself is checked by :func:`check`."""
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


def fill_bitmask(rows: Sequence[tuple[GrammarMatcher, int]], host: np.ndarray) -> None:
    """Write each matcher's allowed tokens, one bit per token id, into row ``i`` of ``host`` (an int32 [M, words]
    C-order array). Rows mirrored in the grammar mask process are copied from it; the rest are filled here, several
    in parallel, without the GIL."""
    remote = next((m._remote for m, _ in rows if m._remote is not None), None)
    if remote is not None:
        rows = remote.fill(rows, host)
        if not rows:
            return
    if rows:
        compute_masks(rows[0][0]._executor, [(m.raw, i) for m, i in rows], host.ctypes.data, host.shape[1] * 4)


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
    """One sequence's position in its grammar. Not thread-safe: the engine thread advances it. A matcher mirrored in
    the grammar mask process (``common/grammar_proc.py``) sends it every token it accepts."""

    __slots__ = ("__weakref__", "_executor", "_m", "_remote", "_slot")

    def __init__(self, m: llg.LLMatcher, executor: _Executor) -> None:
        self._m = m
        self._executor = executor  # its compiler's: fills a step's rows in parallel
        self._remote: MaskProcess | None = None
        self._slot = -1

    def mirror(self, remote: MaskProcess, slot: int) -> None:
        self._remote, self._slot = remote, slot

    def slot_in(self, remote: MaskProcess) -> int | None:
        return self._slot if self._remote is remote else None

    def accept(self, token: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it (the matcher is then broken)."""
        self.send(token)
        return self.consume(token)

    def send(self, token: int) -> None:
        """The first half of ``accept``: the token to the mirror (sent at the next flush), if there is one."""
        if self._remote is not None:
            self._remote.advance(self._slot, token)

    def consume(self, token: int) -> bool:
        """The second half of ``accept``: this matcher's own advance."""
        return self._m.consume_token(token)

    @property
    def terminated(self) -> bool:
        """The grammar is complete and allows nothing more: the sequence ends here."""
        return self._m.is_stopped()

    @property
    def accepting(self) -> bool:
        return self._m.is_accepting()

    @property
    def raw(self) -> llg.LLMatcher:
        return self._m


class GrammarCompiler:
    """A worker's grammars, compiled against its tokenizer and cached by constraint (LRU of ``capacity``).
    ``fill_process``: the matchers' masks are filled in a process beside the engine (``common/grammar_proc.py``).

    Thread-safe: workers validate (and so compile) off the engine thread."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Sequence[int], capacity: int = 256,
                 fill_process: bool = False, threads: int = 0) -> None:
        self._tok = make_tokenizer(tokenizer_json, vocab_size, eos_ids)
        self._executor = _Executor(threads)
        self.masks: MaskProcess | None = None
        if fill_process:
            try:
                self.masks = MaskProcess(tokenizer_json, vocab_size, eos_ids, threads=threads)
            except (OSError, AttributeError) as e:  # no memfd (not Linux), or no process could start
                log.warning("grammar masks are filled inline: the mask process could not start (%s)", e)
        self.vocab_size = vocab_size
        self.capacity = capacity
        self._cache: OrderedDict[StructuredOutput, llg.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

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
        m = GrammarMatcher(self.compile(so).deep_copy(), self._executor)
        for i, t in enumerate(prior):
            if not m.accept(int(t)):
                raise GrammarError(f"output token {i} ({t}) does not follow the {so.kind.replace('_', ' ')} "
                                   f"constraint")
        if self.masks is not None:
            self.masks.register(m, grammar_text(so), prior)
        return m

    def flush(self) -> None:
        """Send what the matchers queued for the mask process (new matchers, accepted tokens): the engine calls it
        before each forward and right after each pick, so the next masks fill while it goes on."""
        if self.masks is not None:
            self.masks.flush()

    def close(self) -> None:
        if self.masks is not None:
            self.masks.close()


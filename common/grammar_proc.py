"""Grammar masks filled in a process beside the engine, while the engine goes on with its next step.

A constrained row's mask (one bit per token its grammar allows next) costs llguidance tens to hundreds of µs, and
on a GPU a decode step of 32 rows takes about 1.5 ms of host time: filled inline, the masks add most of a step
(docs/benchmarks.md). On a thread of the engine's process the fill has to take the GIL back from the engine thread,
which holds it. So a child process (``python -m common.grammar_proc``, importing llguidance and nothing of torch)
keeps a mirror of every constrained sequence's matcher. When a step's update ends, the engine thread sends the
tokens its sequences took (``MaskProcess.flush``). The child advances its mirrors and fills their next masks into
shared memory, one row per sequence (its slot), in parallel, while the engine hands the step's tokens out,
schedules the next step and runs its forward. The pick reads the rows where the child wrote them. On a GPU the
host does not wait for them: the shared memory is registered with CUDA (``common/sampler.py``), the child writes
the number of each batch it has answered into a word after the rows (``answered``), and the pick's kernels, queued
at once, start behind a wait on the device for the batch its rows need (``triton_ops.wait_masks``), then read the
masks in place over PCIe, with nothing copied. On the CPU the engine waits for the child's answer (usually there
already).

The mirrors are the truth for a mirrored sequence: the engine's own matcher does not advance (1-80 µs a token on
the engine thread), it only keeps the tokens to catch up with if it is needed (``GrammarMatcher``). A grammar that
is complete, or that a token broke, masks every token but EOS, so the sequence ends on its next pick without the
engine asking. A matcher made before the child was ready, or when no slot was free, and a matcher whose tokens are
not sent yet, are filled inline, into rows after the child's. A child that dies or stops answering makes every
fill inline from then on, the engine's matchers caught up first.

The child keeps the masks it made inside JSON strings by their place in the document (``common/mask_cache.py``):
a row of the same schema at the same place later takes the mask from there instead of from llguidance, which
spends hundreds of µs on a mask near the end of a string bounded by ``maxLength``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import pickle
import select
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from common.mask_cache import MaskCache, PlaceKeys, token_bytes_of, token_reach

if TYPE_CHECKING:
    from common.structured import GrammarMatcher

log = logging.getLogger(__name__)

# ops, in the order they happened: (ADD, slot, grammar text, prior tokens), (DROP, slot), and an advance by one
# token as the int ``slot << 32 | token`` (the hot path: a list append, without the lock, on the engine thread)
ADD, DROP = 0, 2
# a message's length, then its pickle; with RAW set in the length, its body is int64 words instead: the batch's
# number, then its ops, every one an advance (a step's tokens, the hot path: no pickle)
_HEADER = struct.Struct("<Q")
RAW = 1 << 63
# an answer: the batch's sequence number, when (CLOCK_MONOTONIC ns) the child had read it, had advanced its matchers
# and had filled its masks, how many of its masks came from the cache of masks by place (common/mask_cache.py) and
# how many llguidance computed
_ANSWER = struct.Struct("<Qqqqqq")
# the end of the shared memory, after the rows, on a cache line of its own: the number of the last batch the child
# has filled masks for (int64; the device reads it in place), and at SENT_OFFSET in it the number of the last batch
# the engine has written to the pipe (the child spins on that word, not on the pipe: a read of an empty pipe takes
# the pipe's lock, which the engine's write then waits for)
READY_BYTES = 64
SENT_OFFSET = 32
# ``answered`` once the child is gone: every wait on the device passes (the rows it waits for then are stale; the
# engine fills inline from then on)
RELEASED = 1 << 62
REPLY_TIMEOUT_S = 5.0  # a child that has not answered a batch by then is taken for hung: fills go inline
# The child watches the engine's posted word (``SENT_OFFSET``) for this long after each batch before it sleeps in
# select: waking a process that sleeps on a pipe costs tens of µs, against a ~1 ms decode step of a small model on a
# GPU, and the child's start lies on the step's path (its read of a step's tokens on an H200: 0.04-0.07 ms asleep,
# 0.015-0.023 watching). Only where cores are plenty (a GPU host): on a small machine the watching would take a core
# from the forward.
# The engine's wait for an answer sleeps: the child is filling masks then, on every core it has.
# TOKENMILL_GRAMMAR_SPIN_S sets it.
SPIN_S = float(os.environ.get("TOKENMILL_GRAMMAR_SPIN_S", 0.002 if (os.cpu_count() or 1) >= 8 else 0.0))
_COMPILED_CAPACITY = 256  # the child's compiled grammars, by text (LRU)
# The child's masks kept by place in a JSON document (common/mask_cache.py), in MiB; 0 keeps none.
# TOKENMILL_GRAMMAR_PLACE_CACHE_MB sets it.
PLACE_CACHE_MB = int(os.environ.get("TOKENMILL_GRAMMAR_PLACE_CACHE_MB", "32"))
# Up to this many masks at once are filled one after the other on the filling thread, more on llguidance's pool:
# waking the pool's threads costs more than it saves on a few masks (`tokenmill bench structured`'s batches of k
# masks; docs/benchmarks.md). TOKENMILL_GRAMMAR_SERIAL_ROWS sets it.
SERIAL_ROWS = int(os.environ.get("TOKENMILL_GRAMMAR_SERIAL_ROWS", "4"))


# a batch whose fill took longer than this is "slow" (tokenmill:grammar_mask_slow_batches): about a small model's
# decode step on a GPU, which the fill has to fit in for the pick not to wait
SLOW_FILL_S = 0.001
# A pick that does not wait for its masks on the host (a GPU's) leaves the child's answers in the pipe until this
# many batches are unanswered as far as the engine has read: each read is a system call on the step's path, and
# 256 answers are 8 KiB of the pipe's 64.
ANSWERS_UNREAD = 256


class MaskProcess:
    """The engine side: the slots, the ops not sent yet, and the child's answers. Thread-safe (a matcher's
    finalizer may run on any thread); the engine thread does everything else."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Sequence[int], capacity: int = 1024,
                 inline_rows: int = 256, threads: int = 0) -> None:
        self.words = (vocab_size + 31) // 32
        self.capacity = capacity
        # the child's rows (a slot each), then ``inline_rows`` that the engine fills itself (structured.MaskTable)
        rows_bytes = (capacity + inline_rows) * self.words * 4
        nbytes = -(-rows_bytes // READY_BYTES) * READY_BYTES + READY_BYTES  # ``answered`` on a line of its own
        self._fd = os.memfd_create("tokenmill-grammar-masks")
        os.ftruncate(self._fd, nbytes)
        self._map = mmap.mmap(self._fd, nbytes)
        with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="tokenmill-tokenizer-", delete=False) as f:
            f.write(tokenizer_json)  # the child reads it, then deletes it (and the closer, if the child could not)
        root = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "common.grammar_proc", str(self._fd), str(capacity), str(self.words),
                 str(vocab_size), f.name, json.dumps(list(eos_ids)), str(threads)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(self._fd,), env=env)
        except OSError:
            os.unlink(f.name)
            self._map.close()
            os.close(self._fd)
            raise
        # the whole shared memory as int32 (the sampler registers it with CUDA as one): the rows, then ``answered``
        self.shared = np.frombuffer(self._map, dtype=np.int32)
        self.rows = self.shared[: rows_bytes // 4].reshape(capacity + inline_rows, self.words)
        self.answered = np.frombuffer(self._map, dtype=np.int64, count=1, offset=nbytes - READY_BYTES)
        self._posted = np.frombuffer(self._map, dtype=np.int64, count=1, offset=nbytes - READY_BYTES + SENT_OFFSET)
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._stdin = self._proc.stdin
        self._answers = self._proc.stdout.fileno()
        os.set_blocking(self._answers, False)
        self._lock = threading.Lock()
        self._free = list(range(capacity - 1, -1, -1))
        self._ops: list[Any] = []  # not sent yet: their slots' rows are stale, fill those inline
        self._mixed = False  # an ADD or DROP among ``_ops``: the batch goes as a pickle
        self._stdin_fd = self._stdin.fileno()
        self._slot_batch = [0] * capacity  # the batch that carried each slot's last op
        self._sent = 0  # batches sent (numbered from 1)
        self._done = -1  # the last batch the child answered; 0: it is ready
        self._pending = b""
        # the last locate's matchers and slots (held until the next locate: a finished row's slot is freed a pick
        # late; identities, not ids, since an id can come back for a new matcher with another slot)
        self._last: tuple[list[GrammarMatcher], list[int]] | None = None
        self.dead = False
        self.remote_rows = self.inline_rows = 0  # rows served from the child / filled inline, for the benchmark
        self.cached_rows = 0  # of the child's rows, those it took from its cache of masks by place
        self._sent_at: dict[int, int] = {}  # batch → when it was sent (monotonic ns), until its answer
        # per answered batch: (seconds from sending it to the child having read it, seconds the child then took to
        # advance its matchers and fill the masks, of them the advance's, the masks llguidance computed), the latest
        # ones, for the benchmark
        self.batch_times: deque[tuple[float, float, float, int]] = deque(maxlen=4096)
        # every answered batch: how many, the child's seconds to advance and fill them, those over SLOW_FILL_S
        self.batches = self.slow_batches = 0
        self.fill_seconds = 0.0
        self._closer = weakref.finalize(self, _close, self._proc, self._map, self._fd, f.name)

    @property
    def ready(self) -> bool:
        return self._done >= 0 and not self.dead

    def wait_ready(self, timeout: float = 30.0) -> bool:
        """Wait until the child has loaded the tokenizer (matchers made before then stay inline)."""
        with self._lock:
            return self._wait(0, timeout) and self.ready

    def close(self) -> None:
        self.dead = True
        self._closer()

    # -- the engine's matchers ------------------------------------------------------------------------
    def register(self, m: GrammarMatcher, text: str, prior: Sequence[int]) -> bool:
        """Mirror a matcher (``prior``: the tokens it has accepted already) in the child, if it is ready and a
        slot is free (True); otherwise the matcher stays inline (False)."""
        with self._lock:
            if not self.ready:
                self._poll()
            if not self.ready or not self._free:
                return False
            slot = self._free.pop()
            self._ops.append((ADD, slot, text, [int(t) for t in prior]))
            self._mixed = True
        m.mirror(self, slot)
        weakref.finalize(m, self._drop, slot)
        return True

    def advance(self, slot: int, token: int) -> None:
        """The engine thread only (as ``flush``): no lock. Nothing once the child is gone (nothing sends it)."""
        if not self.dead:
            self._ops.append(slot << 32 | token)

    def advance_all(self, ops: list[int]) -> None:
        """``advance`` for a step's rows at once, each op ``slot << 32 | token``. The engine thread only."""
        if not self.dead:
            self._ops += ops

    def _drop(self, slot: int) -> None:
        with self._lock:
            if self.dead:
                return
            self._ops.append((DROP, slot))
            self._mixed = True
            self._free.append(slot)

    # -- the engine thread: each step -------------------------------------------------------------------
    def flush(self) -> None:
        """Send the ops queued since the last flush as one batch: the child starts filling those rows now."""
        with self._lock:
            if self.dead:
                return
            if not self.ready:
                self._poll()
            if not self._ops:
                return
            ops, self._ops = self._ops, []
            self._sent += 1
            batch, sent = self._slot_batch, self._sent
            if self._mixed:
                self._mixed = False
                payload = pickle.dumps((sent, ops), protocol=pickle.HIGHEST_PROTOCOL)
                message = _HEADER.pack(len(payload)) + payload
                for op in ops:
                    batch[op >> 32 if type(op) is int else op[1]] = sent
            else:
                message = _HEADER.pack(RAW | 8 * (len(ops) + 1)) + array("q", [sent, *ops]).tobytes()
                for op in ops:
                    batch[op >> 32] = sent
            self._sent_at[sent] = time.monotonic_ns()
            try:
                view = memoryview(message)
                while view:  # one write unless the pipe is full
                    view = view[os.write(self._stdin_fd, view):]
            except OSError as e:
                self._die(f"could not write to it ({e})")
                return
            self._posted[0] = sent  # after the write: a child that sees it finds the message in the pipe

    def locate(self, matchers: Sequence[GrammarMatcher], wait: bool = True) -> tuple[list[int], int]:
        """The slot (row of ``rows``) with each matcher's next mask, -1 where the engine fills it (not mirrored,
        its tokens not sent, no child); and the batch whose answer those slots need (0: none). With ``wait``, once
        the child has answered it; without, at once: the reader waits until ``answered`` reaches it (on a GPU, the
        device). The same rows as the last call (a decode batch, step after step) get the same list back."""
        with self._lock:
            if self.dead or self._done < 0:
                self.inline_rows += len(matchers)
                return [-1] * len(matchers), 0
            last = self._last
            if last is not None and not self._ops and last[0] == matchers:
                at = last[1]  # the rows of the last call, all mirrored, nothing unsent: the same slots (the same list)
                served = at
            else:
                unsent = {op >> 32 if type(op) is int else op[1] for op in self._ops} if self._ops else ()
                at = []
                for m in matchers:
                    s = m.slot_in(self)
                    at.append(-1 if s is None or s in unsent else s)
                served = [s for s in at if s >= 0]
                self._last = (list(matchers), at) if len(served) == len(at) else None
            need = max(map(self._slot_batch.__getitem__, served)) if served else 0
            if need > self._done:
                if not wait:
                    if self._sent - self._done > ANSWERS_UNREAD:
                        self._poll()  # read in bulk (unread, they would fill the pipe), not waited for
                elif not self._wait(need, REPLY_TIMEOUT_S):
                    if not self.dead:
                        self._die(f"no answer in {REPLY_TIMEOUT_S:g} s")
                    self.inline_rows += len(matchers)
                    return [-1] * len(matchers), 0
            if self.dead:  # found gone just now: its rows are stale
                self.inline_rows += len(matchers)
                return [-1] * len(matchers), 0
            self.remote_rows += len(served)
            self.inline_rows += len(matchers) - len(served)
            return at, need

    def read_answers(self) -> None:
        """Read the answers the child has written (the counters above are up to date after it)."""
        with self._lock:
            if not self.dead:
                self._poll()

    def hung(self) -> None:
        """A wait on the device for an answer gave up (``triton_ops.MASK_WAIT_SPINS``): fill inline from now on."""
        with self._lock:
            if not self.dead:
                self._die("a pick waited seconds for its masks on the device")

    # -- the child's answers (under the lock) -------------------------------------------------------------
    def _poll(self) -> bool:
        """Read the answers there are, without waiting. False: the child is gone."""
        try:
            data = os.read(self._answers, 1 << 16)
        except BlockingIOError:
            return True
        except OSError as e:
            self._die(f"could not read from it ({e})")
            return False
        if not data:
            self._die(f"it exited ({self._proc.poll()})")
            return False
        data = self._pending + data
        n = len(data) // _ANSWER.size
        for k in range(n):
            self._done, read_ns, advanced_ns, filled_ns, cached, computed = _ANSWER.unpack_from(data, k * _ANSWER.size)
            self.cached_rows += cached
            fill = (filled_ns - read_ns) * 1e-9
            if self._done > 0:  # batch 0: the child's word that it is ready
                self.batches += 1
                self.fill_seconds += fill
                self.slow_batches += fill > SLOW_FILL_S
            sent = self._sent_at.pop(self._done, None)
            if sent is not None:
                self.batch_times.append(((read_ns - sent) * 1e-9, fill, (advanced_ns - read_ns) * 1e-9, computed))
        self._pending = data[n * _ANSWER.size:]
        return True

    def _wait(self, batch: int, timeout: float) -> bool:
        """Read answers until the child has answered ``batch`` (0: it is ready). False: it is gone, or ``timeout``
        seconds passed first. Asleep in select meanwhile: the child is filling masks then, on every core it has."""
        deadline = time.monotonic() + timeout
        while self._poll() and self._done < batch:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            select.select([self._answers], [], [], left)
        return self._done >= batch and not self.dead

    def _die(self, why: str) -> None:
        log.error("grammar mask process: %s; filling masks inline from now on", why)
        self.dead = True
        self._ops = []
        self._closer()  # the child is gone after this (killed if it did not end): nothing writes ``answered`` now
        self.answered[0] = RELEASED  # a pick queued behind a wait for the child goes on, on stale rows


def _close(proc: subprocess.Popen, mapped: mmap.mmap, fd: int, tokenizer_file: str) -> None:
    with contextlib.suppress(OSError):
        if proc.stdin is not None:
            proc.stdin.close()  # the child exits at the end of its input
    try:
        proc.wait(timeout=2)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()
    with contextlib.suppress(BufferError):  # a numpy view of it is still alive: the mapping goes with the last one
        mapped.close()
    os.close(fd)
    with contextlib.suppress(FileNotFoundError):  # a child that never started left it
        os.unlink(tokenizer_file)


# llguidance's slices: sets of tokens, each the tokens a regex matches whole, taken or left as a set wherever the
# lexer allows all of a slice, so a mask walks only the tokens outside such slices. Its defaults cut JSON string
# contents at 10 and 30 characters: inside a string with fewer characters left to its maxLength (an 8-character
# SKU, the end of a 24-character name) every token was walked, 150-600 µs a mask. Slices at every power of two
# from 2 to 32 characters leave those walks to the longer tokens: on SmolLM2's tokenizer and the five schemas of
# ``tokenmill bench structured``, a mask's p90 went from 119 to 58 µs (mean 46 → 37 µs), every mask the same.
_STRING_CHARS = r'[^"\\\x00-\x1F\x7F]'
SLICES = [r"[\x20\x0A\x0D\x09]+", *(f"{_STRING_CHARS}{{1,{n}}}" for n in (2, 4, 8, 16, 32)), f"{_STRING_CHARS}+"]


def make_tokenizer(tokenizer_json: str, vocab_size: int, eos_ids: Sequence[int]) -> Any:
    """llguidance's tokenizer, with :data:`SLICES`: the engine's and the child's."""
    import llguidance as llg

    return llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_ids), slices=SLICES)


def make_executor(threads: int) -> Any:
    """llguidance's parallel executor of ``threads`` threads (0: its default, 80% of the cores up to 32); None for
    1: the masks are filled one after the other on the calling thread."""
    import llguidance as llg

    return None if threads == 1 else llg.LLExecutor(threads or None)


def compute_masks(executor: Any, rows: Sequence[tuple[Any, int]], base: int, row_bytes: int) -> None:
    """llguidance's masks of ``rows`` (matcher, row) into the bitmask at address ``base``, ``row_bytes`` a row:
    up to ``SERIAL_ROWS``, or every row without an ``executor`` (an ``LLExecutor``), one after the other on this
    thread; more in parallel on ``executor``, without the GIL. The child and the engine's inline fill
    (``common/structured.py``) both fill through here."""
    if len(rows) <= SERIAL_ROWS or executor is None:
        for m, i in rows:
            m.unsafe_compute_mask_ptr(base + i * row_bytes, row_bytes)
    elif rows:
        executor.unsafe_compute_mask_ptr(list(rows), base, row_bytes, max(i for _, i in rows) + 1)


# -- the child ----------------------------------------------------------------------------------------------
class _Reader:
    """The child's end of the pipe: whole messages. After the last one it watches the engine's word of the batches
    it has written (``posted``, in the shared memory) for up to ``SPIN_S`` (the next step's tokens come within a
    step), then sleeps in select."""

    def __init__(self, fd: int, posted: np.ndarray) -> None:
        self.fd = fd
        self.posted = posted
        os.set_blocking(fd, False)
        self.buf = b""

    def read(self, n: int) -> bytes:
        """``n`` bytes; b"" at the end of the input."""
        spin = time.monotonic() + SPIN_S
        posted = self.posted
        while len(self.buf) < n:
            seen = int(posted[0])  # before the read: a write after it changes the word
            try:
                chunk = os.read(self.fd, max(n - len(self.buf), 1 << 16))
            except BlockingIOError:
                while int(posted[0]) == seen:
                    if time.monotonic() >= spin:
                        select.select([self.fd], [], [])
                        break
                continue
            if not chunk:
                return b""
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out


def main(argv: list[str]) -> int:
    import ctypes

    import llguidance as llg

    fd, capacity, words, vocab = (int(x) for x in argv[:4])
    tok_path, eos, threads = argv[4], json.loads(argv[5]), int(argv[6])
    mapped = mmap.mmap(fd, 0)  # the rows (its own, then the engine's inline ones), then ``answered``
    base = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
    answered = np.frombuffer(mapped, dtype=np.int64, count=1, offset=len(mapped) - READY_BYTES)
    tokenizer_json = Path(tok_path).read_text()
    os.unlink(tok_path)
    tok = make_tokenizer(tokenizer_json, vocab, eos)
    executor = make_executor(threads)
    compiled: OrderedDict[str, Any] = OrderedDict()
    matchers: dict[int, Any] = {}
    rows = np.frombuffer(mapped, dtype=np.int32, count=capacity * words).reshape(capacity, words)
    token_bytes = token_bytes_of(tok)
    # where each sequence is in the JSON it writes, and the masks kept by place
    places = PlaceKeys(token_bytes, token_reach(token_bytes, vocab)) if PLACE_CACHE_MB > 0 else None
    cache = MaskCache(words, PLACE_CACHE_MB << 20)
    stdin = _Reader(0, np.frombuffer(mapped, dtype=np.int64, count=1, offset=len(mapped) - READY_BYTES + SENT_OFFSET))
    os.write(1, _ANSWER.pack(0, 0, 0, 0, 0, 0))  # ready
    while True:
        head = stdin.read(_HEADER.size)
        if not head:
            return 0
        size = _HEADER.unpack(head)[0]
        ops: Sequence[Any]
        op: Any
        if size & RAW:
            raw = array("q", stdin.read(size ^ RAW))
            batch, ops = raw[0], raw[1:]
        else:
            batch, ops = pickle.loads(stdin.read(size))
        read_ns = time.monotonic_ns()
        touched: dict[int, Any] = {}
        for op in ops:
            if type(op) is int:
                slot = op >> 32
                m = matchers.get(slot)
                if m is not None:
                    token = op & 0xFFFFFFFF
                    ok = m.consume_token(token)
                    if places is not None:
                        places.advance(slot, token, ok)
                    touched[slot] = m
            elif op[0] == ADD:
                _, slot, text, prior = op
                base_m = compiled.get(text)
                if base_m is None:
                    base_m = compiled[text] = llg.LLMatcher(tok, text, log_level=0)
                    while len(compiled) > _COMPILED_CAPACITY:
                        compiled.popitem(last=False)
                else:
                    compiled.move_to_end(text)
                m = base_m.deep_copy()
                for t in prior:
                    m.consume_token(t)
                matchers[slot] = touched[slot] = m
                if places is not None:
                    places.add(slot, text, prior)
                    if m.is_error():  # a token of ``prior`` broke the grammar: its masks are EOS only
                        places.drop(slot)
            else:
                matchers.pop(op[1], None)
                touched.pop(op[1], None)
                if places is not None:
                    places.drop(op[1])
        advanced_ns = time.monotonic_ns()
        # a stopped (complete) or failed matcher's mask allows EOS only: the engine ends its sequence on it
        fill, keep = [], []
        for s, m in touched.items():
            key, row = places.cached(s, cache) if places is not None else (None, None)
            if row is not None:
                rows[s] = row
                continue
            if key is not None:
                keep.append((s, key))
            fill.append((m, s))
        compute_masks(executor, fill, base, words * 4)
        for s, key in keep:
            cache.put(key, rows[s])
        answered[0] = batch  # after the rows (x86 keeps stores in order): a device reading this may read them
        os.write(1, _ANSWER.pack(batch, read_ns, advanced_ns, time.monotonic_ns(), len(touched) - len(fill), len(fill)))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Token ids → text deltas, and stop strings: the part of output handling that needs the tokenizer.

The engine works in token ids only (EOS, stop token ids, max_tokens). This processor runs beside it — inline for
``LLMEngine.generate``, on its own thread in the decode worker, off the engine loop — and turns each request's
token stream into text with an incremental detokenizer. When a stop string appears it truncates the text, marks
the request finished and tells the caller to abort it in the engine (the engine may have run one step more; those
tokens are dropped here).

An output filter policy (``common/output_filter.py``), when the request has one, checks the text after the stop
strings have cut it. The text sent to the client lags by the larger of two holdbacks: the longest stop string less
one character, and the characters the policy says could still begin a match. With a policy, text leaves in whole
tokens, each with its id and logprob, so no token id gives held text away and text and ids stay in step. A blocked stream ends
here with ``FinishReason.CONTENT_FILTER`` and the policy's reason; the text it held back and its tokens are
dropped, and the caller aborts the request in the engine as for a stop string.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from common.output_filter import OutputPolicy
from common.sampling import SamplingParams
from common.sequence import FinishReason
from common.tokenizer import IncrementalDetokenizer, TextTokenizer


@dataclass(slots=True)
class TextDelta:
    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    stopped_by_string: bool = False  # the caller must abort the request in the engine
    filter_reason: str = ""  # set when the output filter blocked the stream (abort it in the engine too)
    logprobs: list[Any] | None = None  # those of ``token_ids``, when ``process`` was given them


@dataclass(slots=True)
class _State:
    params: SamplingParams
    detok: IncrementalDetokenizer | None
    holdback: int
    policy: OutputPolicy | None = None
    num_tokens: int = 0
    cleared: int = 0  # text[:cleared] passed the policy
    filter_hold: int = 0  # trailing characters the policy holds back
    pending: deque[tuple[int, int, Any]] = field(default_factory=deque)  # policy: (token, its text's end, logprob)
    emitted: int = 0
    done: bool = False
    token_ids: list[int] = field(default_factory=list)


class OutputProcessor:
    """Per-request incremental text. Not thread-safe: one thread owns it."""

    def __init__(self, tokenizer: TextTokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _State] = {}

    def add(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
            prior_output_ids: Sequence[int] = (), policy: OutputPolicy | None = None) -> None:
        """``prior_output_ids``: outputs generated (and their text sent) before this process took the request;
        the text continues after them. A stop string that began in their text is not seen. ``policy``: the
        request's output filter (None: none; it needs a tokenizer)."""
        detok = None
        if self.tokenizer is not None:
            detok = self.tokenizer.detokenizer([*prompt_ids, *prior_output_ids], params.skip_special_tokens)
        hold = max((len(s) for s in params.stop), default=1) - 1
        self._states[request_id] = _State(params, detok, hold, policy, num_tokens=len(prior_output_ids))

    def discard(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def process(
        self, request_id: str, token_ids: Sequence[int], finished: bool, finish_reason: FinishReason | None,
        logprobs: Sequence[Any] | None = None,
    ) -> TextDelta | None:
        """Feed the tokens one engine step produced (and their logprobs, which come back in the delta beside the
        tokens released). Returns None for an unknown or already finished request."""
        st = self._states.get(request_id)
        if st is None or st.done:
            return None
        p = st.params
        text_end: int | None = None
        kept: list[int] = []
        ends: list[int] = []  # the text's length after each kept token
        for tok in token_ids:
            kept.append(tok)
            st.num_tokens += 1
            if st.detok is None:
                continue
            before = len(st.detok.text)
            delta = st.detok.step(tok)  # special tokens (EOS) add no text when skip_special_tokens
            ends.append(len(st.detok.text))
            if p.stop and delta and st.num_tokens >= p.min_tokens:
                text = st.detok.text
                start = max(0, before - st.holdback)
                for s in p.stop:
                    j = text.find(s, start)
                    if j >= 0 and (text_end is None or j < text_end):
                        text_end = j + (len(s) if p.include_stop_str_in_output else 0)
                if text_end is not None:
                    break
        stopped = text_end is not None
        if stopped:
            finished, finish_reason = True, FinishReason.STOP
        text = ""
        blocked = ""
        if st.detok is not None:
            full = st.detok.text
            if text_end is not None:
                st.detok.text = full = full[:text_end]
            if st.policy is not None:
                st.cleared = min(st.cleared, len(full))
                if len(full) > st.cleared:
                    v = st.policy.check(full, st.cleared, finished)
                    if v.blocked:
                        blocked = v.reason or "the output filter blocked the stream"
                        finished, finish_reason = True, FinishReason.CONTENT_FILTER
                        full = full[: st.emitted]  # what it held back never leaves
                    else:
                        st.filter_hold = 0 if finished else min(v.holdback, len(full))
                        st.cleared = len(full) - st.filter_hold
            hold = max(st.holdback, st.filter_hold)
            upto = len(full) if finished else max(st.emitted, len(full) - hold)
        lps = list(logprobs) if logprobs is not None else None
        if st.policy is not None and st.detok is not None:  # whole tokens leave, text and id together
            st.pending.extend(zip(kept, ends, lps[: len(kept)] if lps is not None else [None] * len(kept),
                                  strict=True))
            if blocked:
                st.pending.clear()
            out = []
            while st.pending and (finished or st.pending[0][1] <= upto):
                out.append(st.pending.popleft())
            if not finished:
                upto = max(st.emitted, out[-1][1]) if out else st.emitted
            kept = [t for t, _, _ in out]
            if lps is not None:
                lps = [lp for _, _, lp in out]
        if st.detok is not None:
            text = full[st.emitted : upto]
            st.emitted = upto
        st.token_ids.extend(kept)
        if finished:
            st.done = True
            del self._states[request_id]
        return TextDelta(request_id, text, kept, finished, finish_reason, stopped_by_string=stopped,
                         filter_reason=blocked, logprobs=lps)

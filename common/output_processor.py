"""Token ids → text deltas, and stop strings: the part of output handling that needs the tokenizer.

The engine works in token ids only (EOS, stop token ids, max_tokens). This processor runs beside it — inline for
``LLMEngine.generate``, on its own thread in the decode worker, off the engine loop — and turns each request's
token stream into text with an incremental detokenizer. When a stop string appears it truncates the text, marks
the request finished and tells the caller to abort it in the engine (the engine may have run one step more; those
tokens are dropped here).

An output filter policy (``common/output_filter.py``), when the request has one, checks the text after the stop
strings have cut it. The text sent to the client lags by the larger of two holdbacks: the longest stop string less
one character, and the characters the policy says could still begin a match. A blocked stream ends here with
``FinishReason.CONTENT_FILTER`` and the policy's reason; the text it held back is dropped, and the caller aborts
the request in the engine as for a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

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


@dataclass(slots=True)
class _State:
    params: SamplingParams
    detok: IncrementalDetokenizer | None
    holdback: int
    policy: OutputPolicy | None = None
    num_tokens: int = 0
    cleared: int = 0  # text[:cleared] passed the policy
    filter_hold: int = 0  # trailing characters the policy holds back
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
        self, request_id: str, token_ids: Sequence[int], finished: bool, finish_reason: FinishReason | None
    ) -> TextDelta | None:
        """Feed the tokens one engine step produced. Returns None for an unknown or already finished request."""
        st = self._states.get(request_id)
        if st is None or st.done:
            return None
        p = st.params
        text_end: int | None = None
        kept: list[int] = []
        for tok in token_ids:
            kept.append(tok)
            st.num_tokens += 1
            if st.detok is None:
                continue
            before = len(st.detok.text)
            delta = st.detok.step(tok)  # special tokens (EOS) add no text when skip_special_tokens
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
            text = full[st.emitted : upto]
            st.emitted = upto
        st.token_ids.extend(kept)
        if finished:
            st.done = True
            del self._states[request_id]
        return TextDelta(request_id, text, kept, finished, finish_reason, stopped_by_string=stopped,
                         filter_reason=blocked)

"""The streaming output filter: the built-in word/regex policy, its holdback, custom classes from the config, and
the OutputProcessor running it beside detokenization and stop strings (SmolLM2's real tokenizer)."""

from __future__ import annotations

import pytest

from common.cluster_config import ConfigError, load_cluster_config
from common.loader import load_tokenizer
from common.output_filter import PatternPolicy, PolicySet, Verdict
from common.output_processor import OutputProcessor
from common.sampling import SamplingParams
from common.sequence import FinishReason


class NoDigits:
    """A custom policy for the config's class_path: blocks any digit, holds back nothing."""

    def __init__(self, reason: str = "digits") -> None:
        self.reason = reason

    def check(self, text: str, new_from: int, final: bool) -> Verdict:
        return Verdict(True, self.reason) if any(c.isdigit() for c in text[new_from:]) else Verdict()


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("smollm2")


def test_word_list_is_case_insensitive_whole_words_and_holds_back_a_possible_start():
    p = PatternPolicy(words=["Paris", "bad word"])
    assert p.check("The capital is Par", 0, False) == Verdict(holdback=3)  # "Par" may become "Paris"
    assert p.check("The capital is Paris", 0, False) == Verdict(holdback=5)  # or "Parisian": undecided
    assert not p.check("The capital is Parisian", 0, False).blocked
    v = p.check("The capital is PARIS.", 0, False)
    assert v.blocked and v.reason == "the output matched a blocked word"
    assert p.check("the capital is paris", 0, True).blocked  # the stream ended: decided
    assert p.check("a bad word!", 0, False).blocked
    assert p.check("nothing here", 0, False) == Verdict()


def test_regexes_block_and_hold_back_partial_matches():
    p = PatternPolicy(regexes=[r"\b\d{3}-\d{2}-\d{4}\b"], reason="no SSNs")
    assert p.check("call 123-4", 0, False) == Verdict(holdback=5)
    assert p.check("call 123-45-6789 now", 0, False) == Verdict(True, "no SSNs")
    assert not p.check("call 123-4 now", 0, False).blocked
    assert not p.check("x 123-4", 0, True).blocked  # the stream ended before the pattern completed


def test_bad_patterns_are_config_errors_that_name_them():
    with pytest.raises(ConfigError, match=r"output_filter.default.*regexes\[0\] '\(a' is not a valid"):
        load_cluster_config(overrides={"output_filter.default.regexes": "(a"}, env={})
    with pytest.raises(ConfigError, match="matches the empty string"):
        load_cluster_config(overrides={"output_filter.tenants.t.regexes": "x*"}, env={})
    with pytest.raises(ConfigError, match=r"output_filter\.models must be a mapping"):
        load_cluster_config(overrides={"output_filter.models": "smollm2"}, env={})
    cfg = load_cluster_config(overrides={"output_filter.default.class_path": "no_such_module:X"}, env={})
    with pytest.raises(ValueError, match="cannot be loaded"):
        PolicySet(cfg.output_filter, cfg.model)


def test_policy_set_resolves_tenant_then_model_then_default():
    cfg = load_cluster_config(overrides={
        "output_filter.default.words": "alpha",
        "output_filter.models.smollm2.words": "beta",
        "output_filter.tenants.open.words": "",  # an empty override: no filter for this tenant
        "output_filter.tenants.custom.class_path": f"{__name__}:NoDigits",
        "output_filter.tenants.custom.kwargs.reason": "no numbers please",
    }, env={})
    ps = PolicySet(cfg.output_filter, "smollm2")
    assert ps.for_request("").check("beta", 0, True).blocked and not ps.for_request("").check("alpha", 0, True).blocked
    assert ps.for_request("someone").check("beta", 0, True).blocked
    assert ps.for_request("open") is None
    assert ps.for_request("custom").check("7", 0, True) == Verdict(True, "no numbers please")
    other = PolicySet(cfg.output_filter, "another-model")
    assert other.for_request("").check("alpha", 0, True).blocked


def _run(proc: OutputProcessor, tok, text: str, params: SamplingParams, policy, eos: bool = True,
         tokens: list | None = None):
    """Feed ``text``'s tokens one per step (each with a stand-in logprob: its position); returns (deltas' text as
    sent, last TextDelta). ``tokens`` collects the (token id, logprob) pairs sent."""
    prompt = tok.encode("Hello")
    proc.add("r", prompt, params, policy=policy)
    ids = tok.encode(text, add_special_tokens=False)
    sent, last = [], None
    for i, t in enumerate(ids):
        last = proc.process("r", [t], eos and i == len(ids) - 1, FinishReason.STOP if i == len(ids) - 1 else None,
                            [i])
        if last is None:
            break
        sent.append(last.text)
        if tokens is not None:
            tokens.extend(zip(last.token_ids, last.logprobs, strict=True))
        if last.finished:
            break
    return sent, last


def test_processor_blocks_and_never_sends_the_blocked_text(tok):
    proc = OutputProcessor(tok)
    toks: list = []
    sent, last = _run(proc, tok, "The capital of France is Paris, a big city.", SamplingParams(),
                      PatternPolicy(words=["paris"]), tokens=toks)
    assert last.finished and last.finish_reason is FinishReason.CONTENT_FILTER
    assert last.filter_reason == "the output matched a blocked word"
    # everything before the hold, nothing of the word (nor of its token " Paris"); ids and logprobs in step
    assert "".join(sent) == "The capital of France is"
    assert tok.decode([t for t, _ in toks]) == "The capital of France is"
    assert [lp for _, lp in toks] == list(range(len(toks)))
    assert "r" not in proc


def test_processor_releases_held_text_that_turns_out_harmless(tok):
    proc = OutputProcessor(tok)
    text = "Parisian food is good, and so is Par"
    toks: list = []
    sent, last = _run(proc, tok, text, SamplingParams(), PatternPolicy(words=["paris"]), tokens=toks)
    assert last.finish_reason is FinishReason.STOP and not last.filter_reason
    assert "".join(sent) == text  # the held-back "Par" goes out when the stream ends
    assert [t for t, _ in toks] == tok.encode(text, add_special_tokens=False)  # every token, in order
    assert any(s == "" for s in sent)  # something was held at some step


def test_processor_holds_back_only_what_could_still_match(tok):
    proc = OutputProcessor(tok)
    ids = tok.encode("one two three four", add_special_tokens=False)
    proc.add("r", tok.encode("Hi"), SamplingParams(), policy=PatternPolicy(words=["zebra"]))
    out = "".join(proc.process("r", [t], False, None).text for t in ids)
    assert out == "one two three four"  # nothing could begin "zebra": nothing held


def test_stop_strings_and_the_filter_compose(tok):
    # the stop string comes first: the text is cut there and the blocked word after it never counts
    proc = OutputProcessor(tok)
    sent, last = _run(proc, tok, "Answer: 42. END Paris", SamplingParams(stop=("END",)),
                      PatternPolicy(words=["paris"]), eos=False)
    assert last.finish_reason is FinishReason.STOP and last.stopped_by_string and not last.filter_reason
    assert "".join(sent) == "Answer: 42. "
    # the blocked word comes first: blocked before the stop string is reached
    proc = OutputProcessor(tok)
    sent, last = _run(proc, tok, "Paris is nice. END", SamplingParams(stop=("END",)),
                      PatternPolicy(words=["paris"]), eos=False)
    assert last.finish_reason is FinishReason.CONTENT_FILTER and "".join(sent) == ""
    # a long stop string holds back more than the filter: the text lags by the larger holdback
    proc = OutputProcessor(tok)
    sent, last = _run(proc, tok, "alpha beta gamma delta STOPHERE", SamplingParams(stop=("STOPHERE",)),
                      PatternPolicy(words=["gam"]), eos=False)
    assert last.finish_reason is FinishReason.STOP and "".join(sent) == "alpha beta gamma delta "

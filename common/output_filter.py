"""The streaming output filter: a policy looks at a stream's text as it grows and allows it or blocks the stream.

A policy (``OutputPolicy``) is asked once per text delta: ``check(text, new_from, final)`` sees the whole output
so far (``text``) and the part it has not cleared yet (``text[new_from:]``: the new delta plus what it held back
last time) and answers a ``Verdict``: allowed, with the number of trailing characters that could still begin a
match (``holdback``: the decode worker holds exactly those back from the client until they are decided), or
blocked, with a reason the client sees (``filter_reason``; OpenAI's ``finish_reason: content_filter``).

Built in: ``PatternPolicy``, a case-insensitive word list plus regular expressions (the ``regex`` module, whose
partial matching tells how much of the tail could still grow into a match). Custom: any class named
``module:Class`` in the config, built with its ``kwargs``, that has this ``check`` method.

Where policies come from: the cluster config's ``output_filter`` section (``OutputFilterConfig``): a ``default``
policy, per-model ``models`` and per-tenant ``tenants`` overrides, resolved by ``PolicySet.for_request``: the
tenant's, else the served model's, else the default (an override replaces the one below it; an empty one turns
the filter off).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import regex

from common.cluster_config import FilterPolicyConfig, OutputFilterConfig


@dataclass(frozen=True, slots=True)
class Verdict:
    blocked: bool = False
    reason: str = ""  # blocked: why (the client sees it)
    holdback: int = 0  # allowed: trailing characters of ``text`` that could still begin a match


ALLOW = Verdict()


@runtime_checkable
class OutputPolicy(Protocol):
    """One filter policy, shared by every stream it applies to: ``check`` must keep no per-stream state."""

    def check(self, text: str, new_from: int, final: bool) -> Verdict:
        """``text``: the stream's output so far; ``text[new_from:]``: what this policy has not cleared yet;
        ``final``: no more text follows (nothing can be held back any more)."""
        ...


class PatternPolicy:
    """Blocks a stream whose text contains one of ``words`` (case-insensitive, whole words) or matches one of
    ``regexes`` (Python/``regex`` syntax; ``(?i)`` for case-insensitive). ``reason``: the reason the client sees
    (default: which rule matched)."""

    def __init__(self, words: tuple[str, ...] | list[str] = (), regexes: tuple[str, ...] | list[str] = (),
                 reason: str = "") -> None:
        self._rules: list[tuple[regex.Pattern[str], str]] = []
        words = [w.strip() for w in words if w.strip()]
        if words:  # one pattern, factored as a trie: its cost grows with word length, not with the list
            self._rules.append((regex.compile(rf"(?<!\w){_trie_pattern(words)}(?!\w)", regex.IGNORECASE),
                                "a blocked word"))
        for i, r in enumerate(regexes):
            try:
                pat = regex.compile(r)
            except regex.error as e:
                raise ValueError(f"output filter regexes[{i}] {r!r} is not a valid regular expression: {e}") from e
            if pat.fullmatch(""):
                raise ValueError(f"output filter regexes[{i}] {r!r} matches the empty string, so it would block "
                                 "every output; make it match at least one character")
            self._rules.append((pat, f"pattern {r!r}"))
        self.reason = reason

    def __bool__(self) -> bool:
        return bool(self._rules)

    def check(self, text: str, new_from: int, final: bool) -> Verdict:
        end = len(text)
        hold_from = end
        for pat, what in self._rules:
            m = pat.search(text, new_from, partial=not final)
            if m is None:
                continue
            start = m.start()
            # a partial match, or a whole one that reaches the end (``\b``, ``(?!\w)``, ``\d+`` may still change
            # their verdict with more text): hold it back until the text decides it
            if not final and (m.partial or m.end() == end):
                hold_from = min(hold_from, start)
                continue
            return Verdict(True, self.reason or f"the output matched {what}")
        return Verdict(holdback=end - hold_from) if hold_from < end else ALLOW


def _trie_pattern(words: list[str]) -> str:
    """An alternation of ``words`` (case-folded) with shared prefixes factored out: ``bad|badly|bat`` →
    ``ba(?:d(?:ly)?|t)``, so a position is tried once per character instead of once per word."""
    trie: dict[str, dict] = {}
    for w in words:
        node = trie
        for ch in w.casefold():
            node = node.setdefault(ch, {})
        node[""] = {}

    def emit(node: dict[str, dict]) -> str:
        alts = [regex.escape(ch) + emit(sub) for ch, sub in sorted(node.items()) if ch]
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        return f"(?:{body})?" if "" in node else body

    return emit(trie)


def load_policy(cfg: FilterPolicyConfig) -> OutputPolicy | None:
    """The policy a config entry describes; None when it filters nothing. Raises ValueError naming the problem."""
    if cfg.class_path:
        mod_name, sep, cls_name = cfg.class_path.partition(":")
        if not sep or not mod_name or not cls_name:
            raise ValueError(f"output filter class {cfg.class_path!r} must be written module:Class")
        try:
            cls = getattr(importlib.import_module(mod_name), cls_name)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"output filter class {cfg.class_path!r} cannot be loaded: {e}") from e
        try:
            policy = cls(**dict(cfg.kwargs))
        except TypeError as e:
            raise ValueError(f"output filter class {cfg.class_path!r} refused its kwargs {dict(cfg.kwargs)}: {e}"
                             ) from e
        if not isinstance(policy, OutputPolicy):
            raise ValueError(f"output filter class {cfg.class_path!r} has no check(text, new_from, final) method")
        return policy
    p = PatternPolicy(cfg.words, cfg.regexes, cfg.reason)
    return p if p else None


class PolicySet:
    """Every policy of an ``output_filter`` config, built once; ``for_request`` picks a request's."""

    def __init__(self, cfg: OutputFilterConfig, model: str) -> None:
        base = cfg.models.get(model, cfg.default)
        self.default: OutputPolicy | None = load_policy(base)
        self.tenants: dict[str, OutputPolicy | None] = {t: load_policy(c) for t, c in cfg.tenants.items()}

    def for_request(self, tenant_id: str) -> OutputPolicy | None:
        return self.tenants.get(tenant_id, self.default) if tenant_id else self.default

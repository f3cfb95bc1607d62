"""Tool calls read out of the model's text, whole or as streamed deltas (``gateway.tool_parser``, as vLLM's
``--tool-call-parser``). Pure: no I/O.

- ``hermes``: ``<tool_call>{"name": …, "arguments": {…}}</tool_call>``, any number, with text around them;
- ``llama3``: the whole output is JSON calls, ``{"name": …, "parameters"|"arguments": {…}}``, possibly after
  ``<|python_tag|>`` and separated by ``;``; an output that does not start with one is plain text;
- with ``required`` the output is a JSON list of calls, with a named function the function's arguments (the engine's
  structured output makes sure of it).

Every parser is a ``CallStream``: text in, ``Text`` / ``CallStart`` / ``ArgsDelta`` events out, holding back only
text that may begin a call. A whole response is the same stream fed at once, so streamed deltas add up to exactly the
non-streamed message. Arguments go out as the model wrote them.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_ARG_KEYS = ("arguments", "parameters")


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]




# -- parsing the output --------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Text:
    text: str


@dataclass(frozen=True, slots=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ArgsDelta:
    index: int
    text: str


Event = Text | CallStart | ArgsDelta
CallEvent = CallStart | ArgsDelta  # what a call's scanner emits


class NotACall(ValueError):
    """The text being scanned is not a tool call after all."""


class _CallScanner:
    """A JSON object ``{"name": str, "arguments"|"parameters": value}`` (several, or a list of them, at the top
    level when ``many``) read a character at a time. ``put`` returns the events it completes; the arguments are
    passed on as their raw text, held only until the name is known. Raises NotACall on text of another shape."""

    def __init__(self, many: bool, first_index: int, parallel: bool) -> None:
        self.many, self.index, self.parallel = many, first_index, parallel
        self.stack: list[str] = []
        self.call_level = 1
        self.in_str = self.esc = self.scalar = False
        self.token: Literal["key", "value"] = "key"
        self.slot: Literal["key", "colon", "value", "after"] = "key"
        self.buf = ""  # the key or value being read at the call's level
        self.key = ""
        self.name: str | None = None
        self.held_args = ""  # argument text before the name came
        self.args_seen = False
        self.in_args = False  # reading the call's (first) arguments value
        self.calls = 0  # calls closed
        self.open = False  # inside a call object
        self.ended = False  # a closing ']' or (not many) the one object closed

    @property
    def started(self) -> bool:
        """Whether the current call's CallStart went out."""
        return self.open and self.name is not None

    def put(self, c: str) -> list[CallEvent]:
        if self.ended:
            raise NotACall("text after the calls")
        if self.in_str:
            out = self._add(c)
            if self.esc:
                self.esc = False
            elif c == "\\":
                self.esc = True
            elif c == '"':
                self.in_str = False
                if len(self.stack) == self.call_level:
                    out += self._end_key() if self.token == "key" else self._end_value()
            return out
        lvl = len(self.stack)
        if lvl > self.call_level:  # inside a value's object or list
            out = self._add(c)
            if c == '"':
                self.in_str = True
            elif c in "{[":
                self.stack.append(c)
            elif c in "}]":
                self.stack.pop()
                if len(self.stack) == self.call_level:
                    out += self._end_value()
            return out
        if lvl < self.call_level:  # between calls
            if c.isspace() or (self.calls and c in ",;"):
                return []
            if c == "[" and lvl == 0 and self.many and self.call_level == 1 and not self.calls:
                self.stack.append(c)
                self.call_level = 2
                return []
            if c == "]" and lvl == 1 and self.calls:
                self.stack.pop()
                self.ended = True
                return []
            if c == "{" and (self.many or not self.calls):
                self.stack.append(c)
                self._new_call()
                return []
            raise NotACall(f"{c!r} where a call object was expected")
        out = []
        if self.scalar:
            if not (c.isspace() or c in ",}"):
                return self._add(c)
            out = self._end_value()
        if c.isspace():
            return out
        if self.slot == "key" and c == '"':
            self.in_str, self.token, self.buf = True, "key", ""
        elif self.slot == "colon" and c == ":":
            self.slot = "value"
        elif self.slot == "value":
            self.token, self.buf = "value", ""
            self.in_args = self.key in _ARG_KEYS and not self.args_seen
            out += self._add(c)
            if c == '"':
                self.in_str = True
            elif c in "{[":
                self.stack.append(c)
            else:
                self.scalar = True
        elif self.slot == "after" and c == ",":
            self.slot = "key"
        elif self.slot in ("key", "after") and c == "}":
            self.stack.pop()
            out += self._close_call()
        else:
            raise NotACall(f"{c!r} is not JSON here")
        return out

    def _new_call(self) -> None:
        self.open, self.slot, self.name, self.held_args, self.args_seen = True, "key", None, "", False

    def _add(self, c: str) -> list[CallEvent]:
        if self.in_str and self.token == "key" and len(self.stack) == self.call_level:
            self.buf += c
            return []
        self.buf += c
        if self.in_args:
            if self.name is None:
                self.held_args += c
                return []
            return [ArgsDelta(self.index, c)]
        return []

    def _end_key(self) -> list[CallEvent]:
        self.key = json.loads('"' + self.buf)
        self.slot = "colon"
        return []

    def _end_value(self) -> list[CallEvent]:
        out: list[CallEvent] = []
        self.scalar = False
        if self.key == "name":
            try:
                name = json.loads(self.buf)
            except ValueError:
                raise NotACall("the name is not a string") from None
            if not isinstance(name, str) or self.name is not None:
                raise NotACall("the name is not a string")
            self.name = name
            out.append(CallStart(self.index, new_call_id(), name))
            if self.held_args:
                out.append(ArgsDelta(self.index, self.held_args))
        elif self.in_args:  # a second arguments field is ignored, as any other key
            self.args_seen, self.in_args = True, False
        self.slot = "after"
        return out

    def _close_call(self) -> list[CallEvent]:
        if self.name is None:
            raise NotACall("an object without a name")
        out: list[CallEvent] = [] if self.args_seen else [ArgsDelta(self.index, "{}")]
        self.open = False
        self.calls += 1
        self.index += 1
        if not self.many:
            self.ended = True
        return out


class CallStream:
    """One choice's output → events, fed incrementally. ``feed`` returns what can be said now (holding back only
    text that may begin a call), adjacent pieces of the same kind merged; ``finish`` returns the rest. ``calls``
    counts the calls started."""

    calls: int = 0

    def feed(self, text: str) -> list[Event]:
        return _merged(self._feed(text))

    def _feed(self, text: str) -> list[Event]:
        raise NotImplementedError

    def finish(self) -> list[Event]:
        raise NotImplementedError


def _merged(events: list[Event]) -> list[Event]:
    out: list[Event] = []
    for e in events:
        prev = out[-1] if out else None
        if isinstance(e, Text) and isinstance(prev, Text):
            out[-1] = Text(prev.text + e.text)
        elif isinstance(e, ArgsDelta) and isinstance(prev, ArgsDelta) and prev.index == e.index:
            out[-1] = ArgsDelta(e.index, prev.text + e.text)
        else:
            out.append(e)
    return out


class NamedStream(CallStream):
    """A named tool_choice: the whole output is the function's arguments."""

    def __init__(self, name: str) -> None:
        self.name, self.calls = name, 0

    def _feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        if not self.calls:
            self.calls = 1
            out.append(CallStart(0, new_call_id(), self.name))
        if text:
            out.append(ArgsDelta(0, text))
        return out

    def finish(self) -> list[Event]:
        return self._feed("")


class JsonCallsStream(CallStream):
    """JSON calls (``required``'s list, or Llama 3's objects). ``leading_text``: the output may be plain text
    instead (Llama 3: it is a call only when it starts with ``{`` or ``<|python_tag|>``)."""

    def __init__(self, parallel: bool, leading_text: bool) -> None:
        self.scan = _CallScanner(True, 0, parallel)
        self.parallel = parallel
        self.state: Literal["start", "calls", "text"] = "start" if leading_text else "calls"
        self.pending = ""  # text not yet said: the start, or a call whose name has not come
        self.calls = 0

    def _feed(self, text: str) -> list[Event]:
        if self.state == "start":
            self.pending += text
            head = self.pending.lstrip()
            if head.startswith(PYTHON_TAG):
                self.state, text, self.pending = "calls", head[len(PYTHON_TAG):], ""
            elif head.startswith("{"):
                self.state, text, self.pending = "calls", self.pending, ""
            elif not head or PYTHON_TAG.startswith(head):
                return []
            else:
                self.state, text, self.pending = "text", self.pending, ""
        if self.state == "text":
            return [Text(text)] if text else []
        out: list[Event] = []
        for i, c in enumerate(text):
            try:
                evs = self.scan.put(c)
            except NotACall:
                out += self._to_text(text[i:])
                break
            out += self._keep(evs)
            self.pending = self.pending + c if self.scan.open and not self.scan.started else ""
        return out

    def _keep(self, evs: list[CallEvent]) -> list[CallEvent]:
        kept: list[CallEvent] = []
        for e in evs:
            if isinstance(e, CallStart):
                self.calls += 1
            if self.parallel or (isinstance(e, CallStart | ArgsDelta) and e.index == 0):
                kept.append(e)
        return kept

    def _to_text(self, rest: str) -> list[Event]:
        """Not a call: what was held of this object and everything after it is text."""
        held = "" if self.scan.started else self.pending
        self.state, self.pending = "text", ""
        return [Text(held + rest)] if held + rest else []

    def finish(self) -> list[Event]:
        if self.state == "start" or (self.state == "calls" and self.pending):
            held, self.pending, self.state = self.pending, "", "text"
            return [Text(held)] if held else []
        return []


class HermesStream(CallStream):
    """``<tool_call>{…}</tool_call>`` blocks among text."""

    def __init__(self, parallel: bool) -> None:
        self.parallel = parallel
        self.state: Literal["text", "call", "close"] = "text"
        self.pending = ""  # text that may be the start of a tag, or a call whose name has not come
        self.scan: _CallScanner | None = None
        self.calls = 0

    def _feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        while text:
            if self.state == "text":
                buf = self.pending + text
                at = buf.find(HERMES_OPEN)
                if at < 0:
                    keep = _partial_suffix(buf, HERMES_OPEN)
                    said, self.pending = buf[:len(buf) - keep], buf[len(buf) - keep:]
                    if said:
                        out.append(Text(said))
                    return out
                if at:
                    out.append(Text(buf[:at]))
                self.state, self.pending, text = "call", HERMES_OPEN, buf[at + len(HERMES_OPEN):]
                self.scan = _CallScanner(False, self.calls, self.parallel)
            elif self.state == "call":
                assert self.scan is not None
                for i, c in enumerate(text):
                    try:
                        evs = self.scan.put(c)
                    except NotACall:
                        rest = text[i:]
                        out += self._abandon(rest)
                        text = ""
                        break
                    if not self.scan.started and self.scan.open:
                        self.pending += c
                    else:
                        self.pending = ""
                    for e in evs:
                        if isinstance(e, CallStart):
                            self.calls += 1
                        if self.parallel or e.index == 0:
                            out.append(e)
                    if self.scan.ended:
                        self.state, text = "close", text[i + 1:]
                        break
                else:
                    text = ""
            else:  # after a call's JSON: its closing tag
                buf = (self.pending + text).lstrip()
                if buf.startswith(HERMES_CLOSE):
                    self.state, self.pending, text = "text", "", buf[len(HERMES_CLOSE):]
                elif HERMES_CLOSE.startswith(buf):
                    self.pending, text = buf, ""
                else:  # no closing tag: the text goes on
                    self.state, self.pending, text = "text", "", buf
        return out

    def _abandon(self, rest: str) -> list[Event]:
        """The tag held no call: its text, held so far, and the rest are text."""
        assert self.scan is not None
        held = "" if self.scan.started else self.pending
        self.state, self.pending = "text", ""
        return [Text(held), *self._feed(rest)] if held else self._feed(rest)

    def finish(self) -> list[Event]:
        held, self.pending = self.pending, ""
        if self.state == "close" or (self.state == "call" and self.scan is not None and self.scan.started):
            return []
        return [Text(held)] if held else []


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


# -- whole outputs -------------------------------------------------------------------------------------------
@dataclass(slots=True)
class ParsedOutput:
    """A choice's message: its text outside the calls (None when empty beside calls) and the calls."""

    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def collect(events: list[Event]) -> ParsedOutput:
    """Events → the message they add up to (calls in OpenAI's shape, arguments as text)."""
    text: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    for e in events:
        if isinstance(e, Text):
            text.append(e.text)
        elif isinstance(e, CallStart):
            calls[e.index] = {"id": e.id, "type": "function", "function": {"name": e.name, "arguments": ""}}
        else:
            calls[e.index]["function"]["arguments"] += e.text
    content = "".join(text)
    return ParsedOutput(content if content or not calls else None, [calls[i] for i in sorted(calls)])


def parse_output(stream: CallStream, text: str) -> ParsedOutput:
    """A whole output through ``stream``. A last call whose arguments are not JSON was cut by max_tokens: it is
    left out (the finish reason says ``length``), so every call returned parses. Any other call whose arguments
    are not JSON, or no call left, makes the whole output plain text, as vLLM's parsers do."""
    out = collect(stream.feed(text) + stream.finish())
    calls = out.tool_calls
    if not calls:
        return out
    if not _parses(calls[-1]["function"]["arguments"]):
        calls = calls[:-1]
    if not calls or not all(_parses(c["function"]["arguments"]) for c in calls):
        return ParsedOutput(text)
    return ParsedOutput(out.content, calls)


def _parses(s: str) -> bool:
    try:
        json.loads(s)
    except ValueError:
        return False
    return True

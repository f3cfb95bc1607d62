"""Grammar masks remembered by the place in a JSON document, for strings bounded by ``maxLength``.

Inside a JSON string with a ``maxLength``, llguidance's mask costs 150-600 µs a row on SmolLM2's tokenizer once fewer
characters are left than its longest tokens have: every count of characters is a lexer state of its own, and the
mask walks the token trie for it (docs/benchmarks.md, "Structured outputs"). The other masks of a JSON schema cost
10-30 µs. A decode step's fill of 32 rows waits for its slowest row, so those strings set the fill's time.

What such a mask allows depends only on what may still follow, and inside a plain string (no ``pattern``, ``format``,
``enum`` or ``const``) of an object or array that is plain too (no ``anyOf``, ``$ref``, ``uniqueItems``...) that is
fixed by the place alone: the key of every object on the way down and the keys it has had so far, the index of every
array item, and how many characters the string has. The characters themselves and the values before it do not
matter. So the mask process (``common/grammar_proc.py``) follows each sequence's output through the JSON
(:class:`JsonCursor`), and a mask made at a place is kept (:class:`MaskCache`, LRU by bytes) for every later
sequence of the same grammar at that place: rows of requests that share a schema take it without llguidance.

A place is used only where the rule holds for sure: the whole way down is checked against the schema
(:class:`SchemaPlaces`), and a string that has had a ``\\u`` escape or a non-ASCII byte is left alone (how the
grammar counts those is llguidance's business). Everything else is filled by llguidance as before.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

import numpy as np

# the JSON-schema keywords a place may pass through, by what the node is; any other keyword (anyOf, $ref, enum,
# pattern, uniqueItems, if, ...) makes what follows depend on more than the place
_NOTES = {"title", "description", "$comment", "examples", "default"}
_OBJECT_KEYS = {"type", "properties", "required", "additionalProperties", "minProperties", "maxProperties", *_NOTES}
_ARRAY_KEYS = {"type", "items", "minItems", "maxItems", *_NOTES}
_STRING_KEYS = {"type", "minLength", "maxLength", *_NOTES}
_ROOT_KEYS = {"$schema", "x-guidance"}
# the JSON options of every json_schema grammar the engine makes (common/structured.py): fixed separators, no free
# whitespace, so a place has one spelling
_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class SchemaPlaces:
    """One grammar's JSON schema, and whether a value string at a place is plain all the way down (memoized)."""

    def __init__(self, schema: dict[str, Any]) -> None:
        self.schema = schema
        self._memo: dict[tuple, tuple | None] = {}

    @classmethod
    def from_grammar(cls, text: str) -> SchemaPlaces | None:
        """The places of an llguidance grammar (its JSON form) made from one JSON schema with the engine's options;
        None for any other grammar."""
        if '"json_schema"' not in text:
            return None
        try:
            g = json.loads(text)
            (one,) = g["grammars"]
            schema = one["json_schema"]
        except (ValueError, KeyError, TypeError):
            return None
        if not isinstance(schema, dict) or one.get("lark_grammar") or g.get("max_tokens") is not None:
            return None
        if schema.get("x-guidance") != _OPTIONS:
            return None
        return cls(schema)

    def place(self, path: tuple) -> tuple | None:
        """The value string at ``path`` (:meth:`JsonCursor.place`) as a place of this schema, or None where the
        string or a node above it is not plain (memoized). Array items past ``minItems`` of an array with no
        ``maxItems`` are one place: what may follow them is the same."""
        if path in self._memo:
            return self._memo[path]
        got = self._memo[path] = self._place(path)
        return got

    def _place(self, path: tuple) -> tuple | None:
        node: Any = self.schema
        extra = _ROOT_KEYS
        out: list = []
        for step in path:
            if not isinstance(node, dict):
                return None
            if isinstance(step, int):  # an array item
                if node.get("type") != "array" or not node.keys() <= _ARRAY_KEYS | extra:
                    return None
                lo = node.get("minItems", 0)
                if not isinstance(lo, int):
                    return None
                out.append(step if "maxItems" in node else min(step, lo))
                node = node.get("items", {})
            else:  # an object's value: step is (the keys so far, this one last)
                if node.get("type") != "object" or not node.keys() <= _OBJECT_KEYS | extra:
                    return None
                props = node.get("properties", {})
                if not isinstance(props, dict) or step[-1] not in props:
                    return None
                out.append(step)
                node = props[step[-1]]
            extra = set()
        if isinstance(node, dict) and node.get("type") == "string" and node.keys() <= _STRING_KEYS:
            return tuple(out)
        return None


class JsonCursor:
    """Where a sequence's output is in the JSON it writes: fed the bytes of each token it takes."""

    __slots__ = ("_chars", "_clean", "_escape", "_key", "_stack", "_string", "broken")

    def __init__(self) -> None:
        # one frame per open object ([keys so far], the key being read) or array ([index])
        self._stack: list[list] = []
        self._string = 0  # 0: outside a string; 1: a key; 2: a value
        self._chars = 0  # characters of the string so far
        self._escape = 0  # bytes left of an escape sequence
        self._clean = True  # the string has had no \u escape and no non-ASCII byte
        self._key = bytearray()  # a key's bytes while it is read
        self.broken = False  # bytes no JSON document has (the grammar is not JSON, or a token broke it)

    def feed(self, data: bytes) -> None:
        if self.broken:
            return
        for b in data:
            if self._string:
                self._in_string(b)
            elif b == 0x22:  # "
                top = self._stack[-1] if self._stack else None
                self._string = 1 if top is not None and top[0] == "o" and top[2] else 2
                self._chars, self._escape, self._clean = 0, 0, True
                self._key.clear()
            elif b == 0x7B:  # {
                self._stack.append(["o", [], True])  # expecting a key
            elif b == 0x5B:  # [
                self._stack.append(["a", 0])
            elif b in (0x7D, 0x5D):  # } ]
                if not self._stack:
                    self.broken = True
                    return
                self._stack.pop()
            elif b == 0x2C:  # ,
                if not self._stack:
                    self.broken = True
                    return
                top = self._stack[-1]
                if top[0] == "a":
                    top[1] += 1
                else:
                    top[2] = True
            # ':', ' ', digits, true/false/null: nothing to follow

    def _in_string(self, b: int) -> None:
        if self._escape:
            if self._escape == 1 and b == 0x75:  # \u: four hex digits follow
                self._escape, self._clean = 4, False
            else:
                self._escape -= 1
            if self._string == 1:
                self._key.append(b)
            return
        if b == 0x22:  # the end of the string
            if self._string == 1:
                top = self._stack[-1]
                top[1].append(self._key.decode("utf-8", "replace"))
                top[2] = False  # a value follows
            self._string = 0
            return
        if self._string == 1:
            self._key.append(b)
        if b == 0x5C:  # \
            self._escape = 1
            self._chars += 1
        elif b < 0x80:
            self._chars += 1
        else:
            self._clean = False

    def place(self) -> tuple[tuple, int] | None:
        """(the path to the value string being written, its characters so far), or None when the output is not
        inside a value string, or is in the middle of an escape, or the string is not plain ASCII."""
        if self._string != 2 or self._escape or not self._clean or self.broken:
            return None
        return tuple(tuple(f[1]) if f[0] == "o" else f[1] for f in self._stack), self._chars


class MaskCache:
    """Masks by (grammar, place), least recently used dropped past ``max_bytes``."""

    def __init__(self, row_words: int, max_bytes: int = 32 << 20) -> None:
        self.capacity = max(1, max_bytes // (row_words * 4))
        self._rows: OrderedDict[tuple, np.ndarray] = OrderedDict()
        self.hits = self.misses = 0

    def get(self, key: tuple) -> np.ndarray | None:
        row = self._rows.get(key)
        if row is None:
            self.misses += 1
            return None
        self._rows.move_to_end(key)
        self.hits += 1
        return row

    def put(self, key: tuple, row: np.ndarray) -> None:
        self._rows[key] = row.copy()
        while len(self._rows) > self.capacity:
            self._rows.popitem(last=False)

    def __len__(self) -> int:
        return len(self._rows)


class PlaceKeys:
    """The child's side: each slot's cursor and grammar, and the cache key of its next mask (None: not cacheable).

    ``token_bytes(t)``: a token's bytes, as the grammar reads them."""

    def __init__(self, token_bytes: Any) -> None:
        self._bytes = token_bytes
        self._places: dict[str, SchemaPlaces | None] = {}  # by grammar text
        self._slots: dict[int, tuple[str, SchemaPlaces, JsonCursor]] = {}

    def add(self, slot: int, text: str, prior: list[int]) -> None:
        if text in self._places:
            places = self._places[text]
        else:
            places = self._places[text] = SchemaPlaces.from_grammar(text)
            if len(self._places) > 1024:  # grammars seen: forget the oldest
                self._places.pop(next(iter(self._places)))
        if places is None:
            self._slots.pop(slot, None)
            return
        cursor = JsonCursor()
        for t in prior:
            cursor.feed(self._bytes(t))
        self._slots[slot] = (text, places, cursor)

    def drop(self, slot: int) -> None:
        self._slots.pop(slot, None)

    def advance(self, slot: int, token: int, ok: bool) -> None:
        entry = self._slots.get(slot)
        if entry is not None:
            if ok:
                entry[2].feed(self._bytes(token))
            else:
                entry[2].broken = True

    def key(self, slot: int) -> tuple | None:
        entry = self._slots.get(slot)
        if entry is None:
            return None
        text, places, cursor = entry
        at = cursor.place()
        if at is None:
            return None
        where = places.place(at[0])
        return None if where is None else (text, where, at[1])

"""Grammar masks remembered by their place in a JSON document.

Inside a JSON string with a ``maxLength``, llguidance's mask costs 150-600 µs a row on SmolLM2's tokenizer once fewer
characters are left than its longest tokens have: every count of characters is a lexer state of its own, and the
mask walks the token trie for it. The other masks of a JSON schema cost 10-50 µs (docs/benchmarks.md, "Structured
outputs"). A decode step's fill of 32 rows waits for its slowest row.

What a mask allows depends only on what may still follow. Inside objects and arrays that are plain (no ``anyOf``,
``$ref``, ``uniqueItems``, ``enum``... on a container: :class:`SchemaPlaces`; an ``anyOf`` of branches of distinct
types, as pydantic makes ``Optional[X]``, is its branch once a value has begun), that is fixed by the place: for every
container on the way down, the keys its object has had so far or its array item's class (:func:`item_class`), and
whether it waits for a key, is inside a member or has just ended one; and the bytes of the member being written since
it began (a key's letters, a number's digits, ``: "`` and the string's characters so far). The values that were
written before do not matter. Inside a plain string (no ``pattern``, ``format``, ``enum`` or ``const``) only the
number of its characters does, so rows writing different names share the places of their names' lengths. The mask
process (``common/grammar_proc.py``) follows each sequence's output through the JSON (:class:`JsonCursor`), and a
mask made at a place is kept (:class:`MaskCache`, LRU by bytes) for every later sequence of the same grammar at that
place: rows of requests that share a schema take it without llguidance.

A string that has had a ``\\u`` escape or a non-ASCII byte is placed by its bytes, not its length (how the grammar
counts those is llguidance's business). Anywhere else (under a container that is not plain, a grammar that is not
one JSON schema with the engine's options, a member longer than ``MAX_MEMBER`` bytes) llguidance fills the mask.
"""

from __future__ import annotations

import functools
import itertools
import json
from collections import OrderedDict
from typing import Any

import numpy as np

# the JSON-schema keywords of a container a place may pass through; any other (anyOf, $ref, enum, uniqueItems, if, ...)
# makes what may follow depend on more than the place. A string with only these is plain: its length is its place
_NOTES = {"title", "description", "$comment", "examples", "default"}
_OBJECT_KEYS = {"type", "properties", "required", "additionalProperties", "minProperties", "maxProperties", *_NOTES}
_ARRAY_KEYS = {"type", "items", "minItems", "maxItems", *_NOTES}
_STRING_KEYS = {"type", "minLength", "maxLength", *_NOTES}
_ROOT_KEYS = {"$schema", "x-guidance"}
MAX_MEMBER = 256  # bytes of a member a place may hold
_PLACE_IDS = itertools.count()  # places of every schema, numbered
# the JSON options of every json_schema grammar the engine makes (common/structured.py): fixed separators, no free
# whitespace, so a place has one spelling
_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_ITEM_SEPARATOR = b", "


def token_bytes_of(lltok: Any) -> Any:
    """llguidance tokenizer ``lltok``'s bytes of a token (as its grammars read them), each token decoded once."""
    return functools.lru_cache(maxsize=None)(lambda t: lltok.decode_bytes([t]))


def token_reach(token_bytes: Any, vocab_size: int) -> int:
    """How many of an array's item boundaries one token can cross: one more than the most item separators (``, ``)
    any token holds (SmolLM2's: none, so 1: a token may end an item and hold the comma after it, never more)."""
    return 1 + max((token_bytes(t).count(_ITEM_SEPARATOR) for t in range(vocab_size)), default=0)


def item_class(at: int, min_items: int, max_items: int | None, reach: int) -> tuple[bool, int, int]:
    """Which items of an array take the same masks: what may follow item ``at`` within ``reach`` boundaries
    (:func:`token_reach`), that is whether it is the first (it follows ``[``, where ``]`` may come instead; the
    others follow a comma, after which an item must), how many more items must follow it and how many may, each
    counted up to ``reach``. A token starting in or before item ``at`` sees no farther: with a reach of 1 the items
    between the first and the last few of a long list share one place."""
    must = min(max(min_items - at - 1, 0), reach)
    may = reach if max_items is None else min(max(max_items - at - 1, 0), reach)
    return at == 0, must, may


class SchemaPlaces:
    """One grammar's JSON schema, and the places of its documents: where every container on the way down is plain."""

    def __init__(self, schema: dict[str, Any], reach: int = 1) -> None:
        self.schema = schema
        self.reach = reach  # item boundaries one token can cross (:func:`token_reach`)
        self._memo: dict[tuple, tuple[int, bool] | None] = {}
        self._ids: dict[tuple, int] = {}

    @classmethod
    def from_grammar(cls, text: str, reach: int = 1) -> SchemaPlaces | None:
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
        return cls(schema, reach)

    def place(self, frames: tuple) -> tuple[int, bool] | None:
        """``frames`` (:meth:`JsonCursor.place`) as a place of this schema: a number for the frames with each array
        index made its class (:func:`item_class`: items of one class take the same masks), unique over every
        schema, and whether the member being written is a plain string's value; None where a container on the way
        is not plain (memoized)."""
        if frames in self._memo:
            return self._memo[frames]
        got = self.resolve(frames)
        if got is not None:
            norm, plain = got
            ids = self._ids.get(norm)
            if ids is None:
                ids = self._ids[norm] = next(_PLACE_IDS)
            self._memo[frames] = (ids, plain)
        else:
            self._memo[frames] = None
        return self._memo[frames]

    def resolve(self, frames: tuple) -> tuple[tuple, bool] | None:
        """What :meth:`place` numbers: (the frames with each array index made its class, whether the member is a
        plain string's value), or None."""
        node: Any = self.schema
        extra = _ROOT_KEYS
        out: list = []
        for depth, (kind, at, phase) in enumerate(frames):
            if depth:
                node = _branch(node, "object" if kind == "o" else "array")
            if not isinstance(node, dict) or not node.keys() <= (_OBJECT_KEYS if kind == "o" else _ARRAY_KEYS) | extra:
                return None
            extra = set()
            if kind == "a":
                lo, hi = node.get("minItems", 0), node.get("maxItems")
                if (node.get("type") != "array" or not isinstance(lo, int) or not isinstance(hi, int | None)
                        or not isinstance(node.get("items", {}), dict)):
                    return None  # items as a list (an old draft's tuple): each index has a schema of its own
                out.append((kind, item_class(at, lo, hi, self.reach), phase))
                node = node.get("items", {})
            else:
                props = node.get("properties", {})
                if node.get("type") != "object" or not isinstance(props, dict):
                    return None
                out.append((kind, at, phase))
                node = props.get(at[-1]) if at and phase == 1 else None
            if node is None and depth < len(frames) - 1:  # a member the schema does not name holds a container
                return None
        top_member = frames and frames[-1][2] == 1
        node = _branch(node, "string")
        plain = (top_member and isinstance(node, dict) and node.get("type") == "string"
                 and node.keys() <= _STRING_KEYS)
        return tuple(out), bool(plain)


def _branch(node: Any, kind: str) -> Any:
    """Inside a value of JSON type ``kind`` (begun with its first byte), the one branch of an ``anyOf`` of typed
    branches (pydantic's ``Optional[X]``: X or null) that takes it: every branch names one type, and only one names
    ``kind``, so the value's first byte has ruled out the others. ``node`` itself for anything else."""
    if not isinstance(node, dict) or "anyOf" not in node or not node.keys() <= {"anyOf", *_NOTES}:
        return node
    branches = node["anyOf"]
    if not isinstance(branches, list) or not all(isinstance(b, dict) and isinstance(b.get("type"), str)
                                                 for b in branches):
        return node
    hits = [b for b in branches if b["type"] == kind]
    return hits[0] if len(hits) == 1 else node


class JsonCursor:
    """Where a sequence's output is in the JSON it writes: fed the bytes of each token it takes."""

    __slots__ = ("_chars", "_clean", "_escape", "_frames", "_key", "_stack", "_string", "_tail", "broken")

    def __init__(self) -> None:
        # one frame per open container: [kind, the object's keys so far or the array item's index, phase]; phase 0:
        # waiting for a key or an item, 1: in a member (its key, then its value; an array's item), 2: a member ended
        self._stack: list[list] = []
        self._string = 0  # 0: outside a string; 1: a key; 2: a value
        self._chars = 0  # characters of the string so far
        self._escape = 0  # bytes left of an escape sequence
        self._clean = True  # the string has had no \u escape and no non-ASCII byte
        self._key = bytearray()  # a key's bytes while it is read
        self._tail = bytearray()  # the member's bytes since it began (or since the last container began or ended)
        self._frames: tuple | None = ()  # the stack as place() gives it, until it changes (None: made again)
        self.broken = False  # bytes no JSON document has (the grammar is not JSON, or a token broke it)

    def feed(self, data: bytes) -> None:
        if self.broken:
            return
        for b in data:
            if self._string:
                self._tail.append(b)
                self._in_string(b)
                continue
            if b == 0x2C:  # ,
                if not self._stack:
                    self.broken = True
                    return
                last = self._stack[-1]
                if last[0] == "a":
                    last[1] += 1
                last[2] = 0
                self._tail.clear()
                self._frames = None
            elif b in (0x7B, 0x5B):  # { [
                if self._stack:
                    self._stack[-1][2] = 1
                self._stack.append(["o", [], 0] if b == 0x7B else ["a", 0, 0])
                self._tail.clear()
                self._frames = None
            elif b in (0x7D, 0x5D):  # } ]
                if not self._stack:
                    self.broken = True
                    return
                self._stack.pop()
                if self._stack:
                    self._stack[-1][2] = 2
                self._tail.clear()
                self._frames = None
            else:
                self._tail.append(b)
                if b == 0x22:  # "
                    top = self._stack[-1] if self._stack else None
                    self._string = 1 if top is not None and top[0] == "o" and top[2] == 0 else 2
                    self._chars, self._escape, self._clean = 0, 0, True
                    self._key.clear()
                    if top is not None:
                        top[2] = 1
                        self._frames = None
                # ':', ' ', digits, true/false/null: in the tail

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
                self._stack[-1][1].append(self._key.decode("utf-8", "replace"))  # the member's value follows
            else:
                if self._stack:
                    self._stack[-1][2] = 2
                self._tail.clear()
            self._frames = None
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

    def place(self) -> tuple[tuple, bytes, int | None] | None:
        """(the frames: each container's kind, keys so far or index, and phase; the member's bytes so far; the
        characters of the value string being written, when it is plain ASCII and not inside an escape), or None
        outside the document (before it or after it), when the output is not JSON, or when the member is longer than
        MAX_MEMBER bytes."""
        if self.broken or not self._stack or len(self._tail) > MAX_MEMBER:  # outside the document: its start or end
            return None
        frames = self._frames
        if frames is None:
            frames = self._frames = tuple((f[0], tuple(f[1]) if f[0] == "o" else f[1], f[2]) for f in self._stack)
        count = self._chars if self._string == 2 and not self._escape and self._clean else None
        return frames, bytes(self._tail), count


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

    ``token_bytes(t)``: a token's bytes, as the grammar reads them; ``reach``: :func:`token_reach` of the
    tokenizer."""

    def __init__(self, token_bytes: Any, reach: int) -> None:
        self._bytes = token_bytes
        self.reach = reach
        self._places: dict[str, SchemaPlaces | None] = {}  # by grammar text
        # by slot: [its grammar's places, its cursor, the frames it had at the last key, their place]
        self._slots: dict[int, list] = {}

    def add(self, slot: int, text: str, prior: list[int]) -> None:
        if text in self._places:
            places = self._places[text]
        else:
            places = self._places[text] = SchemaPlaces.from_grammar(text, self.reach)
            if len(self._places) > 1024:  # grammars seen: forget the oldest
                self._places.pop(next(iter(self._places)))
        if places is None:
            self._slots.pop(slot, None)
            return
        cursor = JsonCursor()
        for t in prior:
            cursor.feed(self._bytes(t))
        self._slots[slot] = [places, cursor, None, None]

    def drop(self, slot: int) -> None:
        self._slots.pop(slot, None)

    def advance(self, slot: int, token: int, ok: bool) -> None:
        entry = self._slots.get(slot)
        if entry is not None:
            if ok:
                entry[1].feed(self._bytes(token))
            else:
                entry[1].broken = True

    def cached(self, slot: int, cache: MaskCache) -> tuple[tuple | None, np.ndarray | None]:
        """The slot's next mask from ``cache``: (its key, None: not cacheable; the kept mask, None: not kept yet,
        llguidance makes it and the caller keeps it under the key)."""
        key = self.key(slot)
        return key, cache.get(key) if key is not None else None

    def key(self, slot: int) -> tuple[int, int | bytes] | None:
        """(the place's number, the plain string's characters so far or the member's bytes)."""
        entry = self._slots.get(slot)
        if entry is None:
            return None
        at = entry[1].place()
        if at is None:
            return None
        frames, tail, count = at
        if frames is entry[2]:  # the same containers as at the last key: their place too
            where = entry[3]
        else:
            where = entry[3] = entry[0].place(frames)
            entry[2] = frames
        if where is None:
            return None
        return where[0], count if count is not None and where[1] else tail

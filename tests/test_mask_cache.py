"""The mask process's masks kept by place in a JSON document (common/mask_cache.py): a cached mask is the mask
llguidance makes there, bit for bit, and places are used only where the schema makes that so."""

from __future__ import annotations

import json
import random

import llguidance as llg
import numpy as np
import pytest

from common.grammar_proc import make_tokenizer
from common.loader import load_tokenizer
from common.mask_cache import JsonCursor, MaskCache, PlaceKeys, SchemaPlaces, item_class, token_reach
from common.sampling import StructuredOutput
from common.structured import _JSON_OPTIONS, GrammarCompiler
from loadgen.bench_structured import SCHEMAS

V = 49152
EOS = 2
NESTED = {"type": "object", "properties": {
    "tags": {"type": "array", "minItems": 1, "maxItems": 3,
             "items": {"type": "string", "minLength": 2, "maxLength": 6}},
    "inner": {"type": "object", "properties": {"x": {"type": "string", "maxLength": 5},
                                               "y": {"type": "string", "maxLength": 3}}, "required": ["x"]},
    "notes": {"type": "array", "minItems": 2, "items": {"type": "string", "maxLength": 4}}},
    "required": ["tags", "inner", "notes"], "additionalProperties": False}
LISTS = {"type": "object", "properties": {"nums": {"type": "array", "items": {"type": "integer"}},
                                          "words": {"type": "array", "items": {"type": "string", "maxLength": 5}}},
         "required": ["nums", "words"], "additionalProperties": False}

# long lists with both bounds: their middle items share a class (common.mask_cache.item_class)
LONG = {"type": "object", "properties": {
    "ids": {"type": "array", "minItems": 3, "maxItems": 12, "items": {"type": "integer", "minimum": 0, "maximum": 99}},
    "rows": {"type": "array", "minItems": 2, "maxItems": 9, "items": {"type": "object", "properties": {
        "k": {"type": "string", "maxLength": 4}, "v": {"type": "array", "maxItems": 6, "items": {"type": "boolean"}}},
        "required": ["k", "v"], "additionalProperties": False}},
    "tags": {"type": "array", "minItems": 1, "items": {"type": "string", "maxLength": 3}}},
    "required": ["ids", "rows", "tags"], "additionalProperties": False}

# pydantic's Optional[X] (anyOf X or null, in either order) around a string, an object and a list
NULLABLE = {"type": "object", "properties": {
    "a": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 6}], "default": None},
    "b": {"anyOf": [{"type": "object", "properties": {"x": {"type": "string", "maxLength": 4}},
                     "required": ["x"], "additionalProperties": False}, {"type": "null"}]},
    "c": {"anyOf": [{"type": "integer"}, {"type": "array", "maxItems": 4, "items": {"type": "string", "maxLength": 3}},
                    {"type": "null"}]}},
    "required": ["a", "b", "c"], "additionalProperties": False}


def grammar(schema: dict) -> str:
    return llg.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)


def place(schema: dict, text: str):
    """Where the next mask after ``text`` is kept: (the containers' frames as a place, the plain string's characters
    or the member's bytes); None where none is."""
    places = SchemaPlaces.from_grammar(grammar(schema))
    cursor = JsonCursor()
    cursor.feed(text.encode())
    at = cursor.place()
    where = None if at is None or places is None else places.resolve(at[0])
    if where is None:
        return None
    return where[0], at[2] if at[2] is not None and where[1] else at[1]


def test_rows_at_one_place_share_a_key_and_rows_elsewhere_do_not():
    keys = PlaceKeys(lambda t: bytes([t]), 1)
    text = grammar(SCHEMAS["person"])
    for slot, doc in enumerate(['{"name": "Ada Lo', '{"name": "Bob Xy', '{"name": "Bob X', '{"name": "Ada", "age": 3']):
        keys.add(slot, text, list(doc.encode()))
    assert keys.key(0) == keys.key(1) != keys.key(2)
    assert keys.key(3)[1] == b' "age": 3'
    keys.advance(2, ord("y"), True)
    assert keys.key(2) == keys.key(0)
    keys.advance(0, ord("z"), False)  # a token the grammar refused: no place from then on
    assert keys.key(0) is None


def test_the_cursor_follows_keys_items_and_characters():
    c = JsonCursor()
    c.feed(b'{"a": 1, "b": [{"c": "x\\"y')
    # in b's first item, c's value: 3 characters (an escape is one); the keys so far and each container's phase
    assert c.place() == ((("o", ("a", "b"), 1), ("a", 0, 1), ("o", ("c",), 1)), b'"c": "x\\"y', 3)
    c.feed(b'", "d')  # a key being written: its bytes are the member's
    assert c.place() == ((("o", ("a", "b"), 1), ("a", 0, 1), ("o", ("c",), 1)), b' "d', None)
    c.feed(b'": "q"}, {"c": "zz')
    assert c.place() == ((("o", ("a", "b"), 1), ("a", 1, 1), ("o", ("c",), 1)), b'"c": "zz', 2)
    c.feed(b'\\')  # in the middle of an escape: no count
    assert c.place()[2] is None
    c.feed(b'n"')  # the member ended
    assert c.place() == ((("o", ("a", "b"), 1), ("a", 1, 1), ("o", ("c",), 2)), b"", None)
    c.feed(b', "e": 12')  # a number's digits
    assert c.place() == ((("o", ("a", "b"), 1), ("a", 1, 1), ("o", ("c", "e"), 1)), b' "e": 12', None)
    c.feed(b"}]")
    assert c.place() == ((("o", ("a", "b"), 2),), b"", None)


@pytest.mark.parametrize("text", ['{"name": "\\u00e9', '{"name": "café'])
def test_a_string_with_a_unicode_escape_or_non_ascii_byte_is_placed_by_its_bytes(text):
    assert place(SCHEMAS["person"], text)[1] == text[1:].encode()


@pytest.mark.parametrize("schema, text", [
    ({"anyOf": [{"type": "object", "properties": {"a": {"type": "string"}}}, {"type": "array"}]}, '{"a": "x'),
    # two branches of one type: the first byte does not decide between them
    ({"type": "object", "properties": {"a": {"anyOf": [{"type": "object", "properties": {"b": {"type": "string"}}},
                                                         {"type": "object", "properties": {"c": {"type": "string"}}}]}}},
     '{"a": {"b": "x'),
    ({"type": "object", "properties": {"a": {"anyOf": [{"type": "object"}, {"enum": ["x"]}]}}}, '{"a": {"b'),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/o"}},
      "$defs": {"o": {"type": "object", "properties": {"b": {"type": "string"}}}}}, '{"a": {"b": "x'),
    ({"type": "array", "uniqueItems": True, "items": {"type": "string"}}, '["x'),
    ({"type": "array", "items": [{"type": "string"}, {"type": "integer"}]}, '["a", 1'),  # a schema per index
    ({"type": "object", "properties": {"a": {"type": "object", "enum": [{"b": 1}]}}}, '{"a": {"b'),
    ({"type": "object", "additionalProperties": {"type": "object"}}, '{"free": {"x'),  # under a key not named
])
def test_places_are_left_alone_where_a_container_decides_more_than_the_place(schema, text):
    assert place(schema, text) is None


def test_plain_strings_are_placed_by_length_the_rest_by_bytes_and_items_by_their_class():
    assert place(SCHEMAS["person"], '{"name": "Ada Lo') == ((("o", ("name",), 1),), 6)
    assert place(SCHEMAS["person"], '{"name": "Bob X", "age": 7, "email": "b@') == ((("o", ("name", "age", "email"), 1),), 2)
    assert place(SCHEMAS["person"], '{"name": "Bob X", "age": 7') == ((("o", ("name", "age"), 1),), b' "age": 7')
    # an enum's string, a pattern's: what was written matters, so the bytes are the place
    assert place(SCHEMAS["weather"], '{"city": "Paris", "unit": "cel')[1] == b' "unit": "cel'
    assert place(SCHEMAS["event"], '{"title": "L", "date": "2026-1')[1] == b' "date": "2026-1'
    # a nullable string (anyOf string or null): once the string has begun, a plain string, placed by its length;
    # before, by its bytes
    event = '{"title": "L", "date": "2026-11-27", "attendees": [], "location": '
    assert place(SCHEMAS["event"], event + '"Pa')[1] == 2
    assert place(SCHEMAS["event"], event + 'nu')[1] == b' "location": nu'
    notes = ['{"tags": ["ab"], "inner": {"x": "q"}, "notes": [' + ", ".join(['"n"'] * i + ['"a']) for i in range(5)]
    # minItems 2, no maxItems: the first item; then every item after which ``]`` may come, and more may follow
    assert [place(NESTED, t)[0][-1] for t in notes] == [("a", c, 1) for c in
                                                         ((True, 1, 1), (False, 0, 1), (False, 0, 1), (False, 0, 1),
                                                          (False, 0, 1))]
    # no minItems and no maxItems: the first item is a place of its own (``]`` may end the list there, and a
    # comma's item comes after a space), the rest are one
    nums = ['{"nums": [' + ", ".join(["1"] * i) + (", " if i else "") for i in range(4)]
    first, rest = (True, 0, 1), (False, 0, 1)
    assert [place(LISTS, t) for t in nums] == [((("o", ("nums",), 1), ("a", c, 0)), tail)
                                               for c, tail in ((first, b""), (rest, b" "), (rest, b" "), (rest, b" "))]
    assert place(LISTS, '{"nums": [1,') == ((("o", ("nums",), 1), ("a", rest, 0)), b"")
    assert place(LISTS, '{"nums": [') != place(LISTS, '{"nums": [1,')
    # maxItems 3: the last item (no comma may follow it) is a place of its own
    assert place(NESTED, '{"tags": ["ab", "c')[0][-1] == ("a", (False, 0, 1), 1)
    assert place(NESTED, '{"tags": ["ab", "cd", "e')[0][-1] == ("a", (False, 0, 0), 1)


def test_items_of_a_long_list_share_a_class_but_its_ends_do_not():
    """minItems 3, maxItems 8, a token reaching one boundary: the first item, the one before the last that must
    come, then the items that may end the list, and the last one allowed, are told apart; the rest share."""
    classes = [item_class(i, 3, 8, 1) for i in range(8)]
    assert classes == [(True, 1, 1), (False, 1, 1), (False, 0, 1), (False, 0, 1), (False, 0, 1), (False, 0, 1),
                       (False, 0, 1), (False, 0, 0)]
    # a tokenizer whose tokens hold an item separator reaches two boundaries: two more items are told apart
    assert [item_class(i, 3, 8, 2)[1:] for i in range(8)] == [(2, 2), (1, 2), (0, 2), (0, 2), (0, 2), (0, 2),
                                                              (0, 1), (0, 0)]
    assert item_class(5, 0, None, 1) == item_class(50, 0, None, 1) == (False, 0, 1)
    toks = [b"a", b", ", b"], [1, "]  # the last holds two separators
    assert token_reach(toks.__getitem__, 3) == 3
    assert token_reach(lambda t: bytes([t]), 256) == 1


def test_grammars_other_than_one_json_schema_with_the_engines_options_have_no_places():
    assert SchemaPlaces.from_grammar(grammar(SCHEMAS["person"])) is not None
    assert SchemaPlaces.from_grammar(llg.LLMatcher.grammar_from_regex(r"[a-z]+")) is None
    assert SchemaPlaces.from_grammar(llg.LLMatcher.grammar_from_json_schema(SCHEMAS["person"])) is None  # other options
    assert SchemaPlaces.from_grammar(llg.LLMatcher.grammar_from_lark('start: "x"')) is None


class _Walker:
    """Random walks through grammars (random allowed tokens, most of them short printable ones, some escapes) that
    share one cache of masks by place: at every step where the cache has a mask, it must equal the mask llguidance
    computes for the walk's own matcher. ``checked``: how many did."""

    def __init__(self, seed: int) -> None:
        self.tok = make_tokenizer(load_tokenizer().tk.to_str(), V, [EOS])
        self.words = (V + 31) // 32
        self._bytes: dict[int, bytes] = {}
        self.rng = random.Random(seed)
        self.row = np.zeros(self.words, dtype=np.int32)
        self.checked = 0
        self.reach = token_reach(self.token_bytes, V)

    def token_bytes(self, t: int) -> bytes:
        if t not in self._bytes:
            self._bytes[t] = self.tok.decode_bytes([t])
        return self._bytes[t]

    def walk(self, schema: dict, walks: int, steps: int, cache: MaskCache, keys: PlaceKeys) -> None:
        text, rng, row = grammar(schema), self.rng, self.row
        start = llg.LLMatcher(self.tok, text)
        assert not start.is_error(), json.dumps(schema)
        for _ in range(walks):
            m, out = start.deep_copy(), b""
            keys.add(0, text, [])
            for _ in range(steps):
                m.unsafe_compute_mask_ptr(row.ctypes.data, self.words * 4)
                key = keys.key(0)
                if key is not None:
                    kept = cache.get(key)
                    if kept is None:
                        cache.put(key, row)
                    else:
                        assert np.array_equal(kept, row), \
                            f"{json.dumps(schema)} after {out!r}: the mask kept at {key[1:]} differs from llguidance's"
                        self.checked += 1
                allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:V])
                allowed = allowed[allowed != EOS]
                if m.is_stopped() or not len(allowed):
                    break
                pick = [int(t) for t in rng.sample(list(allowed), min(8, len(allowed)))]
                short = [t for t in pick if all(32 <= c < 127 for c in self.token_bytes(t))]
                t = min(short or pick, key=lambda t: (len(self.token_bytes(t)), rng.random())) \
                    if rng.random() < 0.8 else pick[0]
                assert m.consume_token(t)
                keys.advance(0, t, True)
                out += self.token_bytes(t)
            keys.drop(0)


def test_a_cached_mask_is_the_mask_llguidance_makes_at_that_place():
    """Ten walks through each of the five benchmark schemas, one with nested bounded strings, one with unbounded
    lists, one with long bounded lists and one of nullable members, all sharing one cache."""
    w = _Walker(7)
    cache, keys = MaskCache(w.words), PlaceKeys(w.token_bytes, w.reach)
    for schema in [*SCHEMAS.values(), NESTED, LISTS, NULLABLE]:
        w.walk(schema, 10, 90, cache, keys)
    w.walk(LONG, 10, 200, cache, keys)
    assert w.checked > 300, w.checked  # most places came back: the check had cases


def _random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A JSON schema of the kinds the places know: objects with optional members, lists with and without
    minItems / maxItems, bounded strings, numbers, booleans and nulls, nullable ones (anyOf X or null), nested up
    to three deep."""
    kind = rng.choice(["integer", "string", "boolean", "array", "object", "number", "null", "nullable"] if depth < 3
                      else ["integer", "string", "boolean"])
    if kind == "nullable":  # pydantic's Optional[X], in either order, or X, an integer or null
        branches = [_random_schema(rng, depth), {"type": "null"}]
        if rng.random() < 0.3:
            branches.append({"type": "integer"})
        rng.shuffle(branches)
        return {"anyOf": branches}
    s: dict = {"type": kind}
    if kind == "integer" and rng.random() < 0.5:
        s.update(minimum=-5, maximum=rng.choice([9, 120]))
    elif kind == "string":
        if rng.random() < 0.6:
            s["maxLength"] = rng.choice([1, 3, 8, 20])
        if rng.random() < 0.3:
            s["minLength"] = 1
    elif kind == "array":
        s["items"] = _random_schema(rng, depth + 1)
        if rng.random() < 0.5:
            s["minItems"] = rng.choice([0, 1, 2, 4])
        if rng.random() < 0.5:
            s["maxItems"] = max(rng.choice([1, 2, 3, 5, 8]), s.get("minItems", 0))
    elif kind == "object":
        props = {f"k{i}": _random_schema(rng, depth + 1) for i in range(rng.randint(0, 3))}
        s.update(properties=props, required=[p for p in props if rng.random() < 0.6], additionalProperties=False)
    return s


def test_cached_masks_equal_llguidances_on_random_schemas():
    """25 random schemas (``_random_schema``), six walks each sharing a cache of their own."""
    w = _Walker(5)
    for _ in range(25):
        schema = {"type": "object", "properties": {"a": _random_schema(w.rng), "b": _random_schema(w.rng)},
                  "required": ["a", "b"], "additionalProperties": False}
        w.walk(schema, 6, 70, MaskCache(w.words), PlaceKeys(w.token_bytes, w.reach))
    assert w.checked > 1000, w.checked


def test_the_mask_process_takes_a_second_row_at_a_place_from_the_cache():
    """Two matchers of one schema write different names of one length, one after the other: inside the second's
    name every mask comes from the first's places, and each equals the matcher's own inline fill."""
    tok = load_tokenizer()
    inline = GrammarCompiler(tok.tk.to_str(), V, (EOS,))
    mirrored = GrammarCompiler(tok.tk.to_str(), V, (EOS,), fill_process=True)
    masks = mirrored.masks
    assert masks is not None and masks.wait_ready()
    so = StructuredOutput("json_schema", json.dumps(SCHEMAS["person"]))
    served = []
    for name in ("Alan Turing", "Ada Lovelac"):
        walk = tok.encode(json.dumps({"name": name, "age": 36, "email": "a@b.c"}), add_special_tokens=False)
        m, ref = mirrored.matcher(so), inline.matcher(so)
        before = masks.cached_rows
        for t in walk:
            mirrored.flush()
            got = mirrored.table.host[mirrored.table.fill([m])[0]]
            want = inline.table.host[inline.table.fill([ref])[0]]
            assert (got == want).all()
            assert m.accept(t) and ref.accept(t)
        served.append(masks.cached_rows - before)
        del m
    assert served[0] == 0 and served[1] > 0, served
    mirrored.close()


def test_the_middle_items_of_a_long_list_take_their_masks_from_the_cache():
    """A list of up to 20 objects written item by item, the same item each time: the middle items share one class,
    so from the third item on their masks are the second item's, from the cache, each equal to the matcher's own
    inline fill."""
    tok = load_tokenizer()
    inline = GrammarCompiler(tok.tk.to_str(), V, (EOS,))
    mirrored = GrammarCompiler(tok.tk.to_str(), V, (EOS,), fill_process=True)
    masks = mirrored.masks
    assert masks is not None and masks.wait_ready()
    schema = {"type": "array", "minItems": 1, "maxItems": 20, "items": {
        "type": "object", "properties": {"k": {"type": "string", "maxLength": 5}}, "required": ["k"],
        "additionalProperties": False}}
    so = StructuredOutput("json_schema", json.dumps(schema))
    item = tok.encode(', {"k": "abc"}', add_special_tokens=False)
    walk = [*tok.encode('[{"k": "abc"}', add_special_tokens=False), *item * 6]
    m, ref = mirrored.matcher(so), inline.matcher(so)
    cached = []
    for t in walk:
        mirrored.flush()
        before = masks.cached_rows
        got = mirrored.table.host[mirrored.table.fill([m])[0]]
        want = inline.table.host[inline.table.fill([ref])[0]]
        assert (got == want).all()
        cached.append(masks.cached_rows - before)
        assert m.accept(t) and ref.accept(t)
    # the masks before each of the six ", {...}" spans' tokens: the second item's are all new; the third's too,
    # but only where the second ended (the first item's end is a place of its own); from the fourth on, all kept
    per_item = [sum(cached[len(walk) - len(item) * (6 - i):][: len(item)]) for i in range(6)]
    assert per_item == [0, len(item) - 1, *[len(item)] * 4], (per_item, len(item))
    mirrored.close()

"""Plain data across the pipe: exact round trips, and a clear refusal of everything else."""

from __future__ import annotations

import collections
import math
import os
import re

import pytest
from mtp.eval.wire import (
    MAX_DEPTH,
    NOT_PLAIN,
    Match,
    NotPlainData,
    ProtocolError,
    decode,
    encode,
    messages,
    recv,
    send,
)


def _same(a, b) -> bool:
    """Equal, and of exactly the same types all the way down (floats bit for bit)."""
    if type(a) is not type(b):
        return False
    if type(a) is float:
        return a.hex() == b.hex() if not math.isnan(a) else math.isnan(b)
    if type(a) is complex:
        return _same(a.real, b.real) and _same(a.imag, b.imag)
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if type(a) is dict:
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return a == b


VALUES = [
    None, True, False, 0, -1, 10**5000, -(2**200), 0.1, -0.0, float("inf"), float("-inf"),
    float("nan"), 5e-324, complex(1.5, -0.0), "", "héllo\n\x00", "\ud800 lone surrogate",
    b"", b"\x00\xffbytes", [], (), set(), frozenset(), {},
    [1, [2, (3, {"a": [4.5, None]})]], (1,), {3, "x", (1, 2), frozenset({1})},
    {(1, 2): "tuple key", 1: "int key", None: b"none key", 1.5: [True]},
    {"order": 1, "kept": 2, "as": 3, "given": 4},
]


@pytest.mark.parametrize("value", VALUES, ids=lambda v: type(v).__name__)
def test_plain_values_round_trip_exactly(value):
    assert _same(decode(encode(value)), value)


def test_a_round_trip_through_a_pipe():
    r, w = os.pipe()
    try:
        send(w, {"value": VALUES})
        send(w, {"value": None})
        os.close(w)
        w = -1
        assert _same(recv(r)["value"], VALUES)
        assert recv(r) == {"value": None}
        assert recv(r) is None  # a clean end of the stream
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


class _LyingInt(int):
    def __eq__(self, other):
        return True

    __hash__ = int.__hash__


class _Anything:
    def __eq__(self, other):
        return True


@pytest.mark.parametrize("value, named", [
    (_LyingInt(3), "_LyingInt"),
    (_Anything(), "_Anything"),
    (type("Tally", (collections.Counter,), {"__eq__": lambda s, o: True})("a"), "Tally"),
    (collections.defaultdict(lambda: 0), "default factory is not a builtin type"),
    (collections.defaultdict(type("Int", (int,), {})), "default factory is not a builtin type"),
    (re.compile("a"), "re.Pattern"),
    (type("S", (str,), {})("s"), "S"),
    ([1, {"k": (2, _Anything())}], "_Anything"),  # found however deep it sits
    (len, "builtin_function_or_method"),
    ((x for x in ()), "generator"),
    (iter([1]), "list_iterator"),
    (range(3), "range"),
    (bytearray(b"x"), "bytearray"),
])
def test_anything_else_is_refused_with_its_type_named(value, named):
    with pytest.raises(NotPlainData, match=named) as info:
        encode(value)
    assert str(info.value).endswith(NOT_PLAIN)


MATCHES = [
    re.search(r"(?P<word>a+)(b)?(c)", "xxaac"),
    re.match(r"(\d+)-(\d+)?", "12-"),
    re.fullmatch(rb"(?i)(AB)+", b"abAB"),
    re.search(r"^x$", "a\nx\nb", re.MULTILINE),
    re.compile(r"(a)|(b)").search("zzb", 1, 3),
]


@pytest.mark.parametrize("match", MATCHES, ids=lambda m: m.re.pattern[:12])
def test_a_match_crosses_with_what_re_match_reads(match):
    """Independent reference: the real re.Match, attribute by attribute."""
    got = decode(encode(match))
    assert type(got) is Match and bool(got)
    n = match.re.groups
    for attr in ("string", "pos", "endpos", "lastindex", "lastgroup", "regs"):
        assert getattr(got, attr) == getattr(match, attr), attr
    assert got.re == match.re
    for g in range(n + 1):
        assert (got.group(g), got[g], got.span(g), got.start(g), got.end(g)) == \
            (match.group(g), match[g], match.span(g), match.start(g), match.end(g))
    for name in match.re.groupindex:
        assert got.group(name) == match.group(name) and got.span(name) == match.span(name)
    assert got.group(0, *range(1, n + 1)) == match.group(0, *range(1, n + 1))
    assert got.groups() == match.groups() and got.groups("-") == match.groups("-")
    assert got.groupdict() == match.groupdict() and got.groupdict(0) == match.groupdict(0)
    assert repr(got) == repr(match)
    with pytest.raises(IndexError):
        got.group(n + 1)
    with pytest.raises(IndexError):
        match.group(n + 1)


def test_standard_library_values_cross_with_their_semantics():
    tally = decode(encode(collections.Counter("abracadabra")))
    assert type(tally) is collections.Counter and tally == collections.Counter("abracadabra")
    assert tally == {"a": 5, "b": 2, "r": 2, "c": 1, "d": 1} and tally["z"] == 0
    assert tally.most_common(1) == [("a", 5)]
    ordered = decode(encode(collections.OrderedDict([(2, "b"), (1, "a")])))
    assert type(ordered) is collections.OrderedDict and list(ordered) == [2, 1]
    assert ordered != collections.OrderedDict([(1, "a"), (2, "b")])  # order counts, as sent
    for factory in (list, int, None):
        d = decode(encode(collections.defaultdict(factory, {1: [2]})))
        assert type(d) is collections.defaultdict and d.default_factory is factory
    assert decode(encode(collections.defaultdict(list)))["new"] == []
    q = decode(encode(collections.deque([1, 2, 3], maxlen=4)))
    assert type(q) is collections.deque and list(q) == [1, 2, 3] and q.maxlen == 4
    nested = {"counts": [collections.Counter("ab")], "m": MATCHES[0]}
    assert decode(encode(nested))["counts"][0] == {"a": 1, "b": 1}


def test_references_cross_only_where_both_ends_allow_them():
    class Node:
        pass

    objects: list = []

    def ref(obj):
        if type(obj) is Node:
            objects.append(obj)
            return len(objects) - 1
        return None

    a, b = Node(), Node()
    data = encode({"tree": [a, (b, 3)]}, ref)
    with pytest.raises(NotPlainData, match="Node"):
        encode({"tree": [a]})
    with pytest.raises(ProtocolError, match="reference"):
        decode(data)
    assert decode(data, lambda n: f"handle {n}") == {"tree": ["handle 0", ("handle 1", 3)]}
    with pytest.raises(ProtocolError):  # a number the receiver never gave out
        decode(data, {0: "only"}.__getitem__)


def test_nesting_is_bounded():
    deep: list = []
    for _ in range(MAX_DEPTH + 5):
        deep = [deep]
    with pytest.raises(NotPlainData, match="nested deeper"):
        encode(deep)


@pytest.mark.parametrize("data", [
    b"", b"Q", b"i\x00\x00\x00\x05\x01", b"f\x00", b"s\x00\x00\x00\x02\xff\xfe",
    b"S\x00\x00\x00\x01l\x00\x00\x00\x00",  # a set of a list: unhashable
    b"d\x00\x00\x00\x02l\x00\x00\x00\x00N",  # a dict keyed by a list
    b"d\x00\x00\x00\x01N",  # a key without its value
    b"D\x00\x00\x00\x01s\x00\x00\x00\x04eval",  # a default factory that is not a type
    b"M\x00\x00\x00\x01N",  # a match of one field
    b"r\x00\x00\x00\x01\x00",  # a reference, with no way to resolve it
    b"l\xff\xff\xff\xff", b"NN", b"l\x00\x00\x00\x01" * (MAX_DEPTH + 1) + b"N",
])
def test_malformed_encodings_are_refused(data):
    with pytest.raises(ProtocolError):
        decode(data)


def test_any_bytes_decode_or_are_refused_cleanly():
    """Whatever a completion writes, decoding raises ProtocolError or gives plain data."""
    import random

    rng = random.Random(0)
    good = encode([VALUES, collections.Counter("ab"), collections.deque([1]), MATCHES,
                   collections.defaultdict(list, {1: 2}), collections.OrderedDict(a=1)])
    for _ in range(3000):
        data = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        cut = bytes(data[: rng.randint(0, len(data))])
        for blob in (bytes(data), cut):
            try:
                decode(blob)
            except ProtocolError:
                pass


def test_messages_reads_up_to_the_first_malformed_one():
    import struct

    one, two = encode({"a": 1}), encode({"b": [2]})
    stream = b"".join(struct.pack(">I", len(m)) + m for m in (one, two))
    assert messages(stream) == [{"a": 1}, {"b": [2]}]
    assert messages(stream + b"\x00\x00\x00\x09{}") == [{"a": 1}, {"b": [2]}]
    assert messages(b"PASS 0\n" + stream) == []


@pytest.mark.parametrize("raw, why", [
    (b"\x00\x00", "header"),
    (b"\x00\x00\x00\x09N", "inside a message"),
    (b"\xff" * 4, "limit"),
    (b"\x00\x00\x00\x01N", "must be a dict"),
    (b"PASS 0\n{\"status\": \"passed\"}\n", "limit"),  # a forged verdict line is no message
])
def test_malformed_messages_are_refused(raw, why):
    r, w = os.pipe()
    try:
        os.write(w, raw)
        os.close(w)
        w = -1
        with pytest.raises(ProtocolError, match=why):
            recv(r)
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)

"""Plain data across the pipe: exact round trips, and a clear refusal of everything else."""

from __future__ import annotations

import collections
import math
import os

import pytest
from mtp.eval.wire import (
    MAX_DEPTH,
    NOT_PLAIN,
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
    (collections.Counter("aab"), "collections.Counter"),
    (collections.OrderedDict(a=1), "collections.OrderedDict"),
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


def test_nesting_is_bounded():
    deep: list = []
    for _ in range(MAX_DEPTH + 5):
        deep = [deep]
    with pytest.raises(NotPlainData, match="nested deeper"):
        encode(deep)


@pytest.mark.parametrize("data", [
    b"", b"Q", b"i\x00\x00\x00\x05\x01", b"f\x00", b"s\x00\x00\x00\x02\xff\xfe",
    b"S\x00\x00\x00\x01l\x00\x00\x00\x00",  # a set of a list: unhashable
    b"d\x00\x00\x00\x01l\x00\x00\x00\x00N",  # a dict keyed by a list
    b"l\xff\xff\xff\xff", b"NN", b"l\x00\x00\x00\x01" * (MAX_DEPTH + 1) + b"N",
])
def test_malformed_encodings_are_refused(data):
    with pytest.raises(ProtocolError):
        decode(data)


def test_any_bytes_decode_or_are_refused_cleanly():
    """Whatever a completion writes, decoding raises ProtocolError or gives plain data."""
    import random

    rng = random.Random(0)
    good = encode(VALUES)
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

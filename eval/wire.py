"""Plain data across a pipe: the only way values travel between a completion and its tests.

A completion runs in one process and its tests in another (:mod:`mtp.eval.sandbox`); a call
crosses as a message, and so does its result. Only plain data is encoded: ``None``, ``bool``,
``int``, ``float``, ``complex``, ``str``, ``bytes``, and ``list``, ``tuple``, ``dict``, ``set``
and ``frozenset`` of plain data. The type test is exact (``type(v) is int``, not
``isinstance``), so a subclass of a builtin type, whatever its ``__eq__`` says, is refused with
its type named. Decoding builds fresh builtin values, so the receiving side holds nothing the
sender defined: a value that lies about equality cannot cross.

The encoding is a small tagged binary format, exact for every value: ints of any size as signed
bytes, floats as IEEE doubles (``-0.0``, ``inf`` and ``nan`` survive), strings as UTF-8 (lone
surrogates included). Every decoding error, whatever the bytes, is a :class:`ProtocolError`.
Messages are dicts, length-prefixed and capped in size.

This module uses only builtin modules, which cost nothing to import: its source is also part
of the programs that start in the sandbox for every sample, where ``mtp`` is not importable
(``json`` alone would add 18 ms to each of those starts).
"""

import os
import struct

MAX_MESSAGE_BYTES = 64 << 20
"""The largest message either side accepts (a bigger reply fails the sample)."""
MAX_DEPTH = 200
"""The deepest nesting of containers that is encoded or decoded."""
NOT_PLAIN = "(not plain data)"
"""Ends the message of every refusal to encode a type."""
TOO_LARGE = "(too large to cross)"
"""Ends the message of a refusal to send a message over `MAX_MESSAGE_BYTES`."""


class NotPlainData(TypeError):
    """A value that may not cross: the message names its type."""


class ProtocolError(Exception):
    """Bytes that are not a message: malformed, too large, or cut short."""


_SIZE = struct.Struct(">I")
_DOUBLE = struct.Struct(">d")
_COMPLEX = struct.Struct(">dd")
_CONTAINERS = {list: b"l", tuple: b"t", set: b"S", frozenset: b"z"}
_BUILD = {ord("l"): list, ord("t"): tuple, ord("S"): set, ord("z"): frozenset}


def encode(value):
    """The bytes of a plain value.

    Raises:
        NotPlainData: For any other type (named in the message), however deep it sits, or
            nesting deeper than `MAX_DEPTH`.
    """
    out = bytearray()
    _encode(value, out, 0)
    return bytes(out)


def _encode(value, out, depth):
    kind = type(value)
    if value is None:
        out += b"N"
    elif kind is bool:
        out += b"T" if value else b"F"
    elif kind is int:
        data = value.to_bytes((value.bit_length() + 8) // 8, "big", signed=True)
        out += b"i" + _SIZE.pack(len(data)) + data
    elif kind is float:
        out += b"f" + _DOUBLE.pack(value)
    elif kind is complex:
        out += b"c" + _COMPLEX.pack(value.real, value.imag)
    elif kind is str or kind is bytes:
        data = value.encode("utf-8", "surrogatepass") if kind is str else value
        out += (b"s" if kind is str else b"b") + _SIZE.pack(len(data)) + data
    elif depth >= MAX_DEPTH:
        raise NotPlainData(f"containers nested deeper than {MAX_DEPTH} {NOT_PLAIN}")
    elif kind is dict:
        out += b"d" + _SIZE.pack(len(value))
        for k, v in value.items():
            _encode(k, out, depth + 1)
            _encode(v, out, depth + 1)
    elif kind in _CONTAINERS:
        out += _CONTAINERS[kind] + _SIZE.pack(len(value))
        for v in value:
            _encode(v, out, depth + 1)
    else:
        raise NotPlainData(f"a {_type_name(kind)} {NOT_PLAIN}")


def decode(data):
    """The value of `encode`'s bytes, built from fresh builtin objects.

    Raises:
        ProtocolError: If `data` is not exactly one encoded value.
    """
    try:
        value, end = _decode(memoryview(data), 0, 0)
    except ProtocolError:
        raise
    except (IndexError, TypeError, ValueError, UnicodeDecodeError, struct.error) as e:
        raise ProtocolError(f"malformed value: {type(e).__name__}: {e}") from None
    if end != len(data):
        raise ProtocolError(f"{len(data) - end} bytes after the value")
    return value


def _take(view, at, size):
    if size > len(view) - at:
        raise ProtocolError("the value ends early")
    return view[at:at + size], at + size


def _decode(view, at, depth):
    if at >= len(view):
        raise ProtocolError("the value ends early")
    tag = view[at]
    at += 1
    if tag == 78:  # N
        return None, at
    if tag == 84 or tag == 70:  # T, F
        return tag == 84, at
    if tag == 102:  # f
        raw, at = _take(view, at, 8)
        return _DOUBLE.unpack(raw)[0], at
    if tag == 99:  # c
        raw, at = _take(view, at, 16)
        return complex(*_COMPLEX.unpack(raw)), at
    raw, at = _take(view, at, 4)
    (size,) = _SIZE.unpack(raw)
    if tag == 105:  # i
        raw, at = _take(view, at, size)
        return int.from_bytes(raw, "big", signed=True), at
    if tag == 115 or tag == 98:  # s, b
        raw, at = _take(view, at, size)
        return (bytes(raw).decode("utf-8", "surrogatepass") if tag == 115 else bytes(raw)), at
    if depth >= MAX_DEPTH:
        raise ProtocolError(f"containers nested deeper than {MAX_DEPTH}")
    if size > len(view) - at:  # each item takes a byte at least
        raise ProtocolError("the value ends early")
    if tag == 100:  # d
        out = {}
        for _ in range(size):
            k, at = _decode(view, at, depth + 1)
            out[k], at = _decode(view, at, depth + 1)
        return out, at
    build = _BUILD.get(tag)
    if build is None:
        raise ProtocolError(f"unknown tag {tag}")
    items = []
    for _ in range(size):
        item, at = _decode(view, at, depth + 1)
        items.append(item)
    return build(items), at


def send(fd, message):
    """Write one message (a dict of plain data) to a file descriptor.

    Raises:
        NotPlainData: If the message holds anything else, or is over `MAX_MESSAGE_BYTES`.
    """
    body = encode(message)
    if len(body) > MAX_MESSAGE_BYTES:
        raise NotPlainData(f"a message of {len(body)} bytes, over {MAX_MESSAGE_BYTES} "
                           f"{TOO_LARGE}")
    _write_all(fd, _SIZE.pack(len(body)) + body)


def recv(fd):
    """Read one message; None at a clean end of the stream.

    Raises:
        ProtocolError: On a cut-short, oversized or malformed message, or one that is not a
            dict.
    """
    head = _read_exactly(fd, 4)
    if not head:
        return None
    if len(head) < 4:
        raise ProtocolError("the stream ended inside a message header")
    (size,) = _SIZE.unpack(head)
    if size > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"a message of {size} bytes (the limit is {MAX_MESSAGE_BYTES})")
    body = _read_exactly(fd, size)
    if len(body) < size:
        raise ProtocolError("the stream ended inside a message")
    message = decode(body)
    if type(message) is not dict:
        raise ProtocolError("a message must be a dict")
    return message


def messages(data):
    """The messages at the start of a byte string, up to the first that is malformed."""
    out, at = [], 0
    while len(data) - at >= 4:
        (size,) = _SIZE.unpack_from(data, at)
        if size > len(data) - at - 4:
            break
        try:
            message = decode(data[at + 4:at + 4 + size])
        except ProtocolError:
            break
        if type(message) is not dict:
            break
        out.append(message)
        at += 4 + size
    return out


def _type_name(kind):
    module = getattr(kind, "__module__", "")
    name = getattr(kind, "__qualname__", getattr(kind, "__name__", "?"))
    return name if module in ("builtins", "", None) else f"{module}.{name}"


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_exactly(fd, size):
    chunks, got = [], 0
    while got < size:
        chunk = os.read(fd, min(size - got, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)

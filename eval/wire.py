"""Plain data across a pipe: the only way values travel between a completion and its tests.

A completion runs in one process and its tests in another (:mod:`mtp.eval.sandbox`); a call
crosses as a message, and so does its result. Only plain data is encoded: ``None``, ``bool``,
``int``, ``float``, ``complex``, ``str``, ``bytes``, and ``list``, ``tuple``, ``dict``, ``set``
and ``frozenset`` of plain data; and, as their contents, the standard library's
``collections.Counter``, ``OrderedDict``, ``defaultdict`` (of a builtin default factory) and
``deque``, and ``re.Match`` results. The type test is exact (``type(v) is int``, not
``isinstance``), so a subclass of any of these, whatever its ``__eq__`` says, is refused with
its type named. Decoding builds fresh values of the receiving side's own classes (a
:class:`Match` record for a match, with ``re.Match``'s read-only API), so the receiving side
holds nothing the sender defined: a value that lies about equality cannot cross.

**References.** An object that is not data (an instance of a class the completion defines,
which the tests build and link, say) may cross as a reference where both ends allow it: the
sender's `ref` hook gives it a number, and the receiver's `resolve` hook gives back its own
object for that number (:mod:`mtp.eval.inside`). Without the hooks a reference is refused.

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
import sys

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
#: The default factories a ``defaultdict`` may carry across, by name.
_FACTORIES = ("int", "float", "complex", "str", "bytes", "bool", "list", "tuple", "dict", "set",
              "frozenset")


class Match:
    """An ``re.Match`` result as data: what ``re.Match`` reads out, without the matching.

    Built by `decode` on the receiving side. ``re`` is the pattern compiled there; equality is
    identity, as for ``re.Match``.
    """

    __slots__ = ("string", "pos", "endpos", "regs", "lastindex", "lastgroup", "_pattern",
                 "_flags", "_names")

    def __init__(self, string, pattern, flags, pos, endpos, regs, names, lastindex, lastgroup):
        self.string, self.pos, self.endpos, self.regs = string, pos, endpos, regs
        self.lastindex, self.lastgroup = lastindex, lastgroup
        self._pattern, self._flags, self._names = pattern, flags, names

    @property
    def re(self):
        import re

        return re.compile(self._pattern, self._flags)

    def _index(self, group):
        if type(group) is str and group in self._names:
            return self._names[group]
        if type(group) is int and 0 <= group < len(self.regs):
            return group
        raise IndexError("no such group")

    def span(self, group=0):
        return self.regs[self._index(group)]

    def start(self, group=0):
        return self.span(group)[0]

    def end(self, group=0):
        return self.span(group)[1]

    def _get(self, group, default=None):
        start, end = self.span(group)
        return default if start < 0 else self.string[start:end]

    def group(self, *groups):
        if len(groups) <= 1:
            return self._get(groups[0] if groups else 0)
        return tuple(self._get(g) for g in groups)

    def __getitem__(self, group):
        return self._get(group)

    def groups(self, default=None):
        return tuple(self._get(i, default) for i in range(1, len(self.regs)))

    def groupdict(self, default=None):
        return {name: self._get(name, default) for name in self._names}

    def __bool__(self):
        return True

    def __repr__(self):
        return f"<re.Match object; span={self.span()!r}, match={self.group()!r}>"


def _module_type(module, name):
    """A class of a standard-library module, None where the module is not loaded (so no value
    of the class can exist here)."""
    return getattr(sys.modules.get(module), name, None)


def encode(value, ref=None):
    """The bytes of a plain value.

    Args:
        value: The value.
        ref: Gives a reference number to an object that is not data, or None to refuse it.

    Raises:
        NotPlainData: For any other type (named in the message), however deep it sits, or
            nesting deeper than `MAX_DEPTH`.
    """
    out = bytearray()
    _encode(value, out, 0, ref)
    return bytes(out)


def _encode_items(tag, items, out, depth, ref):
    out += tag + _SIZE.pack(len(items))
    for v in items:
        _encode(v, out, depth + 1, ref)


def _int_bytes(value):
    data = value.to_bytes((value.bit_length() + 8) // 8, "big", signed=True)
    return _SIZE.pack(len(data)) + data


def _encode(value, out, depth, ref):
    kind = type(value)
    if value is None:
        out += b"N"
    elif kind is bool:
        out += b"T" if value else b"F"
    elif kind is int:
        out += b"i" + _int_bytes(value)
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
        _encode_items(b"d", [x for kv in dict.items(value) for x in kv], out, depth, ref)
    elif kind in _CONTAINERS:
        _encode_items(_CONTAINERS[kind], list(value), out, depth, ref)
    elif kind is _module_type("collections", "Counter"):
        _encode_items(b"C", [x for kv in dict.items(value) for x in kv], out, depth, ref)
    elif kind is _module_type("collections", "OrderedDict"):
        _encode_items(b"O", [x for kv in dict.items(value) for x in kv], out, depth, ref)
    elif kind is _module_type("collections", "defaultdict"):
        factory = value.default_factory
        name = getattr(factory, "__name__", None)
        if factory is not None and (name not in _FACTORIES or getattr(
                sys.modules["builtins"], name, None) is not factory):
            raise NotPlainData(f"a collections.defaultdict whose default factory is not a "
                               f"builtin type {NOT_PLAIN}")
        _encode_items(b"D", [name, *(x for kv in dict.items(value) for x in kv)], out, depth,
                      ref)
    elif kind is _module_type("collections", "deque"):
        _encode_items(b"Q", [value.maxlen, *value], out, depth, ref)
    elif kind is _module_type("re", "Match"):
        pattern = value.re
        _encode_items(b"M", [value.string, pattern.pattern, pattern.flags, value.pos,
                             value.endpos, value.regs, dict(pattern.groupindex),
                             value.lastindex, value.lastgroup], out, depth, ref)
    else:
        number = ref(value) if ref is not None else None
        if type(number) is not int:
            raise NotPlainData(f"a {_type_name(kind)} {NOT_PLAIN}")
        out += b"r" + _int_bytes(number)


def decode(data, resolve=None):
    """The value of `encode`'s bytes, built from fresh objects of this side's own classes.

    Args:
        data: The bytes.
        resolve: Gives this side's object for a reference number; None to refuse references.

    Raises:
        ProtocolError: If `data` is not exactly one encoded value.
    """
    try:
        value, end = _decode(memoryview(data), 0, 0, resolve)
    except ProtocolError:
        raise
    except (IndexError, KeyError, TypeError, ValueError, UnicodeDecodeError,
            struct.error) as e:
        raise ProtocolError(f"malformed value: {type(e).__name__}: {e}") from None
    if end != len(data):
        raise ProtocolError(f"{len(data) - end} bytes after the value")
    return value


def _take(view, at, size):
    if size > len(view) - at:
        raise ProtocolError("the value ends early")
    return view[at:at + size], at + size


def _pairs(items):
    if len(items) % 2:
        raise ProtocolError("a mapping with a key and no value")
    return zip(items[::2], items[1::2])


def _mapping(out, items):
    for k, v in _pairs(items):
        out[k] = v
    return out


def _of(value, *kinds):
    if not any(type(value) is k for k in kinds):
        raise ProtocolError(f"a match field of type {type(value).__name__}")
    return value


def _match(items):
    """A :class:`Match` from its nine fields, each checked."""
    string, pattern, flags, pos, endpos, regs, names, lastindex, lastgroup = items
    _of(string, str, bytes), _of(pattern, str, bytes), _of(flags, int), _of(pos, int)
    _of(endpos, int), _of(regs, tuple), _of(names, dict), _of(lastindex, int, type(None))
    _of(lastgroup, str, type(None))
    for span in regs:
        _of(span, tuple)
        if len(span) != 2:
            raise ProtocolError("a match span that is not (start, end)")
        _of(span[0], int), _of(span[1], int)
    for name, index in names.items():
        _of(name, str), _of(index, int)
    if not regs:
        raise ProtocolError("a match without its whole-match span")
    return Match(string, pattern, flags, pos, endpos, regs, names, lastindex, lastgroup)


def _build(tag, items):
    if tag == 100:  # d
        return _mapping({}, items)
    if tag == 67:  # C
        import collections

        return _mapping(collections.Counter(), items)
    if tag == 79:  # O
        import collections

        return _mapping(collections.OrderedDict(), items)
    if tag == 68:  # D
        import collections

        name = items[0] if items else ""
        if name is not None and name not in _FACTORIES:
            raise ProtocolError(f"a defaultdict factory {name!r}")
        factory = None if name is None else getattr(sys.modules["builtins"], name)
        return _mapping(collections.defaultdict(factory), items[1:])
    if tag == 81:  # Q
        import collections

        if not items or not (items[0] is None or type(items[0]) is int):
            raise ProtocolError("a deque without its maxlen")
        return collections.deque(items[1:], items[0])
    if tag == 77:  # M
        if len(items) != 9:
            raise ProtocolError(f"a match of {len(items)} fields")
        return _match(items)
    build = _BUILD.get(tag)
    if build is None:
        raise ProtocolError(f"unknown tag {tag}")
    return build(items)


def _decode(view, at, depth, resolve):
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
    if tag == 105 or tag == 114:  # i, r
        raw, at = _take(view, at, size)
        number = int.from_bytes(raw, "big", signed=True)
        if tag == 105:
            return number, at
        if resolve is None:
            raise ProtocolError("a reference where none may cross")
        return resolve(number), at
    if tag == 115 or tag == 98:  # s, b
        raw, at = _take(view, at, size)
        return (bytes(raw).decode("utf-8", "surrogatepass") if tag == 115 else bytes(raw)), at
    if depth >= MAX_DEPTH:
        raise ProtocolError(f"containers nested deeper than {MAX_DEPTH}")
    if size > len(view) - at:  # each item takes a byte at least
        raise ProtocolError("the value ends early")
    items = []
    for _ in range(size):
        item, at = _decode(view, at, depth + 1, resolve)
        items.append(item)
    return _build(tag, items), at


def send(fd, message, ref=None):
    """Write one message (a dict of plain data) to a file descriptor; `ref` as in `encode`.

    Raises:
        NotPlainData: If the message holds anything else, or is over `MAX_MESSAGE_BYTES`.
    """
    body = encode(message, ref)
    if len(body) > MAX_MESSAGE_BYTES:
        raise NotPlainData(f"a message of {len(body)} bytes, over {MAX_MESSAGE_BYTES} "
                           f"{TOO_LARGE}")
    _write_all(fd, _SIZE.pack(len(body)) + body)


def recv(fd, resolve=None):
    """Read one message; None at a clean end of the stream; `resolve` as in `decode`.

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
    message = decode(body, resolve)
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

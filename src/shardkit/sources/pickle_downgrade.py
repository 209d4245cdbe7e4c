"""Rewrite a protocol 3-5 pickle as the protocol-2 opcodes torch's weights-only unpickler reads.

``torch._weights_only_unpickler`` (behind ``torch.load(weights_only=True)``)
understands protocol-2 opcodes only, while ``pickle.dump`` writes protocol 4
(``FRAME``, ``MEMOIZE``, ``SHORT_BINUNICODE``, ``STACK_GLOBAL``). This module
translates those opcodes one for one, **syntactically**: it walks the stream
with :func:`pickletools.genops` (a parser; nothing is imported, constructed
or called) and emits equivalent protocol-2 bytes. Every decision about what
may be built stays with torch's unpickler. Opcodes with no protocol-2
equivalent that DCP metadata never needs (sets, bytes, ``NEWOBJ_EX``, out of
band buffers) are refused with :class:`~shardkit.errors.MetadataError`.
It streams (one opcode at a time into the output; a few recent ones kept for
``STACK_GLOBAL``) and stops past ``knobs.DCP_MAX_METADATA_OPS`` opcodes: a
file of one-byte opcodes cost 300x its size when every opcode was kept.

Example::

    data2 = downgrade_pickle(open(".metadata", "rb").read(), source=".metadata")
"""

from __future__ import annotations

import pickle
import pickletools
import struct
from collections import deque

from shardkit import knobs
from shardkit.errors import MetadataError

__all__ = ["downgrade_pickle"]

_PASS = {  # protocol-2 opcodes torch's weights-only unpickler implements, copied unchanged
    "MARK", "STOP", "NONE", "NEWTRUE", "NEWFALSE", "BININT", "BININT1", "BININT2", "LONG1",
    "BINFLOAT", "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_LIST", "APPEND",
    "APPENDS", "EMPTY_DICT", "SETITEM", "SETITEMS", "NEWOBJ", "REDUCE", "BUILD", "GLOBAL",
}
_STRINGS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8"}
_PUTS = {"BINPUT", "LONG_BINPUT", "MEMOIZE"}
_GETS = {"BINGET", "LONG_BINGET"}
# How many emitted ops STACK_GLOBAL may reach back over: pickle.dump writes
# "string, MEMOIZE, string, MEMOIZE, STACK_GLOBAL" (or two gets), so 4 would do.
_WINDOW = 16


def _unicode(value: str) -> bytes:
    raw = value.encode("utf-8", "surrogatepass")
    return pickle.BINUNICODE + struct.pack("<I", len(raw)) + raw


def _put(index: int) -> bytes:
    return pickle.BINPUT + bytes([index]) if index < 256 else pickle.LONG_BINPUT + struct.pack("<I", index)


def _get(index: int) -> bytes:
    return pickle.BINGET + bytes([index]) if index < 256 else pickle.LONG_BINGET + struct.pack("<I", index)


class _Translator:
    """One pass over the opcodes, emitting as it goes.

    Memory: the output bytes, the strings held in the memo, and the last
    ``_WINDOW`` emitted pieces as ``(start in out, literal, memo index)`` (what
    STACK_GLOBAL takes back); never a list of the input's opcodes. A run of
    opcodes copied unchanged is one piece: STACK_GLOBAL never takes one back.
    """

    def __init__(self, source: str, data: bytes):
        self.source, self.data = source, data
        self.out = bytearray(pickle.PROTO + bytes([2]))
        self.recent: deque[tuple[int, str | None, int | None]] = deque(maxlen=_WINDOW)
        self.memo_literals: dict[int, str] = {}   # memo index -> string it holds (when a string)
        self.dropped: set[int] = set()            # memo indices whose put was folded into a GLOBAL
        self.memo_size = 0

    def run(self) -> bytes:
        limit, count, run_start = knobs.DCP_MAX_METADATA_OPS, 0, None
        for op, arg, pos in pickletools.genops(self.data):
            count += 1
            if count > limit:
                raise MetadataError(f"{self.source} holds more than {limit} pickle opcodes (knobs.DCP_MAX_METADATA_OPS); "
                                    f"a DCP .metadata has about one per 2 bytes. The file is hostile or corrupt, or "
                                    f"raise shardkit.knobs.DCP_MAX_METADATA_OPS if it is a real, very large checkpoint")
            if op.name in _PASS:  # copied unchanged: a run of them is copied as one slice
                run_start = pos if run_start is None else run_start
                continue
            if run_start is not None:
                self.emit(memoryview(self.data)[run_start:pos])
                run_start = None
            self.step(op.name, arg)
        if run_start is not None:
            self.emit(memoryview(self.data)[run_start:])
        return bytes(self.out)

    def emit(self, raw, literal: str | None = None, memo_index: int | None = None) -> None:
        self.recent.append((len(self.out), literal, memo_index))
        self.out += raw

    def step(self, name: str, arg) -> None:
        if name in ("PROTO", "FRAME"):
            return
        if name in _STRINGS:
            self.emit(_unicode(arg), literal=arg)
        elif name in _PUTS:
            self.put(self.memo_size if name == "MEMOIZE" else arg)
        elif name in _GETS:
            self.get(arg)
        elif name == "STACK_GLOBAL":
            self.stack_global()
        else:
            raise MetadataError(f"{self.source}: pickle opcode {name} is not allowed in DCP metadata "
                                f"(only protocol-2 data opcodes are); the file is not DCP metadata")

    def put(self, index: int) -> None:
        top = self.recent[-1][1] if self.recent else None
        if top is not None:
            self.memo_literals[index] = top
        self.memo_size = max(self.memo_size, index + 1)
        self.emit(_put(index), memo_index=index)

    def get(self, index: int) -> None:
        literal = self.memo_literals.get(index)
        if index not in self.dropped:
            self.emit(_get(index), literal=literal)
        elif literal is None:
            raise MetadataError(f"{self.source}: a memo entry that named a global is read back as a value; "
                                f"the file is not DCP metadata")
        else:  # its put was folded away; strings are values, re-push the literal
            self.emit(_unicode(literal), literal=literal)

    def stack_global(self) -> None:
        name, module = self.pop_literal(), self.pop_literal()
        self.emit(pickle.GLOBAL + f"{module}\n{name}\n".encode("utf-8"))

    def pop_literal(self) -> str:
        while self.recent and self.recent[-1][2] is not None:
            start, _, index = self.recent.pop()
            self.dropped.add(index)
            del self.out[start:]
        if not self.recent or self.recent[-1][1] is None:
            raise MetadataError(f"{self.source}: a STACK_GLOBAL whose module or name is not a plain "
                                f"string; the file is not DCP metadata")
        start, literal, _ = self.recent.pop()
        del self.out[start:]
        return literal


def downgrade_pickle(data: bytes, *, source: str = "pickle") -> bytes:
    """``data`` (a pickle of any protocol) as equivalent protocol-2 opcodes, or :class:`MetadataError`.

    Parses only; builds nothing. The result still holds every global the
    input named: the caller's unpickler decides which it admits. Streams:
    memory is about the output's size, and at most ``knobs.DCP_MAX_METADATA_OPS``
    opcodes are read.
    """
    try:
        return _Translator(source, data).run()
    except MetadataError:
        raise
    except (ValueError, struct.error, UnicodeError) as e:
        raise MetadataError(f"{source} is not a readable pickle ({e}); the file is corrupt or cut short") from e

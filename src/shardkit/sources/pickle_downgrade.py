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

Example::

    data2 = downgrade_pickle(open(".metadata", "rb").read(), source=".metadata")
"""

from __future__ import annotations

import pickle
import pickletools
import struct
from dataclasses import dataclass

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


@dataclass
class _Op:
    data: bytes
    literal: str | None = None      # the string this op pushes, when it pushes a known one
    memo_index: int | None = None   # for an emitted put: the original memo index


def _unicode(value: str) -> bytes:
    raw = value.encode("utf-8", "surrogatepass")
    return pickle.BINUNICODE + struct.pack("<I", len(raw)) + raw


def _put(index: int) -> bytes:
    return pickle.BINPUT + bytes([index]) if index < 256 else pickle.LONG_BINPUT + struct.pack("<I", index)


def _get(index: int) -> bytes:
    return pickle.BINGET + bytes([index]) if index < 256 else pickle.LONG_BINGET + struct.pack("<I", index)


class _Translator:
    def __init__(self, source: str, data: bytes):
        self.source, self.data = source, data
        self.out: list[_Op] = [_Op(pickle.PROTO + bytes([2]))]
        self.memo_literals: dict[int, str] = {}   # memo index -> string it holds (when a string)
        self.dropped: set[int] = set()            # memo indices whose put was folded into a GLOBAL
        self.memo_size = 0

    def run(self) -> bytes:
        ops = list(pickletools.genops(self.data))
        for i, (op, arg, pos) in enumerate(ops):
            end = ops[i + 1][2] if i + 1 < len(ops) else len(self.data)
            self.step(op.name, arg, self.data[pos:end])
        return b"".join(o.data for o in self.out)

    def step(self, name: str, arg, raw: bytes) -> None:
        if name in ("PROTO", "FRAME"):
            return
        if name in _PASS:
            self.out.append(_Op(raw))
        elif name in _STRINGS:
            self.out.append(_Op(_unicode(arg), literal=arg))
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
        top = self.out[-1].literal if self.out else None
        if top is not None:
            self.memo_literals[index] = top
        self.memo_size = max(self.memo_size, index + 1)
        self.out.append(_Op(_put(index), memo_index=index))

    def get(self, index: int) -> None:
        literal = self.memo_literals.get(index)
        if index in self.dropped:  # its put was folded away; strings are values, re-push the literal
            self.out.append(_Op(_unicode(literal), literal=literal))
        else:
            self.out.append(_Op(_get(index), literal=literal))

    def stack_global(self) -> None:
        name, module = self.pop_literal(), self.pop_literal()
        self.out.append(_Op(pickle.GLOBAL + f"{module}\n{name}\n".encode("utf-8")))

    def pop_literal(self) -> str:
        while self.out and self.out[-1].memo_index is not None:
            self.dropped.add(self.out.pop().memo_index)
        if not self.out or self.out[-1].literal is None:
            raise MetadataError(f"{self.source}: a STACK_GLOBAL whose module or name is not a plain "
                                f"string; the file is not DCP metadata")
        return self.out.pop().literal


def downgrade_pickle(data: bytes, *, source: str = "pickle") -> bytes:
    """``data`` (a pickle of any protocol) as equivalent protocol-2 opcodes, or :class:`MetadataError`.

    Parses only; builds nothing. The result still holds every global the
    input named: the caller's unpickler decides which it admits.
    """
    try:
        return _Translator(source, data).run()
    except (ValueError, struct.error, UnicodeError) as e:
        raise MetadataError(f"{source} is not a readable pickle ({e}); the file is corrupt or cut short") from e

"""A pickle read without building anything it names: plain data as Python values, everything else as inert records.

A checkpoint's header (its ``data.pkl``: the step, hyperparameters, loop and resume state) is read before the
checkpoint is chosen, often from files nobody vouches for. ``pickle.Unpickler`` with a restricted ``find_class``
limits which classes a file names, not what the file does with them: pickle's ``BUILD`` sets attributes on whatever
is on its stack, a named class included (``setattr(PurePosixPath, "_str", ...)`` redirected every path of a process
in a test). :func:`read` runs no unpickler at all: the standard library's ``pickletools.genops`` splits the bytes
into opcodes, and a small stack machine here builds only ``dict``, ``list``, ``tuple``, ``set``, ``str``, ``bytes``,
numbers, ``bool`` and ``None``. A global becomes a :class:`Global` record, a call of it a :class:`Call` record
(never called), a tensor a :class:`TensorRecord` (its storage's dtype, size and element count, its view's offset,
size and stride: no byte of it read), and ``BUILD`` on anything but a record is refused. No standard-library or
torch reader does this (torch's weights-only unpickler builds the tensors, reading their bytes).

Only what ``torch.save`` writes (pickle protocol 2, and any later protocol's framing) is read; the older
text protocol's object opcodes (``INST``, ``OBJ``), extension codes and out-of-band buffers are refused.
"""

from __future__ import annotations

import io
import math
import pickletools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import IO, Any

MARK = object()
MAX_DEPTH = 100
"""The deepest nesting of containers :func:`read` admits: a checkpoint's is about ten."""


class NotAPlainPickle(ValueError):
    """The bytes are not a readable pickle (cut short, malformed)."""


class RefusedPickle(NotAPlainPickle):
    """The pickle does what ``torch.save`` never writes: a refused opcode, ``BUILD`` on a global, a call of
    something other than a global."""


@dataclass(frozen=True)
class Global:
    """A module-level name the pickle refers to (``torch._utils._rebuild_tensor_v2``); never imported."""

    module: str
    name: str

    @property
    def path(self) -> str:
        return f"{self.module}.{self.name}"


@dataclass
class Call:
    """An object the pickle would build by calling ``func`` with ``args`` (and setting ``state``); never built.
    Items and elements the pickle adds to it (a ``dict`` or ``list`` subclass) are kept in ``items`` / ``elements``."""

    func: Any
    args: tuple = ()
    state: Any = None
    items: dict = field(default_factory=dict)
    elements: list = field(default_factory=list)


@dataclass(frozen=True)
class StorageRecord:
    """A tensor storage a ``torch.save`` archive holds in its record ``data/<key>``: ``numel`` elements of ``dtype``
    (the storage class's name, ``FloatStorage``, or ``UntypedStorage`` for bytes)."""

    dtype: str
    key: str
    location: str
    numel: int


@dataclass(frozen=True)
class TensorRecord:
    """A tensor the pickle would rebuild (``torch._utils._rebuild_tensor_v2``): a view of ``storage``."""

    storage: StorageRecord | None
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.size

    @property
    def numel(self) -> int:
        return math.prod(self.size)


_TENSOR_BUILDERS = {"torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_tensor"}
_PASS_THROUGH = {"torch._utils._rebuild_parameter", "torch._utils._rebuild_parameter_with_state"}
_ORDERED_DICT = "collections.OrderedDict"
_REFUSED = {"INST", "OBJ", "EXT1", "EXT2", "EXT4", "NEXT_BUFFER", "READONLY_BUFFER", "PERSID"}
_CONSTANTS = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False}
_EMPTY = {"EMPTY_DICT": dict, "EMPTY_LIST": list, "EMPTY_TUPLE": tuple, "EMPTY_SET": set}
_PUSH_ARG = {
    "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT", "BINFLOAT", "STRING", "BINSTRING",
    "SHORT_BINSTRING", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "BINBYTES", "SHORT_BINBYTES",
    "BINBYTES8", "BYTEARRAY8",
}  # fmt: skip


def read(
    source: bytes | IO[bytes],
    allowed: Mapping[str, Any] | None = None,
    max_items: int = 10_000_000,
    max_depth: int = MAX_DEPTH,
) -> tuple[Any, list[TensorRecord]]:
    """The object a pickle holds, built of plain values and records, and every tensor it declares.

    Args:
        source: the pickle's bytes, or a binary file positioned at its start.
        allowed: None: globals stay :class:`Global` records and calls :class:`Call` records. Given (``"module.name"``
            -> object): the pickle may name only these, which are then used as torch's weights-only unpickler does
            (an allowed class built with ``__new__`` and given its state, an allowed function or class called), and
            ``BUILD`` only sets state on an instance of an allowed class; any other global is refused.
        max_items: the most opcodes read (a bound on time and memory, whatever the file says).
        max_depth: the deepest nesting of containers admitted (what reads the object later, ``copy.deepcopy`` or
            Lightning's collection walks, recurses once per level).

    Raises:
        RefusedPickle: a refused opcode, ``BUILD`` on a global, a call of anything but a global, more than
            ``max_items`` opcodes or a nesting deeper than ``max_depth``.
        NotAPlainPickle: a malformed or cut-short stream.
    """
    stream = io.BytesIO(source) if isinstance(source, bytes | bytearray) else source
    stack: list[Any] = []
    memo: dict[int, Any] = {}
    tensors: list[TensorRecord] = []
    try:
        for count, (opcode, arg, _) in enumerate(pickletools.genops(stream)):
            if count > max_items:
                raise RefusedPickle(f"more than {max_items} opcodes")
            name = opcode.name
            if name in ("PROTO", "FRAME"):
                continue
            if name == "STOP":
                if len(stack) != 1:
                    raise NotAPlainPickle("the stream ends with a stack of other than one object")
                _check_depth(stack[0], max_depth)
                return stack[0], tensors
            if name in _REFUSED:
                raise RefusedPickle(f"the {name} opcode is not one torch.save writes")
            if name in _PUSH_ARG:
                stack.append(bytes(arg or b"") if name == "BYTEARRAY8" else arg)
            elif name in _CONSTANTS:
                stack.append(_CONSTANTS[name])
            elif name in _EMPTY:
                stack.append(_EMPTY[name]())
            elif name == "MARK":
                stack.append(MARK)
            elif name in ("TUPLE", "LIST", "DICT", "FROZENSET"):
                items = _pop_mark(stack)
                if name == "DICT":
                    stack.append(dict(zip(items[::2], items[1::2], strict=True)))
                else:
                    stack.append({"TUPLE": tuple, "LIST": list, "FROZENSET": frozenset}[name](items))
            elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
                n = int(name[-1])
                items, stack[-n:] = stack[-n:], []
                if len(items) != n or MARK in items:
                    raise NotAPlainPickle(f"{name} without {n} objects")
                stack.append(tuple(items))
            elif name in ("SETITEM", "SETITEMS"):
                items = [stack.pop(), stack.pop()][::-1] if name == "SETITEM" else _pop_mark(stack)
                _set_items(stack[-1], items)
            elif name in ("APPEND", "APPENDS"):
                items = [stack.pop()] if name == "APPEND" else _pop_mark(stack)
                _append(stack[-1], items)
            elif name == "ADDITEMS":
                items = _pop_mark(stack)
                if not isinstance(stack[-1], set):
                    raise NotAPlainPickle("ADDITEMS to something other than a set")
                stack[-1].update(items)
            elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[int(arg or 0)] = stack[-1]
            elif name == "MEMOIZE":
                memo[len(memo)] = stack[-1]
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                stack.append(memo[int(arg or 0)])
            elif name in ("GLOBAL", "STACK_GLOBAL"):
                if name == "GLOBAL":
                    module, _, attr = str(arg).partition(" ")
                else:
                    attr, module = stack.pop(), stack.pop()
                stack.append(Global(str(module), str(attr)) if allowed is None else _allowed(allowed, module, attr))
            elif name == "REDUCE":
                args = stack.pop()
                stack[-1] = _call(stack[-1], args, tensors) if allowed is None else _apply(allowed, stack[-1], args)
            elif name in ("NEWOBJ", "NEWOBJ_EX"):
                kwargs = stack.pop() if name == "NEWOBJ_EX" else {}
                args = stack.pop()
                if allowed is None:
                    stack[-1] = Call(stack[-1], tuple(args), state=kwargs or None)
                else:
                    stack[-1] = _new(allowed, stack[-1], args, kwargs)
            elif name == "BUILD":
                state = stack.pop()
                _build(stack[-1], state) if allowed is None else _set_state(allowed, stack[-1], state)
            elif name == "BINPERSID":
                if allowed is not None:
                    raise RefusedPickle("a persistent reference, which this file never holds")
                stack.append(_storage(stack.pop()))
            elif name == "POP":
                stack.pop()
            elif name == "POP_MARK":
                _pop_mark(stack)
            elif name == "DUP":
                stack.append(stack[-1])
            else:
                raise RefusedPickle(f"the {name} opcode is not read")
    except NotAPlainPickle:
        raise
    except (ValueError, IndexError, KeyError, TypeError, AttributeError, OverflowError, MemoryError) as e:
        raise NotAPlainPickle(f"malformed pickle ({type(e).__name__}: {e})") from None
    raise NotAPlainPickle("the stream ends before its STOP opcode")


def _check_depth(root: Any, max_depth: int) -> None:
    """Refuses ``root`` where containers (and records' arguments, state and items) nest deeper than ``max_depth``;
    walked without recursion, each shared object once."""
    pending: list[tuple[Any, int]] = [(root, 0)]
    seen: set[int] = set()
    while pending:
        item, depth = pending.pop()
        if depth > max_depth:
            raise RefusedPickle(f"containers nested deeper than {max_depth}")
        if id(item) in seen:
            continue
        if isinstance(item, dict):
            children: Any = [*item.keys(), *item.values()]
        elif isinstance(item, list | tuple | set | frozenset):
            children = item
        elif isinstance(item, Call):
            children = [*item.args, item.state, *item.items.values(), *item.elements]
        else:
            continue
        seen.add(id(item))
        pending.extend((child, depth + 1) for child in children)


def _pop_mark(stack: list[Any]) -> list[Any]:
    for i in range(len(stack) - 1, -1, -1):
        if stack[i] is MARK:
            items, stack[i:] = stack[i + 1 :], []
            return items
    raise NotAPlainPickle("no MARK on the stack")


def _set_items(target: Any, items: list[Any]) -> None:
    if len(items) % 2:
        raise NotAPlainPickle("SETITEMS with an odd number of objects")
    pairs = zip(items[::2], items[1::2], strict=True)
    if isinstance(target, dict):
        target.update(pairs)
    elif isinstance(target, Call):
        target.items.update(pairs)
    else:
        raise NotAPlainPickle(f"SETITEMS to a {type(target).__name__}")


def _append(target: Any, items: list[Any]) -> None:
    if isinstance(target, list):
        target.extend(items)
    elif isinstance(target, Call):
        target.elements.extend(items)
    else:
        raise NotAPlainPickle(f"APPENDS to a {type(target).__name__}")


def _build(target: Any, state: Any) -> None:
    """``BUILD``: a record keeps the state it would be given; a plain ``dict`` (an ``OrderedDict``'s attributes, such
    as a state dict's ``_metadata``) ignores it; a global, or anything else, is refused."""
    if isinstance(target, Call):
        target.state = state
    elif not isinstance(target, dict | TensorRecord):
        raise RefusedPickle(f"BUILD on a {type(target).__name__} (a pickle sets attributes only on what it built)")


def _call(func: Any, args: Any, tensors: list[TensorRecord]) -> Any:
    if not isinstance(func, Global) or not isinstance(args, tuple):
        raise RefusedPickle("REDUCE of something other than a global")
    if func.path == _ORDERED_DICT:
        return dict(*args[:1])
    if func.path in _TENSOR_BUILDERS:
        storage, offset, size, stride = (args + (None,) * 4)[:4]
        if not (
            isinstance(offset, int)
            and isinstance(size, tuple)
            and isinstance(stride, tuple)
            and all(isinstance(n, int) for n in size + stride)
            and len(size) == len(stride)
        ):
            raise NotAPlainPickle("a tensor with a malformed offset, size or stride")
        record = TensorRecord(storage if isinstance(storage, StorageRecord) else None, offset, size, stride)
        tensors.append(record)
        return record
    if func.path in _PASS_THROUGH and args:
        return args[0]
    return Call(func, args)


def _storage(pid: Any) -> StorageRecord:
    """A ``torch.save`` persistent id, ``("storage", storage_type, key, location, numel)``."""
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
        raise RefusedPickle("a persistent id that is not a torch storage")
    _, kind, key, location, numel = pid
    if not (isinstance(key, str) and isinstance(numel, int) and numel >= 0):
        raise NotAPlainPickle("a storage with a malformed key or size")
    dtype = kind.name if isinstance(kind, Global) else str(getattr(kind, "func", kind))
    return StorageRecord(dtype, key, str(location), numel)


def _allowed(allowed: Mapping[str, Any], module: Any, name: Any) -> Any:
    found = allowed.get(f"{module}.{name}")
    if found is None:
        raise RefusedPickle(f"{module}.{name} is not one of the classes this file may name")
    return found


def _allowed_value(allowed: Mapping[str, Any], value: Any) -> bool:
    return any(value is candidate for candidate in allowed.values())


def _apply(allowed: Mapping[str, Any], func: Any, args: Any) -> Any:
    if not (callable(func) and _allowed_value(allowed, func) and isinstance(args, tuple)):
        raise RefusedPickle(f"a call of {func!r}, which this file may not make")
    return func(*args)


def _new(allowed: Mapping[str, Any], cls: Any, args: Any, kwargs: Any) -> Any:
    if not (isinstance(cls, type) and _allowed_value(allowed, cls) and isinstance(args, tuple)):
        raise RefusedPickle(f"an object of {cls!r}, which this file may not build")
    return cls.__new__(cls, *args, **(kwargs or {}))


def _set_state(allowed: Mapping[str, Any], inst: Any, state: Any) -> None:
    """``BUILD`` as torch's weights-only unpickler does it: only on an instance of an allowed class (never on a class
    itself), its ``__setstate__`` or its ``__dict__``; attribute names that begin with ``__`` are refused."""
    if isinstance(inst, type) or not _allowed_value(allowed, type(inst)):
        raise RefusedPickle(f"BUILD on {type(inst).__name__}, which this file may not give a state")
    setstate = getattr(type(inst), "__setstate__", None)
    if setstate is not None and setstate is not getattr(object, "__setstate__", None):
        inst.__setstate__(state)
        return
    slots = None
    if isinstance(state, tuple) and len(state) == 2:
        state, slots = state
    for part in (state, slots):
        if part and (not isinstance(part, dict) or any(not isinstance(k, str) or k.startswith("__") for k in part)):
            raise RefusedPickle("a state that is not a mapping of attribute names")
    if state:
        inst.__dict__.update(state)
    for key, value in (slots or {}).items():
        setattr(inst, key, value)

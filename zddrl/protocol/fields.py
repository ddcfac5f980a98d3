"""The type tests of message header fields, built once per message class from its annotations.

Part of zddrl.protocol's decode (docs/protocol.md section 2.3): protocol/__init__.py owns the messages and
calls ``field_table(cls)`` for each at import. Header values come from msgpack.unpackb, which makes
only exact built-in types (None, bool, int, float, str, bytes, list, dict, ExtType, Timestamp). So
``type(v) is int`` is the field test "int and not bool", ``type(v) is str`` is isinstance(v, str),
and so on: one cheap test each.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

_SCALARS = frozenset({type(None), bool, int, float, str, bytes})
_STR = frozenset({str})


def plain(value: Any) -> bool:
    """True if ``value`` is plain data: nil, bool, int, float, str, bin, arrays and str-keyed maps of those.

    Iterative, so a deeply nested hostile header cannot exhaust the Python stack. A flat map of
    scalars (an info or stats map) is confirmed with two C-level passes.
    """
    if type(value) is dict and _STR.issuperset(map(type, value)) and _SCALARS.issuperset(map(type, value.values())):
        return True
    stack = [value]
    items: Iterable[Any]
    while stack:
        v = stack.pop()
        if type(v) is dict:
            for k in v:
                if type(k) is not str:
                    return False
            items = v.values()
        elif type(v) is list:
            items = v
        elif type(v) in _SCALARS:
            continue
        else:
            return False  # msgpack ext types (ExtType, Timestamp) have no place in a header
        for x in items:
            if type(x) is dict or type(x) is list:
                stack.append(x)
            elif type(x) not in _SCALARS:
                return False
    return True


def _numbers(kinds: frozenset) -> Callable[[Any], bool]:
    """The test of a list of numbers (episode figures): one C-level pass over the element types, and
    finite values for a list of floats (msgpack may carry a whole float as an int)."""
    if float in kinds:
        return lambda v: type(v) is list and kinds.issuperset(map(type, v)) and all(map(math.isfinite, v))
    return lambda v: type(v) is list and kinds.issuperset(map(type, v))


def checker(hint: Any) -> Any:
    """The type test of a header field with annotation ``hint``: a type (the value's exact type must
    be it) or a predicate. Built once per field at import: reading annotations (typing.get_origin,
    get_args) for every field of every message was a large share of decode's cost."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        parts = tuple(_predicate(checker(h)) for h in typing.get_args(hint))
        return lambda v: any(part(v) for part in parts)
    origin = typing.get_origin(hint) or hint
    if hint is type(None):
        return lambda v: v is None
    if origin in (int, bool, str, bytes):  # exact: so an int field refuses a bool, as it must
        return origin
    if origin is float:
        return lambda v: (type(v) is float or type(v) is int) and math.isfinite(v)
    if origin in (dict, Mapping):
        return lambda v: type(v) is dict and plain(v)
    if origin in (list, Sequence) and typing.get_args(hint) == (float,):
        return _numbers(frozenset({float, int}))
    if origin in (list, Sequence) and typing.get_args(hint) == (int,):
        return _numbers(frozenset({int}))
    if origin in (list, Sequence):
        return lambda v: type(v) is list and plain(v)
    return lambda v: isinstance(v, origin)


def _predicate(check: Any) -> Callable[[Any], bool]:
    return (lambda v: type(v) is check) if isinstance(check, type) else check


class FieldTable(NamedTuple):
    rows: tuple
    """``(name, type test, default factory)`` per field. ``arrays`` has no test (it is checked against the
    frames) and, on the wire, no default; a field without a default has factory None."""
    names: tuple


def field_table(cls: type) -> FieldTable:
    """The field table of a message dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    rows = []
    for f in dataclasses.fields(cls):
        if f.default_factory is not dataclasses.MISSING:
            default = f.default_factory
        elif f.default is not dataclasses.MISSING:
            default = (lambda value: lambda: value)(f.default)
        else:
            default = None
        rows.append((f.name, None, None) if f.name == "arrays" else (f.name, checker(hints[f.name]), default))
    return FieldTable(tuple(rows), tuple(row[0] for row in rows))


def builder(cls: type) -> Callable[[dict[str, Any]], Any]:
    """``cls(**fields)`` for ``fields`` naming every field, without the generated ``__init__`` when it
    only stores them: a frozen dataclass sets each field through object.__setattr__, which cost as
    much as all of a trajectory's header checks together; filling ``__dict__`` at once gives the
    same object. A class with ``__post_init__`` or ``__slots__`` keeps its ``__init__``."""
    if hasattr(cls, "__post_init__") or hasattr(cls, "__slots__"):
        return lambda fields: cls(**fields)

    def build(fields: dict[str, Any]) -> Any:
        obj: Any = object.__new__(cls)
        obj.__dict__.update(fields)
        return obj

    return build


def fast_reader(
    table: FieldTable,
    read_arrays: Callable[..., Any] | None,
    rule: Callable[..., None] | None,
    check: Callable[[dict[str, Any]], None] | None,
) -> Callable[..., dict[str, Any] | None]:
    """A straight-line reader of a message class's header (``table``: its field_table) for the usual
    message: every field present, each of the exact type its peer_id writes, nothing else in the header.

    ``reader(header, frames, max_message_bytes, views)`` returns the fields (``arrays`` read by
    ``read_arrays`` with the kind's layout ``rule``, then the kind's ``check`` run; both raise as the
    generic path would) or None for anything else: a missing, extra or mistyped field goes to the
    generic path in protocol/__init__.py, which fills defaults and words the error. So a reader never accepts
    what the generic path refuses. It saves the generic loop's own work (rows, defaults, counting
    keys): 0.6 us of a trajectory's 3.3 us of field checks, and the key-type pass an exact match
    makes redundant; decode of a 1 MiB trajectory went from 6.7 to 5.8 us.

    Generated once per class at import, as dataclasses generates ``__init__``.
    """
    names = table.names
    scope: dict[str, Any] = {"read_arrays": read_arrays, "rule": rule, "check": check}
    lines = [
        "def read(header, frames, max_message_bytes, views):",
        f"    if len(header) != {len(names) + 1}{'' if read_arrays else ' or len(frames) != 2'}:",  # + "kind"
        "        return None",
        "    try:",
        *([f"        v{i} = header[{name!r}]" for i, name in enumerate(names)] or ["        pass"]),
        "    except KeyError:",
        "        return None",
    ]
    # Exact-type tests first, then predicates (which may walk a whole map): a header that fails a cheap
    # test goes to the generic path without paying for the dear ones twice. ``arrays`` has no test here:
    # it is read once every other field passed, so the generic path (field by field, in order) would
    # reach it as well and raise the same error.
    rows = [(i, test) for i, (_, test, _) in enumerate(table.rows) if test is not None]
    for i, test in sorted(rows, key=lambda row: not isinstance(row[1], type)):
        scope[f"t{i}"] = test
        bad = f"type(v{i}) is not t{i}" if isinstance(test, type) else f"not t{i}(v{i})"
        lines += [f"    if {bad}:", "        return None"]
    arrays_call = "read_arrays(v{}, frames[2:], max_message_bytes, views, rule)"
    values = ", ".join(
        f"{name!r}: {arrays_call.format(i) if test is None else f'v{i}'}"
        for i, (name, test, _) in enumerate(table.rows)
    )
    lines.append(f"    fields = {{{values}}}")
    if check is not None:
        lines.append("    check(fields)")
    lines.append("    return fields")
    exec("\n".join(lines), scope)  # noqa: S102 - source built above from the class's own field names
    return scope["read"]

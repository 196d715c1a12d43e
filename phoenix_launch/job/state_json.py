"""The job's state as JSON and back, whole: what the leader publishes to its standby (``standby/mirror.py``).

Nothing here lists the state's fields: a dataclass is written by its fields, any other object by its attributes, and
read back by their type annotations (``typing.get_type_hints``), so a field added to the state travels with it. What
is not state -- a port (the outbox, a callback, the configuration the standby reads itself) -- is named in the
class's ``PORTS`` and left out; the object read back into keeps its own. An attribute that is neither annotated nor a
port, or a value of a type this module cannot write (a callable, a socket), is a ``TypeError`` at the first
publication, not a field silently dropped.

Written: JSON's scalars as they are, an ``Enum`` by its value, a ``Path`` as text, a list, tuple, set or frozenset
as a list, a dict as an object when every key is text (else as ``[[key, value], ...]``), a
:class:`~phoenix_runtime.plane.protocol.Membership` as its own wire JSON (memoised by generation: a large job's
membership is not written on every pass), a :class:`~phoenix_launch.lifecycle.Lifecycle` by its enum's name, its state
and its history (its transition table is the enum's). Read back: by the annotation; ``Any`` or a bare ``dict``
(a probe's result, an error file's content) as the JSON it is.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from enum import Enum
from pathlib import Path
from typing import Any

from phoenix_launch.lifecycle import TABLES, Lifecycle
from phoenix_runtime.plane.protocol import Membership

_SCALARS = (bool, int, float, str, type(None))


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    """The state's attributes of ``cls`` and their types: its annotations less ``PORTS`` and class variables."""
    if cls not in _HINTS:
        _HINTS[cls] = _find_hints(cls)
    return _HINTS[cls]


def _find_hints(cls: type) -> dict[str, Any]:
    ports = set(getattr(cls, "PORTS", ()))
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) else list(hints)
    return {n: hints[n] for n in names if n not in ports and typing.get_origin(hints[n]) is not typing.ClassVar}


def encode(value: Any, memo: dict[int, str] | None = None) -> Any:
    """``value`` as JSON's types. ``memo``: memberships' JSON by generation, kept between calls by the caller."""
    t = type(value)
    if t in _SCALARS:  # (the most values: checked first, by their exact type)
        return value
    if t is list or t is tuple:
        return [encode(v, memo) for v in value]
    plan = _PLANS.get(t)
    if plan is not None:  # an object of a class seen before
        if plan[1] is not None and not plan[1].issuperset(vars(value)):
            _stray(value, plan[1])
        return {n: encode(getattr(value, n), memo) for n in plan[0]}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple, set, frozenset)):
        items = _sorted(value) if isinstance(value, (set, frozenset)) else value
        return [encode(v, memo) for v in items]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {k: encode(v, memo) for k, v in value.items()}
        return [[encode(k, memo), encode(v, memo)] for k, v in value.items()]
    if isinstance(value, Membership):
        if memo is None:
            return value.to_json()
        if value.gen not in memo:
            memo[value.gen] = value.to_json()
        return memo[value.gen]
    if isinstance(value, Lifecycle):
        return {"of": type(value.state).__name__, "state": value.state.value, "history": encode(value.history)}
    if callable(value) or not hasattr(value, "__dict__") and not dataclasses.is_dataclass(value):
        raise TypeError(f"{t.__name__} is not state: name the attribute that holds it in its owner's PORTS")
    hints = _hints(t)
    # a plain class's attributes are checked on every call: one set in __init__ but neither annotated nor a port
    known = None if dataclasses.is_dataclass(value) else frozenset(hints) | frozenset(getattr(t, "PORTS", ()))
    _PLANS[t] = (tuple(hints), known)
    return encode(value, memo)


# class -> (its state's attribute names, every attribute it may have: None for a dataclass, whose fields are fixed)
_PLANS: dict[type, tuple[tuple[str, ...], frozenset[str] | None]] = {}


def _stray(value: Any, known: frozenset[str]) -> None:
    name, cls = sorted(set(vars(value)) - known)[0], type(value).__name__
    raise TypeError(f"{cls}.{name} is neither annotated (state) nor in {cls}.PORTS")


def _sorted(items: set | frozenset) -> list:
    """A set's items in one order (the publication is compared as text)."""
    try:
        return sorted(items)
    except TypeError:
        return sorted(items, key=repr)


def decode(hint: Any, data: Any, into: Any = None) -> Any:
    """``data`` (from :func:`encode`) as a value of type ``hint``. ``into``: an object of that type whose state is
    replaced (its ports kept); it is returned. Needed for a type with ports: one cannot be made from data alone."""
    if hint is Any or hint is object:
        return data
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if data is None:
            return None
        (arg,) = [a for a in args if a is not type(None)][:1] or [Any]
        return decode(arg, data, into)
    if origin in (list, tuple, set, frozenset):
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            return tuple(decode(a, d) for a, d in zip(args, data))
        return origin(decode(args[0] if args else Any, d) for d in data)
    if origin is dict or hint is dict:
        k, v = args or (Any, Any)
        pairs = data.items() if isinstance(data, dict) else data
        return {decode(k, a): decode(v, b) for a, b in pairs}
    if not isinstance(hint, type):
        raise TypeError(f"cannot read back a value of type {hint!r}")
    if issubclass(hint, Enum):
        return hint(data)
    if hint in (bool, str, type(None)):
        return data
    if hint in (int, float):
        return hint(data)
    if issubclass(hint, Path):
        return hint(data)
    if issubclass(hint, Membership):
        return Membership.from_json(data)
    if hint is Lifecycle:
        return _lifecycle(data)
    return _decode_object(hint, data, into)


def _lifecycle(data: dict[str, Any]) -> Lifecycle:
    enum, table = TABLES[data["of"]]
    life = object.__new__(Lifecycle)  # (not through __post_init__: the history is the leader's)
    life.state, life.table = enum(data["state"]), table
    life.history = decode(list[tuple[float, str, str]], data["history"])
    return life


def _decode_object(cls: type, data: dict[str, Any], into: Any) -> Any:
    if into is None:
        if getattr(cls, "PORTS", ()):
            raise TypeError(f"a {cls.__name__} has ports: it is read back into one the reader made")
        into = object.__new__(cls)  # (not through __init__ or __post_init__: every attribute is set below)
    for name, hint in _hints(cls).items():
        current = getattr(into, name, None)
        value = decode(hint, data[name], current if _has_ports(current) else None)
        object.__setattr__(into, name, value)  # (a frozen dataclass too: it is being made)
    return into


def _has_ports(value: Any) -> bool:
    return bool(getattr(type(value), "PORTS", ())) and not isinstance(value, type)

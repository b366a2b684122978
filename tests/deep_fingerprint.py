"""A deep fingerprint of an object graph, for "changed nothing" checks: every attribute
reachable from the root through prefixkv's own objects and builtin containers, as one
nested tuple of plain values. Two graphs built and driven alike give equal fingerprints
(object identity is kept as the order of first visit, never as ``id()``); a set is
fingerprinted as its sorted members. Objects of other libraries (a Redis client, a
thread, a lock) stand as their type's name: the fingerprint is of prefixkv's state. A slot
a subclass shadows with a property (the vLLM plug-in's ``PoolBlock`` reads ``ref_cnt`` and
the hash fields live from prefixkv's pool, and refuses some reads by name) is derived, not
state: left out."""

from __future__ import annotations

import inspect
from typing import Any

_PLAIN = (int, float, str, bytes, bool, type(None), complex)


def fingerprint(root: Any, skip: frozenset[str] = frozenset(), opaque: frozenset[str] = frozenset()) -> Any:
    """The fingerprint of everything reachable from ``root`` (attribute names in ``skip``
    left out at every level: a clock, a thread pool; objects of the classes named in
    ``opaque`` stand as their class name: what other threads write to)."""
    seen: dict[int, int] = {}
    keep: list[Any] = []  # the visited objects stay alive, so no id() is reused meanwhile

    def walk(obj: Any) -> Any:
        if isinstance(obj, _PLAIN):
            return (type(obj).__name__, repr(obj))
        if isinstance(obj, memoryview):
            return ("memoryview", obj.nbytes)
        if id(obj) in seen:
            return ("ref", seen[id(obj)])
        seen[id(obj)] = len(seen)
        keep.append(obj)
        if isinstance(obj, (list, tuple)):
            return (type(obj).__name__, tuple(walk(x) for x in obj))
        if isinstance(obj, dict):
            return ("dict", tuple((walk(k), walk(v)) for k, v in obj.items()))
        if isinstance(obj, (set, frozenset)):
            return ("set", tuple(sorted(repr(walk(x)) for x in obj)))
        if isinstance(obj, bytearray):
            return ("bytearray", bytes(obj))
        mod = type(obj).__module__
        if not (mod.startswith("prefixkv") or mod == "collections") or type(obj).__qualname__ in opaque:
            return ("other", type(obj).__qualname__)
        if hasattr(obj, "__len__") and hasattr(obj, "__iter__") and mod == "collections":
            return (type(obj).__name__, tuple(walk(x) for x in obj))
        fields = []
        for cls in type(obj).__mro__:
            for name in getattr(cls, "__slots__", ()):
                if isinstance(inspect.getattr_static(type(obj), name, None), property):
                    continue  # (a slot a subclass reads as a property: derived, not state)
                if name not in skip and hasattr(obj, name):
                    fields.append((name, walk(getattr(obj, name))))
        for name, value in getattr(obj, "__dict__", {}).items():
            if name in skip:
                continue
            is_function = callable(value) and not type(value).__module__.startswith("prefixkv")
            fields.append((name, ("callable",) if is_function else walk(value)))
        return (type(obj).__qualname__, tuple(fields))

    return walk(root)

"""Checks of the router's, its scorers' and its feeders' constructor options: each raises
the caller's error class (a ``PrefixKVError`` subclass) naming the option, before the
caller changes anything. A bool is never a number here (``True`` is no weight), and a
comparison with NaN fails, so NaN is refused wherever a range is asked for.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Collection, Iterable, Mapping

from ..errors import PrefixKVError

INDEX_METHODS = ("store", "remove", "clear", "prefix_runs", "num_blocks", "routed")
"""What the router calls on its index (``index.BlockIndex``)."""


def check_number(name: str, value: object, error: type[PrefixKVError],
                 ok: Callable[[float], bool], want: str) -> float:
    """``value`` if it is an int or a float (not a bool) for which ``ok`` holds; else
    ``error`` saying ``name`` must be ``want``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
        raise error(f"{name} must be {want}, got {value!r}"[:200])
    return value


def check_int(name: str, value: object, error: type[PrefixKVError], low: int,
              high: int = sys.maxsize) -> int:
    """``value`` if it is an int (not a bool) in ``[low, high]``; else ``error``."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        bound = f">= {low}" if high == sys.maxsize else f"in [{low}, {high}]"
        raise error(f"{name} must be an int {bound}, got {value!r}"[:200])
    return value


def check_methods(name: str, value: object, error: type[PrefixKVError],
                  methods: Collection[str]) -> None:
    """``error`` unless ``value`` has each of ``methods``, callable (the protocol it is
    passed for: a mistake found now, not at the first call that uses it)."""
    missing = [m for m in methods if not callable(getattr(value, m, None))]
    if missing:
        raise error(f"{name} must have the methods {', '.join(methods)}; "
                    f"{type(value).__name__} lacks {', '.join(missing)}")


def check_router(name: str, router: object, error: type[PrefixKVError]) -> Collection[str]:
    """The replica names of ``router``, which must be a ``Router`` (duck-typed: its
    ``replicas`` a tuple of str); else ``error``."""
    replicas = getattr(router, "replicas", None)
    if not isinstance(replicas, tuple) or not all(isinstance(r, str) for r in replicas):
        raise error(f"{name} must be a Router, got {router!r}"[:200])
    return replicas


def check_blocks(name: str, value: object, error: type[PrefixKVError],
                 replicas: Collection[str]) -> dict[str, int]:
    """``value`` (a mapping of replicas among ``replicas`` to their pools in blocks, each
    an int >= 1; None: empty) as a dict; else ``error``."""
    if value is None:
        return {}
    if not isinstance(value, Mapping) or set(value) - set(replicas) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in value.values()):
        raise error(f"{name} must map replicas among {list(replicas)} to blocks >= 1, got "
                    f"{value!r}"[:300])
    return dict(value)


def check_names(name: str, value: object, error: type[PrefixKVError]) -> list[str]:
    """``value`` (an iterable of distinct non-empty str, at least one; a str or bytes is
    not a list of names) as a list; else ``error``."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise error(f"{name} must be a list of names (not one str), got {value!r}"[:200])
    names = list(value)
    if not names or not all(isinstance(r, str) and r for r in names) or len(set(names)) != len(
            names):
        raise error(f"{name} must be distinct non-empty str names, at least one: {names!r}"[:200])
    return names

"""The arguments an engine's glue code gets wrong, for the bad-input sweeps: numpy ints
and floats, numpy arrays, tuples and ranges where lists are usual, generators (consumed
by a first look, then empty), bools inside token lists, huge and negative numbers,
unhashable ids, ids of freed requests. Each is a factory: every call gets a fresh value."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np


def _gen(values: list[Any]) -> Callable[[], Iterator[Any]]:
    def make() -> Iterator[Any]:
        return (v for v in values)
    return make


# Each is a factory: every call gets a fresh value (a generator is consumed once).
HOSTILE: dict[str, Callable[[], Any]] = {
    "np.int64(3)": lambda: np.int64(3),
    "np.int64(-1)": lambda: np.int64(-1),
    "np.uint64(2**63)": lambda: np.uint64(2**63),
    "np.float64(nan)": lambda: np.float64(math.nan),
    "np.float64(2.0)": lambda: np.float64(2.0),
    "np.bool_(True)": lambda: np.bool_(True),
    "inf": lambda: math.inf,
    "2**63": lambda: 2**63,
    "-2**63": lambda: -(2**63),
    "False": lambda: False,
    "np.array([1,2,3])": lambda: np.array([1, 2, 3]),
    "np.array(int64 tokens)": lambda: np.arange(40, 53, dtype=np.int64),
    "np.array(float tokens)": lambda: np.arange(40, 53, dtype=np.float64),
    "np.array 2d": lambda: np.zeros((2, 8), dtype=np.int64),
    "tokens as tuple": lambda: tuple(range(40, 53)),
    "tokens as range": lambda: range(40, 53),
    "tokens as generator": _gen(list(range(40, 53))),
    "tokens as bytearray": lambda: bytearray(range(40, 53)),
    "tokens as str": lambda: "abcdefghijklm",
    "tokens with np.int64": lambda: [np.int64(t) for t in range(40, 53)],
    "tokens with a bool": lambda: [40, 41, True, 43, 44],
    "tokens with nan": lambda: [40, 41, math.nan],
    "tokens with -1": lambda: [40, -1, 42],
    "tokens with 2**64": lambda: [40, 2**64, 42],
    "empty list": lambda: [],
    "oversized tokens": lambda: list(range(40, 40 + 4 * 64)),
    "ids as set": lambda: {"live", "chunked"},
    "ids as generator": _gen(["live", "chunked"]),
    "ids with a duplicate": lambda: ["live", "live"],
    "ids with a freed one": lambda: ["live", "gone"],
    "block ids np": lambda: np.array([0, 1]),
    "block ids generator": _gen([0, 1]),
    "block ids huge": lambda: [2**40],
    "block ids bools": lambda: [True, False],
    "unhashable id": lambda: ["a"],
    "freed id": lambda: "gone",
    "live id": lambda: "live",
    "object()": lambda: object(),
    "None": lambda: None,
    "dict": lambda: {"a": [1]},
}


Call = tuple[tuple[Any, ...], dict[str, Any]]


def variants(good: Callable[[], Call], name: str) -> list[tuple[str, Callable[[], Call]]]:
    """A call's good arguments (``good()``: args and keywords) with each one in turn
    replaced by each value of ``HOSTILE``: (label, factory of the arguments)."""
    args0, kw0 = good()
    out: list[tuple[str, Callable[[], Call]]] = []
    for slot in [*range(len(args0)), *kw0]:
        for label, value in HOSTILE.items():
            def make(slot: int | str = slot, value: Callable[[], Any] = value) -> Call:
                args, kw = good()
                if isinstance(slot, str):
                    return args, {**kw, slot: value()}
                return args[:slot] + (value(),) + args[slot + 1:], kw
            out.append((f"{name} {slot}={label}", make))
    return out


def outcome(ours: Any, twin: Any, call: Callable[[Any], object],
            state: Callable[[Any], object]) -> str | None:
    """``call(ours)``; if it succeeds, ``call(twin)`` too. None when it raised a
    ``PrefixKVError`` with ``ours`` unchanged (as ``state`` sees it), or succeeded with both
    alike; else what went wrong."""
    from prefixkv import PrefixKVError

    try:
        call(ours)
    except PrefixKVError:
        return "raised, but the state changed" if state(ours) != state(twin) else None
    except Exception as e:  # noqa: BLE001 (the point: which untyped errors escape)
        return f"{type(e).__name__}: {e}"
    call(twin)
    return "succeeded, but not as its twin did" if state(ours) != state(twin) else None

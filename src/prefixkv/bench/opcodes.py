"""Python bytecodes a call executes: a cost figure that does not depend on the machine's
load (benchmarks report it beside wall times taken on busy shared cores)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any


def count_opcodes(fn: Callable[[], object]) -> int:
    """Bytecodes executed by ``fn()`` and everything it calls in Python (C code counts
    nothing), through ``sys.settrace``; the tracer is removed after, even on error."""
    n = 0

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal n
        frame.f_trace_opcodes = True
        if event == "opcode":
            n += 1
        return tracer

    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return n

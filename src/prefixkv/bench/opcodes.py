"""Python bytecodes a call executes: a cost figure that does not depend on the machine's
load (benchmarks report it beside wall times taken on busy shared cores)."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any


def count_opcodes(fn: Callable[[], object], own: Counter[str] | None = None,
                  calls: Counter[str] | None = None) -> int:
    """Bytecodes executed by ``fn()`` and everything it calls in Python (C code counts
    nothing), through ``sys.settrace``; the tracer is removed after, even on error.
    ``own`` and ``calls``, if given, also get each function's own bytecodes (its code
    object's, not its callees') and its calls, by ``code_name``."""
    n = 0

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal n
        frame.f_trace_opcodes = True
        if event == "opcode":
            n += 1
            if own is not None:
                own[code_name(frame.f_code)] += 1
        elif event == "call" and calls is not None:
            calls[code_name(frame.f_code)] += 1
        return tracer

    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return n


def code_name(code: CodeType) -> str:
    """``path:qualname`` of a function's code, the path from the package's folder on
    (``prefixkv/index/kids.py:Kids.note``) where it is under a ``src/``."""
    return f"{code.co_filename.rsplit('/src/', 1)[-1]}:{code.co_qualname}"

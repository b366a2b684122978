"""Three shortcuts through Triton's CPU interpreter (``TRITON_INTERPRET=1``) for the suite,
none of which can change a result: ``tests/conftest.py`` calls :func:`apply_shortcuts`
before each test (it does nothing until triton is imported), and the Python subprocesses
the tests start install them when they import triton (``tests/interpreter_site``).
``tests/kernels/test_interpreter_shortcuts.py`` checks on the installed triton what each
relies on, and fails when a triton release breaks it.

Share of the interpreter's profile (cProfile, ``tests/kernels/test_split_kv.py``, and
test_untrusted_metadata, test_variants and test_scale_sink_values for the scan), triton 3.9:

1. **Overflow checks whose outcome is dropped (31%).** On ``+ - *`` of integers narrower
   than 64 bits, ``TritonSemantic.binary_op_sanitize_overflow_impl`` recomputes the
   operation in int64, compares it with the type's bounds and hands the comparison to
   ``device_assert``, which returns at once unless the builder's options say ``debug``.
   The interpreter's options (``InterpreterOptions``) never do (neither ``TRITON_DEBUG``
   nor ``@triton.jit(debug=True)`` reach them), so the check is computed with numpy on
   every integer operation and thrown away; on a GPU it is dead code the compiler deletes
   (triton-lang/triton#4589 put it under ``debug``). The shortcut sets
   ``sanitize_overflow=False`` on those options, and only while ``debug`` is False.
2. **Patching ``triton.language`` again on every call of a ``@triton.jit`` helper (18%).**
   A launch (``GridExecutor.__call__``) replaces the builtins of ``triton.language`` with
   interpreter versions and restores them when it ends. Each call of a jit helper inside
   the kernel calls the same ``_patch_lang`` again: it walks the modules with
   ``inspect.getmembers``, finds the builtins already replaced, sets the same attributes
   to equivalent functions once more and throws away its undo list. The shortcut does
   nothing for a helper whose modules the launch has patched. A helper naming a module
   not patched yet (triton's own ``tl.sum`` and ``tl.max`` name ``triton.language.core``)
   is patched as triton does, and that module then counts as patched until the launch
   ends: nothing undoes a helper's patches, so they hold that long.
3. **Integer scans one element at a time (23% once 1 and 2 are gone).** The attention
   kernel's request search scans 64 ``cu_seqlens_q`` entries with
   ``tl.associative_scan(..., _max)`` in every program; triton's ``ScanOps.generic_scan``
   calls the combine function once an element, on scalars. The shortcut scans integer
   tensors by doubling instead (log2(n) calls on whole vectors, earlier operand on the
   left): an associative combine function on integers gives the same bits, and
   ``associative_scan`` requires it to be associative. It takes triton's own path for
   float tensors (a reordered float sum may round differently) and for combine functions
   with a branch, a loop, ``and``/``or`` or a chained comparison (which would ask a vector
   for its truth) or a call of another jit function (whose body is not read).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import sys
import textwrap
from typing import Any

import numpy as np


def _language_modules(fn: Any, tl: Any) -> frozenset[int]:
    """The ids of ``triton.language`` / ``triton.language.core`` as ``fn``'s globals name them:
    the modules ``_patch_lang(fn)`` patches."""
    return frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)


def _skip_overflow_checks(interpreter: Any) -> bool:
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if not dataclasses.is_dataclass(options) or getattr(options, "debug", True):
        return False
    if not getattr(options, "sanitize_overflow", False):
        return False
    builder.options = dataclasses.replace(options, sanitize_overflow=False)
    return True


def _patch_once_per_launch(interpreter: Any) -> bool:
    original = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if original is None or scope_type is None or getattr(original, "once_per_launch", False):
        return False
    tl = interpreter.tl
    patched: set[int] = set()  # the modules patched in the launch under way (none between launches)

    def patch_lang(fn: Any) -> Any:
        modules = _language_modules(fn, tl)
        if patched and modules <= patched:  # a jit helper, in a launch that patched its modules
            return scope_type()
        scope = original(fn)
        in_launch = bool(patched)
        patched.update(modules)
        if in_launch:  # a helper naming a module not patched yet: its patches last the launch
            return scope
        restore = scope.restore  # a launch (GridExecutor.__call__): restores the scope at its end

        def end_launch() -> None:
            patched.clear()
            restore()

        scope.restore = end_launch
        return scope

    patch_lang.once_per_launch = True  # type: ignore[attr-defined]
    interpreter._patch_lang = patch_lang
    return True


# Python that asks a value for its truth: on a vector it would not mean what it means on a scalar.
_BRANCHES = (ast.If, ast.IfExp, ast.While, ast.For, ast.BoolOp, ast.Assert, ast.Match)


@functools.cache
def _elementwise(fn: Any) -> bool:
    """``fn`` (a scan's combine function) is straight-line code: no branch, loop, ``and``/``or``
    or chained comparison, and no call of a function by its bare name (a jit helper, whose
    body this does not read; ``tl.maximum(a, b)`` and ``a.to(...)`` are fine), so calling it
    on vectors computes what calling it on each element does."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return False
    return not any(isinstance(n, _BRANCHES) or (isinstance(n, ast.Compare) and len(n.ops) > 1)
                   or (isinstance(n, ast.Call) and isinstance(n.func, ast.Name))
                   for n in ast.walk(tree))


def _scan_by_doubling(ops: Any, inputs: tuple[Any, ...], tl: Any) -> list[Any]:
    """An inclusive scan along ``ops.axis`` in log2(n) calls of the combine function on whole
    vectors (each element combined with the one ``step`` before it, step 1, 2, 4, ...), where
    triton's ``generic_scan`` calls it once an element, on scalars. The earlier operand
    stays on the left, so an associative combine function gives what the element-by-element
    scan gives; on integers (exact arithmetic) bit for bit."""
    data = [np.array(arg.handle.data) for arg in inputs]
    n = data[0].shape[ops.axis]
    position = np.arange(n).reshape([n if d == ops.axis else 1 for d in range(data[0].ndim)])
    step = 1
    while step < n:
        pairs = list(zip(data, inputs, strict=True))
        earlier = [ops.to_tensor(np.roll(d, step, ops.axis), a.dtype) for d, a in pairs]
        current = [ops.to_tensor(d, a.dtype) for d, a in pairs]
        out = ops.combine_fn.fn(*earlier, *current)
        out = out if isinstance(out, tuple) else (out,)
        # The first ``step`` elements have nothing that far before them: they keep their value.
        data = [np.where(position >= step, np.asarray(o.handle.data if isinstance(o, tl.core.tensor) else o)
                         .astype(d.dtype), d) for d, o in zip(data, out, strict=True)]
        step *= 2
    return [ops.to_tensor(d, a.dtype) for d, a in zip(data, inputs, strict=True)]


def _scan_integers_by_doubling(interpreter: Any) -> bool:
    scan_ops = getattr(interpreter, "ScanOps", None)
    original = getattr(scan_ops, "generic_scan", None)
    if original is None or getattr(original, "by_doubling", False):
        return False
    tl = interpreter.tl

    def generic_scan(self: Any, inputs: tuple[Any, ...]) -> list[Any]:
        if (all(a.dtype.is_int() or a.dtype.is_bool() for a in inputs)
                and _elementwise(self.combine_fn.fn)):
            return _scan_by_doubling(self, inputs, tl)
        return original(self, inputs)

    generic_scan.by_doubling = True  # type: ignore[attr-defined]
    generic_scan.original = original  # type: ignore[attr-defined]
    scan_ops.generic_scan = generic_scan
    return True


def apply_shortcuts() -> dict[str, bool]:
    """Install the three shortcuts once triton is imported (before, does nothing); returns
    which were installed by this call. Idempotent."""
    interpreter = sys.modules.get("triton.runtime.interpreter")
    if interpreter is None:  # not imported yet: nothing has run in the interpreter
        return {}
    return {"overflow_checks": _skip_overflow_checks(interpreter),
            "patch_once_per_launch": _patch_once_per_launch(interpreter),
            "scan_by_doubling": _scan_integers_by_doubling(interpreter)}

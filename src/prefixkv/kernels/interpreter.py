"""Triton's CPU interpreter (``TRITON_INTERPRET=1``): one backported fix for triton 3.6.

triton 3.6's interpreter turns a scalar tensor into a Python int with ``int()`` of its
1-element numpy array (the interpreter keeps scalars as shape ``(1,)``). numpy 2.4 made
that a ``TypeError`` ("only 0-dimensional arrays can be converted to Python scalars"), so
every ``for ... in range(lo, hi, step)`` whose bound is loaded or computed in the kernel
fails there: all of our attention kernel's phase loops (triton-lang/triton#9171).
triton 3.7 squeezes the array first (triton-lang/triton#9172); :func:`backport_scalar_index`
applies that same one-line change to older triton. Compiled kernels are never affected.
"""

from __future__ import annotations

import functools
import re
from typing import Any

__all__ = ["backport_scalar_index", "needs_scalar_index_backport"]

FIXED_IN = (3, 7)  # first triton release whose interpreter squeezes before int()


def needs_scalar_index_backport(version: str) -> bool:
    """True for triton versions (``"3.6.0"``, ``"3.6.0+git..."``) older than :data:`FIXED_IN`."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return match is not None and tuple(map(int, match.groups())) < FIXED_IN


def _scalar_index(self: Any) -> int:
    return int(self.handle.data.squeeze())


@functools.cache
def backport_scalar_index() -> bool:
    """On triton < 3.7, make the interpreter's ``tensor.__index__`` squeeze its array first.

    Call it before a kernel with data-dependent loop bounds runs in the interpreter; it is
    idempotent and does nothing (returns False) on fixed versions or with the interpreter
    off. Returns True when it patched. The interpreter sets ``tensor.__index__`` afresh on
    each launch in ``_patch_lang_tensor`` and undoes it afterwards; the wrapper here sets
    it once more right after, on the same undo list, so the launch ends as it began.
    """
    import triton

    from .tiling import interpreting

    if not interpreting() or not needs_scalar_index_backport(triton.__version__):
        return False
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", _scalar_index)

    interpreter._patch_lang_tensor = patch_lang_tensor
    return True

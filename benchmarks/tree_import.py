"""(helper) A second prefixkv imported from another tree, side by side with this
process's own: for benchmarks that pair two trees in one process (``events_pair.py``,
``store_pair.py``)."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

OURS = "prefixkv"


def import_tree(src: str, *names: str) -> list[ModuleType]:
    """The modules ``names`` (``prefixkv`` or its submodules) imported from ``src``; the
    prefixkv modules imported before stay as they were in ``sys.modules``."""
    def ours(k: str) -> bool:
        return k == OURS or k.startswith(OURS + ".")
    saved = {k: v for k, v in sys.modules.items() if ours(k)}
    for k in saved:
        del sys.modules[k]
    sys.path.insert(0, src)
    try:
        return [importlib.import_module(n) for n in names]
    finally:
        sys.path.remove(src)
        for k in [k for k in sys.modules if ours(k)]:
            del sys.modules[k]
        sys.modules.update(saved)

"""End to end through the example engine (``prefixkv.engine``); needs torch."""

from __future__ import annotations

from typing import Any


def run_e2e(seed: int = 0) -> dict[str, Any]:
    """Placeholder until the engine lands: reports why it was skipped."""
    return {"skipped": "the example engine (prefixkv.engine) is not available yet"}

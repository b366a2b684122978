"""prefixkv inside vLLM 0.33.0 (pinned), through vLLM's own plug points.

    vllm serve MODEL --enable-prefix-caching \\
        --scheduler-cls prefixkv.integrations.vllm.AsyncScheduler
    # with --no-async-scheduling: prefixkv.integrations.vllm.Scheduler
    # (vLLM 0.33 schedules asynchronously by default: docs/integration.md)

``Scheduler`` and ``AsyncScheduler`` are vLLM's own v1 schedulers whose KV cache manager
is ``KVCacheManager`` here: prefixkv's ``KVCacheManager`` (one full-attention group) or
``prefixkv.groups.HybridKVCacheManager`` (full, sliding-window and chunked-local groups)
behind the calls vLLM's scheduler makes, with vLLM's result, event and stats types.
What prefixkv does not offer is refused at construction (``UnsupportedByPrefixKV``).
Supported, refused, and the tests that prove it: docs/integration.md, "With vLLM".

The names load lazily: importing this package imports no vLLM module, so a KV connector
living beside it does not build the scheduler, nor the scheduler the connector.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "Scheduler": "scheduler",
    "AsyncScheduler": "scheduler",
    "KVCacheManager": "manager",
    "UnsupportedByPrefixKV": "layout",
    "VLLM_VERSION": "layout",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

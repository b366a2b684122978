"""vLLM's own v1 schedulers, running on prefixkv: the classes ``--scheduler-cls`` names.

    --scheduler-cls prefixkv.integrations.vllm.AsyncScheduler   # vLLM 0.33's default: async scheduling
    --scheduler-cls prefixkv.integrations.vllm.Scheduler        # with --no-async-scheduling

Each is vLLM's class, run unchanged. vLLM's constructor builds its manager by the name
``KVCacheManager`` in ``vllm.v1.core.sched.scheduler`` (there is no hook for it); while
this class's constructor runs vLLM's, that name resolves to prefixkv's
``KVCacheManager``, so the manager is built from the very arguments vLLM passes, the
scheduler reads its groups from it and the KV connector is bound to it. The name is
restored before the constructor returns, under a lock (one such construction at a time;
a vLLM ``Scheduler`` built by another thread at that very moment would get prefixkv's
manager too). With KV events on and vLLM's ``ZmqEventPublisher``, the constructor then
makes the publisher's thread build the events (``handoff.py``), so that the scheduler's
thread computes no chain hash for them. And when vLLM's ``EngineCore`` is the one building
it, the hasher that engine gives its requests next prepares each prompt for prefixkv on
the engine's input thread (``input_thread.py``, ``prepared.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import vllm.v1.core.sched.scheduler as where
from vllm.config import VllmConfig
from vllm.multimodal import MULTIMODAL_REGISTRY, MultiModalRegistry
from vllm.v1.core.sched.async_scheduler import AsyncScheduler as VllmAsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.structured_output import StructuredOutputManager

from .handoff import hand_off
from .input_thread import install as install_hasher
from .manager import KVCacheManager

__all__ = ["AsyncScheduler", "Scheduler"]


_BUILDING = threading.Lock()


def _build(scheduler: Any, construct: Callable[[], None]) -> None:
    """Run vLLM's constructor (``construct``) with prefixkv's manager under vLLM's name."""
    with _BUILDING:
        original = getattr(where, "KVCacheManager")  # noqa: B009 (not re-exported there)
        setattr(where, "KVCacheManager", KVCacheManager)  # noqa: B010
        try:
            construct()
        finally:
            setattr(where, "KVCacheManager", original)  # noqa: B010
    manager = getattr(scheduler, "kv_cache_manager", None)
    if isinstance(manager, KVCacheManager):
        install_hasher()
        if manager.enable_kv_cache_events:
            manager.hands_off_events = hand_off(getattr(scheduler, "kv_event_publisher", None))


class Scheduler(VllmScheduler):
    """vLLM 0.33.0's ``Scheduler`` whose KV cache manager is prefixkv's
    (``prefixkv.integrations.vllm.KVCacheManager``), built with vLLM's constructor
    arguments; every other call is vLLM's own. Raises ``UnsupportedByPrefixKV`` (a
    ``ConfigError``) at construction for a cache layout or option prefixkv does not
    offer (docs/integration.md, "With vLLM"). Construction swaps the manager class vLLM's
    scheduler module names, so constructions in one process take a lock, one at a time;
    a built scheduler is, like vLLM's, driven by one thread."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                 structured_output_manager: StructuredOutputManager, block_size: int,
                 hash_block_size: int | None = None, mm_registry: MultiModalRegistry = MULTIMODAL_REGISTRY,
                 include_finished_set: bool = False, log_stats: bool = False) -> None:
        """vLLM 0.33.0's ``Scheduler`` signature (vLLM's engine passes every argument by
        keyword), stated here: a wrong one's TypeError names this class."""
        _build(self, lambda: VllmScheduler.__init__(
            self, vllm_config, kv_cache_config, structured_output_manager, block_size,
            hash_block_size, mm_registry, include_finished_set, log_stats))


class AsyncScheduler(VllmAsyncScheduler):
    """vLLM 0.33.0's ``AsyncScheduler`` whose KV cache manager is prefixkv's: the class
    to name unless vLLM runs with ``--no-async-scheduling`` (vLLM 0.33 schedules
    asynchronously by default); otherwise as ``Scheduler``."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                 structured_output_manager: StructuredOutputManager, block_size: int,
                 hash_block_size: int | None = None, mm_registry: MultiModalRegistry = MULTIMODAL_REGISTRY,
                 include_finished_set: bool = False, log_stats: bool = False) -> None:
        """As ``Scheduler``'s (stated here: a wrong argument's TypeError names this class)."""
        _build(self, lambda: VllmAsyncScheduler.__init__(
            self, vllm_config, kv_cache_config, structured_output_manager, block_size,
            hash_block_size, mm_registry, include_finished_set, log_stats))

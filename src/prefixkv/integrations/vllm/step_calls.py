"""The calls vLLM's scheduler makes once a step on its ``KVCacheManager``: the step's
start, its stats and KV events, the blocks to zero (zeroing.py), and the per-step calls
of Mamba's copies and offloads, which prefixkv answers with nothing to do.

``StepCalls`` is the base of manager.py's ``KVCacheManager``, which builds what these
calls read: prefixkv's manager (``core``), the Mamba groups' step cache (mamba.py) and the
stats and events (telemetry.py).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.kv_cache_utils import KVCacheBlock, KVCacheBlockCopy
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import Request

from .mamba import StepCache
from .telemetry import Telemetry
from .zeroing import Zeroing

__all__ = ["StepCalls"]


class StepCalls:
    """vLLM's per-step ``KVCacheManager`` calls over what the manager built (its
    ``__init__``: manager.py)."""

    core: Any
    """prefixkv's manager (``layout.build_core``)."""
    hands_off_events: bool
    """Set by prefixkv's Scheduler when vLLM's publisher builds the events (handoff.py)."""
    _mamba: StepCache
    _telemetry: Telemetry
    _zeroes: Zeroing | None
    """The blocks vLLM's worker zeroes (zeroing.py); None where it zeroes none."""

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The stats gathered since ``make_prefix_cache_stats`` last ran (None without
        ``log_stats``)."""
        return self._telemetry.prefix_cache_stats

    def new_step_starts(self) -> None:
        """A step begins: prefixkv's per-step plan is drained (no copies are ever planned:
        vLLM's scheduler forks nothing), and the Mamba states cached in the last one are
        forgotten (mamba.py)."""
        self.core.take_kv_ops()
        self._mamba.clear()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """vLLM's PrefixCacheStats since the previous call; None without ``log_stats``."""
        return self._telemetry.make_prefix_cache_stats()

    def take_events(self) -> list[Any]:
        """KV events since the previous call as vLLM's ``KVCacheEvent`` objects (empty
        unless ``enable_kv_cache_events``). With ``hands_off_events`` (prefixkv's
        ``Scheduler`` sets it when vLLM's ``ZmqEventPublisher`` will build them, and no
        ``metrics_collector`` needs them now), a ``PendingVllmEvents`` that the
        publisher's thread builds: the chain hashes are not computed here."""
        return self._telemetry.take_events(self.hands_off_events)

    # ---- zeroing (zeroing.py) ----------------------------------------------------------------

    def take_new_block_ids(self) -> list[int]:
        """The attention groups' blocks taken since the last call, which vLLM's worker
        zeroes when ``needs_kv_cache_zeroing`` (a load's left out where it writes them);
        [] otherwise."""
        return self._zeroes.take() if self._zeroes else []

    # (record_blocks_for_zeroing, which reads a request's blocks: manager.py)

    # ---- Mamba's per-step calls: nothing to do --------------------------------------------

    def take_kv_cache_block_copies(self) -> tuple[list[KVCacheBlockCopy], list[KVCacheBlock]]:
        """No copies: prefixkv never shares a partial block with vLLM's scheduler."""
        return [], []

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """{}: boundary states are Mamba's."""
        return {}

    def finalize_partial_tail_offloads(self, request: Request) -> list[tuple[int, int, int]]:
        """[]: partial tails are Mamba's."""
        return []

"""The calls vLLM's scheduler makes once a step on its ``KVCacheManager``: the step's
start, its stats and KV events, the blocks to zero (zeroing.py), and the per-step calls
of Mamba's copies and offloads: its offloads are the states offered to a connector
(offloads.py), and its copies are the copies on write of vLLM's fine-grained partial hits
(groups/partial.py), handed out with the blocks they hold (``CowCopies``) and given back
through ``block_pool.free_blocks``.

``StepCalls`` is the base of manager.py's ``KVCacheManager``, which builds what these
calls read: prefixkv's manager (``core``), the Mamba groups' step cache (mamba.py) and the
stats and events (telemetry.py).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from vllm.v1.core.kv_cache_utils import KVCacheBlock, KVCacheBlockCopy
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import Request

from prefixkv.errors import RequestError
from prefixkv.groups.results import GroupBlockCopy

from .mamba import StepCache
from .pool import Blocks
from .telemetry import Telemetry
from .zeroing import Zeroing

__all__ = ["CowCopies", "StepCalls"]


class CowCopies:
    """The copies on write prefixkv's manager queued, until vLLM takes them, and the
    blocks of those it took, until vLLM gives them back (each a fresh ``KVCacheBlock``
    whose ``ref_cnt`` 1 is the hold it hands back, named by the object, as popped.py's)."""

    def __init__(self, blocks: Blocks) -> None:
        self._blocks = blocks
        self.queued: list[GroupBlockCopy] = []
        self._held: dict[int, tuple[GroupBlockCopy, list[KVCacheBlock]]] = {}  # id(block) ->

    def hand_out(self, ops: Sequence[GroupBlockCopy]) -> tuple[list[KVCacheBlockCopy], list[KVCacheBlock]]:
        """vLLM's copies of ``ops`` and the blocks they hold (each copy's source, then its copy)."""
        k = self._blocks.offset
        copies, held = [], []
        for op in ops:
            pair = [KVCacheBlock(op.src + k, ref_cnt=1), KVCacheBlock(op.dst + k, ref_cnt=1)]
            for b in pair:
                self._held[id(b)] = (op, pair)
            copies.append(KVCacheBlockCopy(src_block_id=op.src + k, dst_block_id=op.dst + k))
            held += pair
        return copies, held

    def split(self, blocks: Sequence[KVCacheBlock]) -> tuple[list[KVCacheBlock], list[KVCacheBlock]]:
        """``blocks`` cut into those copies hold and the rest. Raises RequestError, before
        any change, when a copy's two blocks do not come back together."""
        mine = [b for b in blocks if id(b) in self._held]
        given = {id(b) for b in mine}
        if any(id(x) not in given for b in mine for x in self._held[id(b)][1]):
            raise RequestError("the two blocks a copy on write holds go back together")
        return mine, [b for b in blocks if id(b) not in given]

    def take_back(self, blocks: Sequence[KVCacheBlock]) -> list[GroupBlockCopy]:
        """Forget ``blocks`` (checked by ``split``); their copies, in order, once each."""
        ops: list[GroupBlockCopy] = []
        for b in blocks:
            op = self._held.pop(id(b))[0]
            if op not in ops:
                ops.append(op)
        return ops


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
    _copies: CowCopies
    _keys: dict[Hashable, int]
    """vLLM's request id -> prefixkv's id of the live request (manager.py)."""

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The stats gathered since ``make_prefix_cache_stats`` last ran (None without
        ``log_stats``)."""
        return self._telemetry.prefix_cache_stats

    def new_step_starts(self) -> None:
        """A step begins: prefixkv's per-step plan is drained into the copies on write
        vLLM has not taken yet (no other copy is ever planned: vLLM's scheduler forks
        nothing), and the Mamba states cached in the last one are forgotten (mamba.py)."""
        self._copies.queued += self.core.take_kv_ops()
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

    # ---- Mamba's per-step calls: copies on write, offers (offloads.py) ---------------------

    def take_kv_cache_block_copies(self) -> tuple[list[KVCacheBlockCopy], list[KVCacheBlock]]:
        """The copies on write since the previous call (vLLM's fine-grained partial hits:
        a Mamba state found inside its block, groups/partial.py), and the blocks they
        hold, each copy's source then its copy, which vLLM's scheduler gives back with
        ``block_pool.free_blocks`` once the copy ran. None without partial hits."""
        ops = self._copies.queued + self.core.take_kv_ops()
        self._copies.queued = []
        return self._copies.hand_out(ops)

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """The Mamba states offered to a connector since the previous call, drained:
        ``{request id: [(group, block id, boundary tokens), ...]}``, as vLLM's
        (offloads.py: each block a Mamba group cached, under the tokens whose state it
        holds, and each partial tail's copy); {} without Mamba groups or caching. A
        request that left took its offers with it. No block is held for an offer."""
        return self._mamba.offers.take(self._keys)

    def finalize_partial_tail_offloads(self, request: Request) -> list[tuple[int, int, int]]:
        """The request's partial tails (its own entry at its prompt's last hash boundary
        inside a Mamba block, not yet moved to a copy), consumed: ``[(group, block id,
        boundary tokens)]`` when it computed exactly up to them and has no token in
        flight, else [] (offloads.py); as vLLM's, which its scheduler calls for a
        producer's finished request before freeing it."""
        return self._mamba.offers.finalize(request, self._keys.get(request.request_id))

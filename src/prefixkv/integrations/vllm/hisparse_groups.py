"""What vLLM's scheduler, its HiSparse connector and its tests read of a HiSparse
manager's insides, answered from prefixkv's ``HiSparseState``: the group managers
(``coordinator.single_type_managers``: the source on the host pool, the indexer, the
resident row, the hot region; the seam reaches the last three and the source as vLLM's
``host_manager``, ``resident_managers`` and ``hot_managers``), the coordinator's count of
blocks a request needs, and the two pools (``block_pool``: the device pool, which other
users may take blocks from and give them back to; the host pool, read-only).
Whatever else of vLLM's objects is read raises UnsupportedByPrefixKV naming it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, NoReturn

from vllm.v1.core.kv_cache_utils import KVCacheBlock

from prefixkv.errors import RequestError

from .coordinator import GroupView
from .layout import UnsupportedByPrefixKV

if TYPE_CHECKING:
    from prefixkv.groups.hisparse.state import HiSparseState

    from .hisparse_manager import HiSparseKVCacheManager

__all__ = ["HOST", "HOT", "INDEXER", "RESIDENT", "CoordinatorView", "DevicePoolView", "HostPoolView",
           "refused"]

HOST, INDEXER, RESIDENT, HOT = range(4)


def refused(what: str) -> NoReturn:
    """Raise UnsupportedByPrefixKV naming ``what``."""
    raise UnsupportedByPrefixKV(f"prefixkv's HiSparse manager does not serve {what} (it serves "
                                f"one resident and one hot group, no external loads; docs/integration.md, "
                                f"\"HiSparse\")")


class _PoolView:
    """A pool's free count, usage and block objects (``blocks``: vLLM's, one per id,
    block 0 the null block); other attributes refused by name."""

    enable_caching = False
    metrics_collector = None

    def __init__(self, state: HiSparseState, blocks: list[KVCacheBlock], name: str) -> None:
        self._state, self.blocks, self._name = state, blocks, name
        self.num_gpu_blocks = len(blocks)
        self.null_block = blocks[0]
        self.taken: dict[int, Any] = {}  # block id -> prefixkv's block, taken by another user

    def _pool(self) -> Any:
        raise NotImplementedError

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """``num_blocks`` free blocks for another user (vLLM's order: never used ones
        first, then the oldest free; an unpinned page taken is lost to its request).
        Raises RequestError when fewer are free (nothing changed)."""
        if num_blocks.__class__ is not int or not 0 <= num_blocks <= self._free():
            raise RequestError(f"cannot take {num_blocks!r} blocks, {self._free()} are free")
        got = self._pool().take(num_blocks)
        self.taken.update((b.block_id, b) for b in got)
        return [self.blocks[b.block_id] for b in got]

    other: _PoolView | None = None  # (the host pool's view, beside the device pool's)

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Give back blocks ``get_new_blocks`` (or ``pop_blocks_for_free``) handed out, in
        the order given; the other pool's among them (the host pool's, beside the device
        pool's) go back there after this pool's, as vLLM's. Raises RequestError, nothing
        changed, for any other block."""
        given, other = list(blocks), self.other
        theirs = [b for b in given if other is not None and b.block_id < len(other.blocks)
                  and other.blocks[b.block_id] is b]
        other_ids = {id(b) for b in theirs}
        mine = [b for b in given if id(b) not in other_ids]
        for view, group in ((self, mine), (other, theirs)):
            ids = [b.block_id for b in group]
            if view is not None and (len(set(ids)) != len(ids) or any(
                    view.taken.get(i) is None or view.blocks[i] is not b
                    for i, b in zip(ids, group, strict=True))):
                raise RequestError(f"blocks {ids} were not all taken with get_new_blocks (or are "
                                   "given twice)")
        self._pool().free([self.taken.pop(b.block_id) for b in mine])
        if other is not None and theirs:
            other._pool().free([other.taken.pop(b.block_id) for b in theirs])

    def _free(self) -> int:
        raise NotImplementedError

    def get_num_free_blocks(self) -> int:
        """Free blocks (unpinned pages counted, as vLLM's)."""
        return self._free()

    def get_usage(self) -> float:
        """Fraction of the blocks (the null block left out) in use."""
        return 1.0 - self._free() / (self.num_gpu_blocks - 1)

    def evict_blocks(self, block_ids: set[int]) -> None:
        """These blocks' content is findable no more (caching on; RequestError, nothing
        changed, unless the pool's block ids)."""
        evict = getattr(self._state, "evict", None)
        if evict is None:
            refused(f"{self._name}.evict_blocks (caching off: nothing is cached)")
        evict(sorted(block_ids), "host" if isinstance(self, HostPoolView) else "device")

    def __getattr__(self, name: str) -> Any:
        refused(f"{self._name}.{name}")


class HostPoolView(_PoolView):
    """The host pool (``coordinator.get_host_block_pool()`` in vLLM's): its counts, and
    blocks other users take and give back."""

    def _free(self) -> int:
        return self._state.host.num_free

    def _pool(self) -> Any:
        return self._state.host


class DevicePoolView(_PoolView):
    """The device pool (``manager.block_pool``): its counts, and blocks other users take
    (``get_new_blocks``) and give back (``free_blocks``) beside the requests', as from
    vLLM's ``BlockPool``."""

    def __init__(self, state: HiSparseState, blocks: list[KVCacheBlock]) -> None:
        super().__init__(state, blocks, "block_pool")

    def _free(self) -> int:
        return self._state.device.num_free

    def _pool(self) -> Any:
        return self._state.device

    def take_events(self) -> list[Any]:
        """None: nothing is cached, KV events are refused at construction."""
        return []

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Another user holds these blocks too, until ``free_blocks`` (vLLM's ``touch``: a
        free one leaves the free queue, its content kept). RequestError, nothing changed,
        for the null block, an unpinned one, one another user holds, or a repeat."""
        given = list(blocks)
        ids = [b.block_id for b in given]
        device = self._state.device
        if len(set(ids)) != len(ids) or any(
                not 0 < i < self.num_gpu_blocks or self.blocks[i] is not b or i in self.taken
                or i in device.unpinned for i, b in zip(ids, given, strict=True)):
            raise RequestError(f"cannot touch blocks {ids}: the null block, unpinned ones, ones "
                               "another user holds, or repeated")
        got = device.acquire([device.blocks[i] for i in ids], 0)
        self.taken.update((b.block_id, b) for b in got)


class _GroupView(GroupView):
    """A group as vLLM's HiSparse manager of it shows it: ``coordinator``, the seam
    (vLLM sets it on its source, resident and hot managers), ``req_to_blocks``."""

    def __init__(self, manager: HiSparseKVCacheManager, group_id: int, spec: Any, seam: Any) -> None:
        super().__init__(manager, group_id, spec.block_size, spec)
        self.coordinator = None if group_id == INDEXER else seam
        self._hisparse = manager

    @property
    def block_pool(self) -> Any:
        """The host pool for the source group, else the device pool."""
        m = self._hisparse
        return m.host_pool if self.kv_cache_group_id == HOST else m.block_pool

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, new_computed_blocks: Any,
                                   total_computed_tokens: int, num_local_computed_tokens: int,
                                   num_tokens_main_model: int, apply_admission_cap: bool = False,
                                   prefill_end: int = 0) -> int:
        """vLLM's count of this group for the request (hisparse_counts.py; read-only)."""
        from .hisparse_counts import group_need
        return group_need(self._hisparse, self.kv_cache_group_id, request_id, num_tokens, new_computed_blocks,
                          total_computed_tokens, num_local_computed_tokens, apply_admission_cap)

    @property
    def req_to_blocks(self) -> dict[str, list[Any]]:
        """Each live request's blocks in this group, a snapshot (``GroupView``'s rows follow
        the plain manager's tables, which this manager does not keep)."""
        m, g = self._hisparse, self.kv_cache_group_id
        return {rid: list(m.get_blocks(rid).blocks[g]) for rid in m.live_request_ids()}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        refused(f"the {type(self.kv_cache_spec).__name__} group's {name}")


class ResidentGroupView(_GroupView):
    """The resident row (vLLM's ``HiSparseResidentManager``): ``req_to_blocks`` as
    allocated, and the residency row (the null block where a page is read from host)."""

    def get_residency_row(self, request_id: str, start: int = 0) -> list[KVCacheBlock]:
        """The request's row from page ``start``, the null block for a page lost to host."""
        state = self._hisparse.state
        row = state.request(request_id)[2] if state.holds(request_id) else []
        return [self._hisparse.block_pool.blocks[i] for i in row[start:]]

    def get_resident_page(self, request_id: str, block_idx: int) -> KVCacheBlock | None:
        """The block page ``block_idx`` is read from on the device; None from host or past the row."""
        row = self.get_residency_row(request_id)
        return None if block_idx >= len(row) or row[block_idx].is_null else row[block_idx]


class HotGroupView(_GroupView):
    """The hot region (vLLM's ``HiSparseHotManager``): whether a request holds it or is
    asked to take it."""

    @property
    def blocks_per_request(self) -> int:
        """The hot region's blocks."""
        return self._hisparse.state.hot_blocks

    def has_hot(self, request_id: str) -> bool:
        """Whether the request holds its whole hot region."""
        state = self._hisparse.state
        return state.holds(request_id) and len(state.request(request_id)[3]) == state.hot_blocks

    @property
    def hot_required(self) -> frozenset[str]:
        """The live requests asked to take their hot region (a snapshot)."""
        state = self._hisparse.state
        return frozenset(r for r in self._hisparse.live_request_ids() if state.request(r)[4])

    def require_hot(self, request_id: str) -> None:
        """The live request takes its hot region with its next allocation. Raises
        UnsupportedByPrefixKV for a request holding no blocks (nothing changed)."""
        if not self._hisparse.state.holds(request_id):
            refused(f"require_hot for a request holding no blocks ({request_id!r})")
        self._hisparse.state.require_hot(request_id)


def group_views(manager: HiSparseKVCacheManager, specs: tuple[Any, ...], seam: Any) -> tuple[_GroupView, ...]:
    """The four groups' views, in vLLM's order."""
    kinds = (_GroupView, _GroupView, ResidentGroupView, HotGroupView)
    return tuple(kind(manager, g, s, seam) for g, (kind, s) in enumerate(zip(kinds, specs, strict=True)))


class CoordinatorView:
    """What vLLM's scheduler and connector read of the coordinator: the group views, the
    block size, and how many device blocks a request needs (``get_num_blocks_to_allocate``)."""

    enable_partial_hash_hits = False
    eagle_group_ids: tuple[int, ...] = ()
    retention_interval = None

    def __init__(self, manager: HiSparseKVCacheManager, specs: tuple[Any, ...], seam: Any) -> None:
        self._manager = manager
        self.block_size = self.scheduler_block_size = specs[0].block_size
        self.num_reprefillable_tokens = manager.state.reprefill
        self.single_type_managers = group_views(manager, specs, seam)

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, new_computed_blocks: Any,
                                   num_encoder_tokens: int, total_computed_tokens: int,
                                   num_local_computed_tokens: int, num_tokens_main_model: int,
                                   apply_admission_cap: bool = False, prefill_end: int = 0) -> int:
        """vLLM's count for the request (new or not) to cover ``num_tokens`` tokens
        (``HiSparseState.need``; the row capped at the admission window with
        ``apply_admission_cap``; when ``total_computed_tokens`` include external ones,
        an import's: ``HiSparseState.need``; with hit blocks or a new request's computed
        tokens, hisparse_counts.py's, read-only). UnsupportedByPrefixKV for encoder tokens."""
        state = self._manager.state
        if num_encoder_tokens:
            refused("encoder tokens")
        if any(new_computed_blocks) or (num_local_computed_tokens and not state.holds(request_id)):
            from .hisparse_counts import need
            return need(self._manager, request_id, num_tokens, new_computed_blocks, total_computed_tokens,
                        num_local_computed_tokens, apply_admission_cap)
        if total_computed_tokens > num_local_computed_tokens:
            return state.need(request_id, num_tokens, imported=total_computed_tokens)
        return state.need(request_id, num_tokens, cap=apply_admission_cap)

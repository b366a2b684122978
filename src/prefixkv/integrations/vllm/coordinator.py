"""The ``coordinator`` attribute of the manager: what vLLM's scheduler reads of vLLM's
``KVCacheCoordinator`` (its per-group managers' block size and spec, whether partial
hash hits are on, and how many blocks a request still needs), answered from prefixkv.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from ...core.block import blocks_for
from .checkpoints import prefill_end, reserved, running, step_blocks
from .layout import Layout
from .per_group import PerGroupHits
from .retention_setter import set_retention_interval

if TYPE_CHECKING:
    from .manager import KVCacheManager

__all__ = ["CoordinatorView", "GroupView", "LiveRow"]


class LiveRow(list[Any]):
    """A live request's blocks in one group as vLLM's ``req_to_blocks`` holds them: a
    list that follows the request's table while the request lives (vLLM's grows, and
    turns entries null, in place; a reader holding it sees that), then keeps what it
    showed last. Read-only (what it reads is prefixkv's table)."""

    __slots__ = ("_manager", "_request_id", "_group", "_key")

    def __init__(self, manager: KVCacheManager, request_id: str, group: int) -> None:
        super().__init__()
        self._manager, self._request_id, self._group = manager, request_id, group
        self._key = manager._keys.get(request_id)
        self._sync()

    def _sync(self) -> None:
        m = self._manager
        if self._key is not None and m._keys.get(self._request_id) == self._key:
            list.__setitem__(self, slice(None), m.get_blocks(self._request_id).blocks[self._group])


def _synced(name: str) -> Any:
    """``list``'s ``name`` on a ``LiveRow``, read after it caught up with the table."""
    read = getattr(list, name)

    def call(self: LiveRow, *args: Any) -> Any:
        self._sync()
        return read(self, *args)

    call.__name__ = name
    return call


for _name in ("__getitem__", "__len__", "__iter__", "__reversed__", "__contains__", "__eq__", "__ne__",
              "__repr__", "index", "count"):
    setattr(LiveRow, _name, _synced(_name))


class GroupView:
    """One group, as vLLM's ``SingleTypeKVCacheManager`` shows it: ``block_size``,
    ``kv_cache_spec``, the shared ``block_pool``, and read-only views of prefixkv's state in vLLM's shapes
    (``req_to_blocks``: live request id -> its blocks in this group, each a ``LiveRow``;
    ``num_cached_block``: live request id -> its cached full blocks, a snapshot;
    ``_null_block``; ``cache_hit_alignment_tokens``, the coordinator's; ``_checkpoints``:
    live request id -> its step's Mamba checkpoint ``(c, j)``, a snapshot), which vLLM's
    tests inspect."""

    retains_longer_hit = False

    def __init__(self, manager: KVCacheManager, group_id: int, block_size: int, spec: Any) -> None:
        self._manager = manager
        self.kv_cache_group_id = group_id
        self.block_size = block_size
        self.kv_cache_spec = spec

    @property
    def block_pool(self) -> Any:
        """The manager's ``block_pool`` (vLLM's single-type managers share one pool; a
        connector asks it about a group's hashes through them)."""
        return self._manager.block_pool

    @property
    def _null_block(self) -> Any:
        """vLLM's null block, the entry of ``req_to_blocks`` where a window released a
        block (the name vLLM's manager keeps it under, which its tests read)."""
        return self._manager.block_pool.null_block

    @property
    def req_to_blocks(self) -> dict[str, list[Any]]:
        m, g = self._manager, self.kv_cache_group_id
        return {rid: LiveRow(m, rid, g) for rid in m.live_request_ids()}

    @property
    def num_cached_block(self) -> dict[str, int]:
        m = self._manager
        return {rid: m.num_cached_tokens(rid) // self.block_size for rid in m.live_request_ids()}

    @property
    def cache_hit_alignment_tokens(self) -> int:
        """The unit of the hits (the coordinator's ``_cache_hit_alignment_tokens``, which
        vLLM's coordinator gives each of its managers)."""
        return int(self._manager.coordinator._cache_hit_alignment_tokens)

    @property
    def _checkpoints(self) -> Mapping[str, tuple[int, int]]:
        """vLLM's ``MambaManager._checkpoints``: live request id -> the chunk-end
        checkpoint ``(position, table entry)`` its last step reserved in this group
        (checkpoints.reserved), read-only; empty where the group takes none."""
        return MappingProxyType(reserved(self._manager, self.kv_cache_group_id))


class CoordinatorView:
    """vLLM's coordinator questions about the manager's requests and groups, and what
    it resolved of the layout: ``scheduler_block_size``, whether vLLM's fine-grained
    partial hits are on (``enable_partial_hash_hits``: ``layout.sizes.partial``) and the
    alignment of hits that follows (``_cache_hit_alignment_tokens``, the name vLLM's
    tests read), vLLM's ``retention_interval`` (the manager's, retention.py), and each
    group's own hit (``find_longest_cache_hit_per_group``: per_group.py)."""

    def __init__(self, manager: KVCacheManager, layout: Layout) -> None:
        self._manager = manager
        self._sparse = tuple(g.sparse for g in layout.groups)  # (Mamba: one block per step)
        self._num_sparse = sum(self._sparse)
        self._num_dense = len(self._sparse) - self._num_sparse
        self._ahead = tuple(g.ahead for g in layout.groups)  # (speculative blocks past a row's end)
        self.block_size = self.scheduler_block_size = layout.block_size
        self.enable_partial_hash_hits = layout.sizes.partial
        self._cache_hit_alignment_tokens = layout.sizes.unit
        self._sizes = layout.sizes.sizes  # (each group's own block size)
        self._checkpoints = layout.sizes  # (Mamba's checkpoint blocks, when ``checkpoints``)
        self._one_size = layout.sizes.one_size and not layout.sizes.checkpoints  # (short_of_blocks' count)
        self.single_type_managers = tuple(GroupView(manager, g, self._sizes[g], spec)
                                          for g, spec in enumerate(layout.specs))
        self.eagle_group_ids: tuple[int, ...] = ()
        self.num_reprefillable_tokens = 0
        self._per_group = PerGroupHits(manager, layout)

    def find_longest_cache_hit_per_group(self, block_hashes: Sequence[bytes], max_cache_hit_length: int
                                         ) -> tuple[tuple[list[Any], ...], tuple[int, ...]]:
        """vLLM's: per group, the blocks and tokens of the longest hit that group alone
        finds on ``block_hashes`` within ``max_cache_hit_length`` (per_group.py, which
        says where it is served; UnsupportedByPrefixKV elsewhere). Changes nothing."""
        return self._per_group.find(block_hashes, max_cache_hit_length)

    @property
    def retention_interval(self) -> int | None:
        """vLLM's ``prefix_cache_retention_interval``, the manager's (retention.py). Set:
        the manager is built again with it while it holds nothing, else refused
        (retention_setter.py)."""
        return self._manager.retention_interval

    @retention_interval.setter
    def retention_interval(self, interval: int | None) -> None:
        set_retention_interval(self._manager, interval)

    def blocks_to_grow(self, key: int, num_tokens: int) -> int:
        """Blocks from the pool that covering ``num_tokens`` positions of the live request
        ``key`` takes (net of what a window releases, for a hybrid manager)."""
        core = self._manager.core
        if hasattr(core, "num_blocks_to_allocate"):
            return int(core.num_blocks_to_allocate(key, max(num_tokens, core.num_scheduled_tokens(key))))
        held = len(core.get_block_ids(key))
        return max(0, blocks_for(num_tokens, self.block_size) - held)

    def short_of_blocks(self, key: int, num_tokens: int, keep: int, request: Any = None) -> bool:
        """Whether covering ``num_tokens`` positions of the live request ``key`` would
        leave fewer than ``keep`` blocks free, as vLLM's ``allocate_slots`` decides it:
        the blocks a window releases at the step's start count as free first (vLLM
        frees them before it counts), so a step may fit with fewer than ``keep`` free
        now when its release returns more than it takes."""
        core, bs = self._manager.core, self.block_size
        covered = max(num_tokens, core.num_scheduled_tokens(key))
        if self._one_size:
            # (blocks held: counted, not listed, with one group; a decode step's check is O(1))
            held = len(core.get_block_ids(key)[0]) - self._ahead[0] if self._manager._hybrid \
                else core.num_blocks_held(key)
            per_group = max(0, blocks_for(covered, bs) - held)
            need = per_group * self._num_dense + min(per_group, 1) * self._num_sparse
        else:  # (each group at its own size; a Mamba group takes one block at most)
            need = 0
            for sparse, b, ids, a in zip(self._sparse, self._sizes, core.get_block_ids(key), self._ahead,
                                         strict=True):
                more = max(0, blocks_for(covered, b) + a - len(ids))
                need += min(1, more) if sparse else more
            if self.enable_partial_hash_hits:  # (an owned partial entry moves: groups/partial.py)
                need += core.num_pending_copies(key)
            if self._checkpoints.checkpoints:  # (one more block where a step checkpoints)
                rows = running(core.get_block_ids(key), self._ahead)  # (blocks ahead: empty entries)
                need += step_blocks(self._checkpoints, self._sparse, rows, core.num_scheduled_tokens(key),
                                    covered, core.null_block_id,
                                    prefill_end(self.retention_interval, request),
                                    self._manager._tail_gap)
        released: int = core.num_blocks_released(key) if self._manager._hybrid else 0
        return need > int(core.num_free_blocks) + released - keep

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[Sequence[Any]], num_encoder_tokens: int,
                                   total_computed_tokens: int, num_local_computed_tokens: int,
                                   num_tokens_main_model: int, apply_admission_cap: bool = False,
                                   prefill_end: int = 0) -> int:
        """Blocks the request needs from the pool to cover ``num_tokens`` positions: for a
        live request, beyond those it holds; for a new one, every group's blocks less
        the hit's (``new_computed_blocks``) and with a group's speculative blocks
        (``GroupSpec.ahead``); a Mamba group takes one block at most, and one more where
        the step checkpoints (checkpoints.py)."""
        key = self._manager.key_of(request_id)
        if key is not None:
            return self.blocks_to_grow(key, num_tokens)
        hits = [len(h) for h in new_computed_blocks] + [0] * (len(self._sparse) - len(new_computed_blocks))
        fresh = [max(0, blocks_for(num_tokens, b) + a - h) for h, b, a in zip(hits, self._sizes, self._ahead,
                                                                               strict=False)]
        marks = step_blocks(self._checkpoints, self._sparse, ((),) * len(self._sparse), total_computed_tokens,
                            num_tokens_main_model, None, prefill_end if self.retention_interval == 0 else 0,
                            self._manager._tail_gap) \
            if self._checkpoints.checkpoints else 0
        return sum(1 + a if sparse and n > a else n for n, sparse, a in zip(fresh, self._sparse, self._ahead,
                                                                           strict=False)) + marks

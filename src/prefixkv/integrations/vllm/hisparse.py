"""vLLM 0.33's ``HiSparseCoordinator`` answered from prefixkv's HiSparse state
(``groups.hisparse.state.HiSparseState``): the seam (docs/integration.md, "HiSparse").
vLLM's scheduler, its HiSparse connector and its tests reach the coordinator through
``get_hisparse_coordinator``, which returns the ``coordinator`` attribute of one of the
manager's group managers once it is a ``HiSparseCoordinator``; ``HiSparseSeam`` is one,
whose ``__init__`` builds prefixkv's state and none of vLLM's.

Served, in the scope of that state (prefix caching on or off: groups/hisparse/cache.py's
with it; one resident and one hot group): ``advance_scheduled``,
``build_offload_command``, ``update_spills``, ``has_pending_work``,
``has_pending_reclamation``, ``all_context_pages_resident``, ``take_residency_updates``,
``build_row_mirrors``, ``pending_spills`` (read-only), the end of an external load
(``finish_host_import``, ``complete_host_import`` for a pending one; ``request_states``,
read-only: hisparse_imports.py), the host copies the scope has none of
(``take_host_block_copies``, ``release_completed_host_copies``), what vLLM's tests read or
set (``copies``, a snapshot; ``spills_to_send``; ``max_spill_pages``, settable;
``gpu_pool``, ``transition_watermark``, ``plan_prefix_materialization``), and once bound to a manager
(hisparse_manager.py) ``get_host_block_pool``, ``host_manager``, ``resident_managers``
and ``hot_managers`` (hisparse_groups.py's views): every call vLLM's HiSparse connector
makes;
every other call of vLLM's coordinator, and every attribute it would read or set, raises
UnsupportedByPrefixKV naming it (a call may be replaced, as a test's monkeypatch does).
Checked against vLLM's coordinator side by side: tests/engines/test_vllm_hisparse_seam.py.
Bound to the plug-in's manager by hisparse_manager.py (its group views hold the seam).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NoReturn

from vllm.v1.core.kv_cache_utils import BlockHash, KVCacheBlockCopy, make_block_hash_with_group_id
from vllm.v1.hisparse.coordinator import HiSparseCoordinator
from vllm.v1.hisparse.types import (
    SparseKVOffloadCommand,
    SparseKVPageTransfer,
    SparseKVResidencyUpdate,
    SparseKVRowMirror,
)
from vllm.v1.kv_cache_interface import HiSparseHotSpec, HiSparseResidentSpec, KVCacheConfig, KVCacheGroupRole

from prefixkv.core.block import blocks_for
from prefixkv.errors import check_count
from prefixkv.groups.hisparse.cache import HiSparseCache
from prefixkv.groups.hisparse.state import HiSparseState

from .hisparse_imports import RequestStates
from .layout import UnsupportedByPrefixKV

__all__ = ["SERVED", "HiSparseSeam", "hisparse_state", "refuse_the_rest"]

SERVED = ("advance_scheduled", "build_offload_command", "update_spills", "has_pending_work",
          "has_pending_reclamation", "all_context_pages_resident", "take_residency_updates",
          "build_row_mirrors", "get_host_block_pool", "take_host_block_copies",
          "release_completed_host_copies", "finish_host_import", "complete_host_import")
_SCOPE = ("prefixkv's HiSparse serves one resident and one hot group "
          "(docs/integration.md, \"HiSparse\")")


def _refused(name: str) -> NoReturn:
    raise UnsupportedByPrefixKV(f"prefixkv's HiSparse coordinator does not serve {name}: {_SCOPE}")


def hisparse_state(kv_cache_config: KVCacheConfig, max_model_len: int, *, enable_caching: bool,
                   max_in_flight_tokens: int | None = None, num_prefill_lookahead: int = 0) -> HiSparseState:
    """The prefixkv state of a HiSparse layout as vLLM builds one (source group on the host
    pool, indexer, one resident and one hot group, one block size); UnsupportedByPrefixKV,
    naming it, for anything else."""
    groups = kv_cache_config.kv_cache_groups
    specs = [g.kv_cache_spec for g in groups]
    roles = [getattr(g, "role", None) for g in groups]
    sizes = {s.block_size for s in specs}
    if (len(groups) != 4 or roles[:2] != [KVCacheGroupRole.HISPARSE_SOURCE, KVCacheGroupRole.HISPARSE_INDEXER]
            or not isinstance(specs[2], HiSparseResidentSpec) or not isinstance(specs[3], HiSparseHotSpec)):
        _refused(f"this layout ({[type(s).__name__ for s in specs]}): only source, indexer, one "
                 "resident and one hot group")
    if len(sizes) != 1:
        _refused(f"block sizes {sorted(sizes)}")
    host = kv_cache_config.hisparse_host_num_blocks
    if host is None:
        _refused("a HiSparse layout without a host pool (hisparse_host_num_blocks)")
    bs = sizes.pop()
    in_flight = max_model_len if max_in_flight_tokens is None else max_in_flight_tokens
    hot = specs[3]
    assert isinstance(hot, HiSparseHotSpec)
    kind = HiSparseCache if enable_caching else HiSparseState
    return kind(kv_cache_config.num_blocks, host, hot.blocks_per_request, bs,
                blocks_for(min(in_flight, max_model_len), bs), max_model_len // bs,
                max(num_prefill_lookahead - 1, 0))


class HiSparseSeam(HiSparseCoordinator):
    """vLLM's coordinator over prefixkv's ``state`` (module doc); ``host_group_id``: the
    source group's index (0 in vLLM's layouts)."""

    _state: HiSparseState

    def __init__(self, state: HiSparseState, host_group_id: int = 0) -> None:  # (not vLLM's)
        object.__setattr__(self, "_state", state)
        object.__setattr__(self, "host_group_id", host_group_id)
        object.__setattr__(self, "_groups", None)
        object.__setattr__(self, "_known", set())  # the requests vLLM keeps bookkeeping of

    def bind(self, groups: Sequence[Any], host_pool: Any) -> None:
        """The manager's group views (source, indexer, resident, hot: hisparse_groups.py)
        and host pool view, which vLLM's coordinator reads as its managers and pool."""
        object.__setattr__(self, "_groups", (tuple(groups), host_pool))

    def _bound(self, name: str) -> tuple[tuple[Any, ...], Any]:
        if self._groups is None:
            _refused(f"{name} (no manager bound)")
        return self._groups  # type: ignore[no-any-return]

    @property
    def state(self) -> HiSparseState:
        """prefixkv's state behind the seam."""
        return self._state

    @property
    def host_manager(self) -> Any:
        """The source group's view (vLLM's ``HiSparseSourceManager``)."""
        return self._bound("host_manager")[0][self.host_group_id]

    @property
    def resident_managers(self) -> tuple[Any, ...]:
        """The resident group's view (vLLM's ``HiSparseResidentManager``)."""
        return self._bound("resident_managers")[0][2:3]

    @property
    def hot_managers(self) -> tuple[Any, ...]:
        """The hot group's view (vLLM's ``HiSparseHotManager``)."""
        return self._bound("hot_managers")[0][3:4]

    @property
    def pending_spills(self) -> Mapping[int, Any]:
        """The copies in flight, read-only: id -> (request, page)."""
        return self.state.spills.flight

    @property
    def request_states(self) -> Mapping[str, Any]:
        """Each request's residency bookkeeping as vLLM's, read-only (hisparse_imports.py's
        ``RequestStates``)."""
        return RequestStates(self.state, self._known)

    def admitted(self, request_id: str) -> None:  # (not vLLM's)
        """``request_id`` was admitted with a hit: vLLM's coordinator keeps its bookkeeping
        from now on (``commit_computed_blocks``)."""
        self._known.add(request_id)

    def forget(self, request_id: str) -> None:  # (not vLLM's)
        """``request_id`` was freed: it has no bookkeeping any more."""
        self._known.discard(request_id)

    @property
    def copies(self) -> dict[bytes, tuple[Any, ...]]:
        """The GPU copies of published host pages, a snapshot: vLLM's host block hash ->
        (its device block,) (empty with caching off)."""
        state, blocks = self.state, self._bound("copies")[0][2].block_pool.blocks
        return {make_block_hash_with_group_id(BlockHash(h), self.host_group_id): (blocks[b.block_id],)
                for h, b in getattr(state, "copies", {}).items()}

    @property
    def spills_to_send(self) -> list[int]:
        """The copies planned and not yet sent, a snapshot: their ids."""
        return list(self.state.spills.to_send)

    @property
    def max_spill_pages(self) -> int:
        """The most copies planned and not yet sent (may be set)."""
        return self.state.spills.max_pages

    @max_spill_pages.setter
    def max_spill_pages(self, n: int) -> None:
        self.state.spills.max_pages = check_count("max_spill_pages", n, 0, None)

    @property
    def gpu_pool(self) -> Any:
        """The device pool's view."""
        return self._bound("gpu_pool")[0][2].block_pool

    @property
    def transition_watermark(self) -> int:
        """The free count below which a row asks for its hot region."""
        return self.state.watermark

    def plan_prefix_materialization(self, request_id: str, num_computed_tokens: int) -> None:
        """Plan copies of the request's pages its first tokens seal (``HiSparseState.plan``)."""
        self.state.plan(request_id, num_computed_tokens)

    def get_host_block_pool(self) -> Any:
        """The host pool's view (its free count, usage, blocks)."""
        return self._bound("get_host_block_pool")[1]

    def take_host_block_copies(self) -> tuple[KVCacheBlockCopy, ...]:
        """(): host copies on write come from hits on the host prefix (caching on), not served."""
        return ()

    def release_completed_host_copies(self, dst_block_ids: Iterable[int]) -> None:
        """Nothing: no host copy is ever handed out (``take_host_block_copies``)."""

    def finish_host_import(self, request_id: str, *, failed: bool) -> None:
        """``request_id``'s external load ended (``HiSparseState.finish_import``: done, its
        whole pages are valid and its tail page's restore is planned); nothing for a
        request without a pending load."""
        if self.state.holds(request_id):
            self.state.finish_import(request_id, failed)
            if not failed:
                self._known.add(request_id)

    def complete_host_import(self, request_id: str, num_computed_tokens: int) -> None:
        """``finish_host_import`` done, for a request whose pending load is of
        ``num_computed_tokens`` tokens; UnsupportedByPrefixKV for any other (vLLM's would
        mark host pages valid that no load wrote)."""
        if self.state.imports.pending.get(request_id) != num_computed_tokens:
            _refused(f"complete_host_import({request_id!r}, {num_computed_tokens}) without a "
                     f"pending load of those tokens")
        self.finish_host_import(request_id, failed=False)

    def take_residency_updates(self, request_ids: Iterable[str]) -> dict[str, SparseKVResidencyUpdate]:
        """What the workers lack of each request's resident row: its pages lost since
        the last update, then those added since, with their block ids (0: read from
        host); requests with nothing new left out (``HiSparseState.take_residency``)."""
        out = {}
        for request_id in request_ids:
            got = self.state.take_residency(request_id)
            if self.state.holds(request_id):
                self._known.add(request_id)
            if got is not None:
                out[request_id] = SparseKVResidencyUpdate(pages=got[0], block_ids=(got[1],))
        return out

    def build_row_mirrors(self, requests: Iterable[tuple[str, int, int]]) -> tuple[SparseKVRowMirror, ...]:
        """For each (request, start, count): the spans of its positions ``start`` to
        ``start + count`` to copy from its resident pages to their host pages, a span per
        page (rows ``page * block_size + offset``); pages not on the device or past the
        rows left out, as requests holding no blocks."""
        state, bs = self.state, self.state.block_size
        out = []
        for request_id, start, count in requests:
            if not state.holds(request_id):
                continue
            host, _, row, _, _ = state.request(request_id)
            pos, end = start, start + count
            while pos < end:
                page, offset = divmod(pos, bs)
                n = min(bs - offset, end - pos)
                if page < len(row) and row[page] and page < len(host):
                    out.append(SparseKVRowMirror(source_starts=(row[page] * bs + offset,),
                                                 destination_start=host[page] * bs + offset, num_rows=n))
                pos += n
        return tuple(out)

    def advance_scheduled(self, requests: Iterable[tuple[str, int]]) -> None:
        """Each scheduled request's step to its number of tokens computed: copies planned,
        pages unpinned or the hot region asked for (``HiSparseState.advance``)."""
        for request_id, num_tokens in requests:
            self.state.advance(request_id, num_tokens)
            self._known.add(request_id)

    def build_offload_command(self) -> SparseKVOffloadCommand:
        """The copies planned since the last call: to host after the step's forward pass,
        an import's restore from host before it."""
        restores = self.state.imports.restores
        return SparseKVOffloadCommand(page_transfers=[
            SparseKVPageTransfer(transfer_id=t, host_block_id=host, resident_block_ids=(block,),
                                 after_forward=t not in restores, restore=t in restores)
            for t, block, host in self.state.take_copies()])

    def update_spills(self, enqueued_counts: Mapping[int, int], completed_counts: Mapping[int, int]) -> None:
        """The workers' reports on the copies (``HiSparseState.report``)."""
        self.state.report(enqueued_counts, completed_counts)

    def has_pending_work(self) -> bool:
        """Whether a copy is still to be sent or confirmed."""
        return self.state.spills.has_work()

    def has_pending_reclamation(self) -> bool:
        """Whether a copy in flight gives blocks back once confirmed (``HiSparseState.reclaims``):
        vLLM's scheduler then waits for it rather than preempt."""
        return self.state.reclaims()

    def all_context_pages_resident(self, requests: Iterable[tuple[str, int, int]]) -> bool:
        """Whether each (request, computed, scheduled) reads only pages on the device: its
        row covers the tokens and lost none of its pages."""
        state = self.state
        for request_id, num_computed_tokens, num_scheduled_tokens in requests:
            row = state.request(request_id)[2] if state.holds(request_id) else []
            pages = blocks_for(num_computed_tokens + num_scheduled_tokens, state.block_size)
            if len(row) < pages or 0 in row:
                return False
        return True

    def __getattr__(self, name: str) -> Any:
        _refused(name)

    def __setattr__(self, name: str, value: Any) -> None:
        """Only a call of the class may be replaced (a test's monkeypatch); setting any
        other attribute (vLLM's state) raises UnsupportedByPrefixKV naming it."""
        kind = getattr(type(self), name, None)
        if not callable(kind) and not (isinstance(kind, property) and kind.fset is not None):
            _refused(f"setting {name}")
        object.__setattr__(self, name, value)


def refuse_the_rest(cls: type, names: Iterable[str], refuse: Callable[[str], NoReturn]) -> None:
    """Give ``cls`` a method for each of ``names`` it does not define, which calls
    ``refuse(name)`` (UnsupportedByPrefixKV naming the call)."""
    def refusal(name: str) -> Any:
        def refused(self: Any, *args: Any, **kwargs: Any) -> NoReturn:
            refuse(name)
        refused.__name__ = refused.__qualname__ = name
        refused.__doc__ = f"Refused: UnsupportedByPrefixKV naming {name}."
        return refused

    for name in [n for n in names if not n.startswith("__") and n not in vars(cls)]:
        setattr(cls, name, refusal(name))


refuse_the_rest(HiSparseSeam, vars(HiSparseCoordinator), _refused)

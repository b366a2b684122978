"""HiSparse external (connector) loads into host pages, for vLLM 0.33's scheduler and
connectors, over prefixkv's ``HiSparseState`` (groups/hisparse/imports.py says the rules):
``allocate_slots`` with ``num_external_computed_tokens`` (a request's first allocation:
``load_slots``), the coordinator's count for an import (``import_need``), and what vLLM's
connectors and tests read of the coordinator's per-request bookkeeping
(``request_states``: ``RequestStates``, read-only).

Served: a load as a request's first allocation, with no hit and no computed token
before it; refused by name (UnsupportedByPrefixKV, nothing changed): external tokens for
a request holding blocks, and a step of a request whose load failed and which was not
freed (vLLM would recompute into pages it reads from host: a wrong KV). Checked against
vLLM's manager side by side: tests/engines/test_vllm_hisparse_imports.py.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.request import Request, RequestStatus

from prefixkv.core.block import blocks_for
from prefixkv.errors import check_count
from prefixkv.groups.hisparse.row import CLEAN, IN_FLIGHT, UNPINNED

from .hisparse_groups import refused

if TYPE_CHECKING:
    from prefixkv.groups.hisparse.state import HiSparseState

    from .hisparse_manager import HiSparseKVCacheManager

__all__ = ["RequestStateView", "RequestStates", "import_need", "load_slots"]


def load_slots(manager: HiSparseKVCacheManager, request: Request, num_new_tokens: int,
               a: dict[str, Any]) -> KVCacheBlocks | None:
    """``allocate_slots`` of a request's external load (``a``: its arguments by name,
    ``num_external_computed_tokens`` > 0): the host pages, the indexer's, the row's tail
    page and the hot region, all or nothing, under vLLM's checks (the full-sequence gate,
    the watermark for a waiting request, ``reserved_blocks``). Returns the blocks of the
    tokens past the import (vLLM's: the hot region, and any pages of new tokens), or None
    when short. UnsupportedByPrefixKV for a request holding blocks or with computed
    tokens; nothing changed."""
    rid, state = request.request_id, manager.state
    external = check_count("num_external_computed_tokens", a["num_external_computed_tokens"], 1, None)
    if state.holds(rid) or request.num_computed_tokens:
        refused(f"external tokens for a request holding blocks or computed tokens ({rid!r}, "
                f"{request.num_computed_tokens} computed)")
    max_len = manager.max_model_len
    imported = min(external, max_len)
    total = min(imported + num_new_tokens + a["num_lookahead_tokens"], max_len)
    keep = manager.watermark_blocks if a["has_scheduled_reqs"] and request.status in (
        RequestStatus.WAITING, RequestStatus.PREEMPTED) else 0
    free = state.device.num_free
    if a["full_sequence_must_fit"] and \
            state.need(rid, min(request.num_tokens, max_len), cap=True, imported=imported) + keep > free:
        return None
    if state.need(rid, total, imported=imported) + keep > free - a["reserved_blocks"]:
        return None
    loaded = state.load(rid, imported, total)
    assert loaded, "HiSparse blocks short for a load after the pools were checked"
    host, indexer, row, hot, _ = state.request(rid)
    manager._rows[rid] = list(row)
    past = blocks_for(imported, state.block_size)
    return manager._objects((host[past:], indexer[past:], row[past:], hot))


def import_need(state: HiSparseState, request_id: str, num_tokens: int, total_computed_tokens: int) -> int:
    """vLLM's count of device blocks for ``request_id`` (new or holding blocks) to cover
    ``num_tokens`` tokens when its ``total_computed_tokens`` include an import."""
    return state.need(request_id, num_tokens, imported=total_computed_tokens)


@dataclass(frozen=True, slots=True)
class RequestStateView:
    """One request's residency bookkeeping as vLLM's coordinator keeps it: the pages with
    a whole host copy (``valid_pages``; an import's count once it is done), the length of
    their prefix, the copies in flight (page -> copy id), the clean pages still held and
    those unpinned."""

    valid_pages: frozenset[int]
    ready_prefix_pages: int
    pending_pages: Mapping[int, int]
    pinned_clean: frozenset[int]
    unpinned_pages: frozenset[int]


class RequestStates(Mapping[str, RequestStateView]):
    """``coordinator.request_states``, read-only: a view per request that holds blocks and
    that vLLM's coordinator would have bookkeeping for (``known``: stepped, its residency
    read, or its import done)."""

    def __init__(self, state: HiSparseState, known: set[str]) -> None:
        self._state, self._known = state, known

    def _ids(self) -> list[str]:
        return [k for k in self._known if self._state.holds(k)]

    def __iter__(self) -> Iterator[str]:
        return iter(self._ids())

    def __len__(self) -> int:
        return len(self._ids())

    def __getitem__(self, request_id: str) -> RequestStateView:
        state = self._state
        if request_id not in self._known or not state.holds(request_id):
            raise KeyError(request_id)
        row, ids = state.row(request_id), state.request(request_id)[2]
        bs = state.block_size
        first = state.imports.first_page(request_id, bs)  # (pending: not valid yet, but a hit's)
        hit = state.imports.hits.get(request_id, 0)
        flight = {p: t for t, (k, p) in state.spills.flight.items() if k == request_id}
        whole = {p for p, t in flight.items() if state.imports.restores.get(t, False)}
        valid = {p for p, b in enumerate(ids) if not b and (p >= first or p < hit)}
        valid |= {*row.pages(CLEAN), *row.pages(UNPINNED), *whole}
        ready = 0
        while ready in valid:
            ready += 1
        assert set(flight) == set(row.pages(IN_FLIGHT)), "pages in flight disagree"
        return RequestStateView(frozenset(valid), ready, flight, frozenset(row.pages(CLEAN)),
                                frozenset(row.pages(UNPINNED)))

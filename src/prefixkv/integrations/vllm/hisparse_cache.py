"""vLLM 0.33's ``KVCacheManager`` for a HiSparse layout with prefix caching on
(``enable_caching=True``), over prefixkv's ``groups.hisparse.cache.HiSparseCache``: the
lookup (``get_computed_blocks``: the longest prefix both the host pool's published pages
and the indexer's cached device pages hold, the host hit kept longer as vLLM's source
group does), admission with a hit (the resident row starting with pages read from host,
the hot region taken, GPU copies adopted at the request's first step; with external
tokens, a load after the hit: groups/hisparse/hits.py), the caching wish
(``cache_blocks``: indexer pages at once, host pages as their copies are confirmed), a
finished request's publication held back for its copies in flight, reset and eviction.
The rest is ``hisparse_manager.HiSparseKVCacheManager``'s.

Refused by name (UnsupportedByPrefixKV, nothing changed): a hit for a request holding
blocks, and what the caching-off manager refuses. A hit whose blocks no
longer hold the request's hashes raises RequestError (nothing changed): a stale lookup is
never admitted. Checked against vLLM's manager side by side:
tests/engines/test_vllm_hisparse_cache.py (with loads: test_vllm_hisparse_cache_loads.py).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id
from vllm.v1.request import Request, RequestStatus

from prefixkv.core.block import Block, blocks_for
from prefixkv.errors import RequestError, check_count
from prefixkv.groups.hisparse.cache import HiSparseCache

from .block_objects import PoolBlock
from .hisparse_groups import HOST, INDEXER, RESIDENT, refused
from .hisparse_manager import _SLOTS, HiSparseKVCacheManager, _bind

__all__ = ["HiSparseCachingKVCacheManager"]


class _Counts:
    """vLLM's ``ref_cnt`` and hash of one pool's blocks (block_objects.py's ``PoolBlock``
    reads them): prefixkv's count, and one more while a live request's copy is in flight
    (vLLM's copy holds its blocks); the hash of the page the block holds (group ``group``'s:
    the host pool's is the source group's, the device pool's the indexer's)."""

    def __init__(self, state: HiSparseCache, group: int) -> None:
        self._state, self._group = state, group
        self._pool = "host" if group == HOST else "device"

    def refs(self, core_id: int) -> int:
        pool = self._state.host if self._group == HOST else self._state.device
        return pool.blocks[core_id].ref_cnt + (core_id in self._state.in_flight()[self._group == HOST])

    def hash_entry(self, core_id: int) -> tuple[bytes, int] | None:
        page = self._state.page_of(self._pool, core_id)
        if page is None:
            return None
        pool = self._state.host if self._group == HOST else self._state.device
        key = pool.blocks[core_id].key
        assert isinstance(key, bytes)
        return make_block_hash_with_group_id(BlockHash(key), self._group), (page + 1) * self._state.block_size

    def gone(self, request: Any, ids: Any) -> None:
        """Nothing: the hashes are prefixkv's index's."""

    def keeping(self) -> bool:
        return False


class HiSparseCachingKVCacheManager(HiSparseKVCacheManager):
    """``HiSparseKVCacheManager`` with prefix caching on (module doc)."""

    state: HiSparseCache
    caching = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """The base class's arguments (``enable_caching`` true)."""
        super().__init__(*args, **kwargs)
        self.enable_caching = True
        for group, blocks in ((HOST, self._host), (INDEXER, self._device)):
            view = _Counts(self.state, group)
            blocks[1:] = [PoolBlock(i, view.refs, i, view) for i in range(1, len(blocks))]

    def prefix_cache_lookup_enabled(self, request: Request) -> bool:
        """Whether the request may read the cache (vLLM's ``skip_reading_prefix_cache``)."""
        return not request.skip_reading_prefix_cache

    def get_computed_blocks(self, request: Request, max_cache_hit_length: int | None = None
                            ) -> tuple[KVCacheBlocks, int, int]:
        """The hit (``HiSparseCache.lookup``, at most ``request.num_tokens - 1`` tokens by
        default): the blocks per group (the source group's the longer host hit), its
        tokens, and the host hit's end when it is longer (vLLM's shared-prefix boundary)."""
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        limit = request.num_tokens - 1 if max_cache_hit_length is None else max_cache_hit_length
        host, indexer = self.state.lookup(request.block_hashes, max(limit, 0))
        bs, k = self.block_size, len(indexer)
        if not host:
            return self.empty_kv_cache_blocks, 0, 0
        blocks = self._objects(([b.block_id for b in host], [b.block_id for b in indexer], [], []))
        return blocks, k * bs, len(host) * bs if len(host) > k else 0

    def get_computed_blocks_for_connector(self, request: Request, max_cache_hit_length: int | None = None
                                          ) -> tuple[KVCacheBlocks, int, int, bool]:
        """``get_computed_blocks`` and False (no Mamba group diverges)."""
        return *self.get_computed_blocks(request, max_cache_hit_length), False

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        """Count the request's lookup (with ``log_stats``, when it reads the cache)."""
        if self._stats is not None and self.prefix_cache_lookup_enabled(request):
            self._stats.record(num_tokens=request.num_tokens, num_hits=num_hits,
                               preempted=request.num_preemptions > 0)

    def allocate_slots(self, request: Request, num_new_tokens: int, *args: Any, **kwargs: Any
                       ) -> KVCacheBlocks | None:
        """``HiSparseKVCacheManager.allocate_slots``, a hit admitted (``new_computed_blocks``
        with ``num_new_computed_tokens``), then the caching wish up to the tokens scheduled
        unless ``delay_cache_blocks``. Host blocks alone with no computed token (the
        lookup's host hit past an indexer hit of no page) are allocated afresh, as vLLM."""
        a = _bind("allocate_slots", _SLOTS, args, kwargs)
        hit, k_tokens = a["new_computed_blocks"], a["num_new_computed_tokens"]
        if not k_tokens and hit is not None and len(hit.blocks) == 4 and not any(hit.blocks[INDEXER:]):
            a["new_computed_blocks"] = hit = None  # (a host hit past an indexer hit of none: afresh)
        if k_tokens or (hit is not None and any(hit.blocks)):
            got = self._admit_hit(request, num_new_tokens, a)
        else:
            got = super().allocate_slots(request, num_new_tokens, **a)
        if got is not None and not a["delay_cache_blocks"]:
            computed = min(request.num_computed_tokens + k_tokens + a["num_external_computed_tokens"],
                           self.max_model_len)  # (a synchronous load's tokens are cached too)
            done = min(computed + num_new_tokens, request.num_tokens)
            self._cache(request, done)
        return got

    def _admit_hit(self, request: Request, num_new_tokens: int, a: dict[str, Any]) -> KVCacheBlocks | None:
        state, bs, rid = self.state, self.block_size, request.request_id
        k_tokens, hit = a["num_new_computed_tokens"], a["new_computed_blocks"]
        for name, n in (("num_new_tokens", num_new_tokens), ("num_new_computed_tokens", k_tokens),
                        ("num_lookahead_tokens", a["num_lookahead_tokens"]),
                        ("reserved_blocks", a["reserved_blocks"])):
            check_count(name, n, 0, None)
        if a["num_encoder_tokens"]:
            refused("encoder tokens in allocate_slots")
        if state.holds(rid) or request.num_computed_tokens:
            refused(f"a hit for a request holding blocks or computed tokens ({rid!r})")
        external = a["num_external_computed_tokens"]  # (a load after the hit: hits.py)
        host, indexer = self._hit_blocks(request, k_tokens, hit, external)
        imported = min(k_tokens + external, self.max_model_len) if external else 0
        total = min(k_tokens + external + num_new_tokens + a["num_lookahead_tokens"], self.max_model_len)
        keep = self.watermark_blocks if a["has_scheduled_reqs"] and request.status in (
            RequestStatus.WAITING, RequestStatus.PREEMPTED) else 0
        free = state.device.num_free
        if a["full_sequence_must_fit"] and state.need_hit(
                min(request.num_tokens, self.max_model_len), host, indexer, cap=True, imported=imported
        ) + keep > free:
            return None
        if state.need_hit(max(total, bs * len(indexer)), host, indexer, imported=imported) + keep \
                > free - a["reserved_blocks"]:
            return None
        got = state.admit(rid, max(total, 1), request.block_hashes, host, indexer, imported)
        assert got, "HiSparse blocks short after the pools were checked"
        ids = state.request(rid)[:4]
        self._rows[rid] = list(ids[RESIDENT])
        self.seam.admitted(rid)
        past = blocks_for(imported, bs) if imported else len(indexer)  # (vLLM's: the new pages)
        return self._objects((ids[HOST][past:], ids[INDEXER][past:], ids[RESIDENT][past:], ids[3]))

    def _hit_blocks(self, request: Request, k_tokens: int, hit: Any, external: int = 0
                    ) -> tuple[list[Block], list[Block]]:
        """prefixkv's blocks of a hit (``get_computed_blocks``' of ``k_tokens`` tokens),
        the host ones cut to it, or with ``external`` tokens loaded after it to the pages
        of both (vLLM's retained longer hit); RequestError unless each holds the request's
        hash."""
        bs, hashes = self.block_size, request.block_hashes
        groups = hit.blocks if hit is not None else ((), (), (), ())
        k = k_tokens // bs
        if k_tokens % bs or len(groups) != 4 or len(groups[INDEXER]) != k or len(groups[HOST]) < k \
                or groups[RESIDENT] or groups[3] or k > len(hashes):
            raise RequestError(f"a hit of {k_tokens} tokens with blocks {[len(g) for g in groups]} "
                               f"per group is not one get_computed_blocks gives")
        kept = groups[HOST][:blocks_for(k_tokens + external, bs) if external else k]
        host = [self.state.host.blocks[b.block_id] for b in kept]
        indexer = [self.state.device.blocks[b.block_id] for b in groups[INDEXER]]
        if any(b.key != hashes[j] for blocks in (host, indexer) for j, b in enumerate(blocks)):
            raise RequestError(f"a hit for {request.request_id!r} whose blocks no longer hold its "
                               "prefix (evicted since the lookup)")
        return host, indexer

    def _cache(self, request: Request, tokens: int) -> None:
        # (the whole count: vLLM's hybrid coordinator keeps re-prefilled tokens out of the
        # copies, advance_scheduled, not out of the caching wish, get_num_cacheable_tokens)
        self.state.cache(request.request_id, tokens, request.block_hashes)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """The caching wish up to ``num_computed_tokens``."""
        check_count("num_computed_tokens", num_computed_tokens, 0, None)
        if self.state.holds(request.request_id):
            self._cache(request, num_computed_tokens)

    def free(self, request: Request) -> None:
        """The request goes (``HiSparseCache.free``: a finished one's pages in flight are
        published once confirmed)."""
        if self._rows.pop(request.request_id, None) is not None:
            self.state.free(request.request_id, finished=request.is_finished())

    def evict_blocks(self, block_ids: set[int]) -> None:
        """These device blocks' content is findable no more (RequestError, nothing
        changed, unless device block ids)."""
        self.block_pool.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        """Drop each pool's cached content (and the GPU copies) where none of its blocks
        is in use; whether both pools did."""
        if not self.state.reset():
            return False
        if self._stats is not None:
            self._stats.reset = True
        return True

"""vLLM 0.33's ``KVCacheManager`` calls for a HiSparse layout (docs/integration.md,
"HiSparse"), answered from prefixkv's ``HiSparseState`` (groups/hisparse/state.py), with
its coordinator (hisparse.py's ``HiSparseSeam``) held by the group views, where vLLM's
``get_hisparse_coordinator(manager)`` finds it.

The groups are vLLM's: 0 the source (host pool ids), 1 the indexer, 2 the resident row,
3 the hot region (device pool ids, vLLM's: block 0 the null block). A request's step is
``allocate_slots`` (all or nothing, vLLM's checks: the full-sequence gate, the watermark,
``reserved_blocks``, the host pool backing every page); the scheduler's connector then
calls the seam (``advance_scheduled``, the offload command, the workers' reports).

Served: the scope of ``HiSparseState`` (``hisparse.hisparse_state``): prefix caching
off here (no hit, nothing cached; caching on is hisparse_cache.py's subclass, which
``hisparse_class`` picks), one resident and one hot group, one block size; refused
with UnsupportedByPrefixKV at construction otherwise, and for KV events, a metrics
collector, blocks to zero and context parallelism; at the call for external
(connector) tokens after a step, encoder tokens and hits (caching on: hisparse_cache.py),
and ``pop_blocks_for_free`` of a request with copies (hisparse_popped.py). Checked against
vLLM's manager side by side: tests/engines/test_vllm_hisparse_manager.py.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import Request, RequestStatus

from prefixkv.core.block import blocks_for
from prefixkv.errors import RequestError, check_count

from .hisparse import HiSparseSeam, hisparse_state, refuse_the_rest
from .hisparse_blocks import pool_blocks
from .hisparse_groups import HOST, RESIDENT, CoordinatorView, DevicePoolView, HostPoolView, refused
from .hisparse_imports import load_slots
from .manager import KVCacheManager

__all__ = ["HiSparseKVCacheManager"]

# the base class's arguments after those named, in order, with their defaults (its
# signature, written out: its ``__init__`` may be wrapped, as vllm_swap.py counts managers)
_OPTIONS = (("max_in_flight_tokens", None), ("enable_caching", True), ("use_eagle", False),
            ("num_hash_lookahead_tokens", 0), ("num_prefill_lookahead", 0), ("log_stats", False),
            ("enable_kv_cache_events", False), ("dcp_world_size", 1), ("pcp_world_size", 1),
            ("metrics_collector", None), ("watermark", 0.0), ("enable_mamba_shared_prefix_checkpoint", False))
_SLOTS = (("num_new_computed_tokens", 0), ("new_computed_blocks", None), ("num_lookahead_tokens", 0),
          ("num_external_computed_tokens", 0), ("delay_cache_blocks", False), ("num_encoder_tokens", 0),
          ("full_sequence_must_fit", False), ("reserved_blocks", 0), ("has_scheduled_reqs", True),
          ("skip_zeroing_group_ids", ()))


def _bind(call: str, names: tuple[tuple[str, Any], ...], args: tuple[Any, ...], kwargs: dict[str, Any]
          ) -> dict[str, Any]:
    """``names``' values from ``args`` (in order) and ``kwargs``, defaults for the rest.
    TypeError, as Python's, for too many, unknown or repeated arguments."""
    known = dict(names)
    if len(args) > len(names) or not kwargs.keys() <= known.keys() \
            or any(n in kwargs for n, _ in names[:len(args)]):
        raise TypeError(f"{call}() got arguments {args!r}, {sorted(kwargs)} beyond its "
                        f"parameters {list(known)}")
    known.update(zip([n for n, _ in names[:len(args)]], args, strict=True))
    known.update(kwargs)
    return known

def hisparse_class(args: tuple[Any, ...], kwargs: dict[str, Any]) -> type[KVCacheManager]:
    """The HiSparse manager class for ``KVCacheManager(*args, **kwargs)``: caching on
    (hisparse_cache.py's) or off."""
    if kwargs.get("enable_caching", args[5] if len(args) > 5 else True):
        from .hisparse_cache import HiSparseCachingKVCacheManager
        return HiSparseCachingKVCacheManager
    return HiSparseKVCacheManager


class HiSparseKVCacheManager(KVCacheManager):
    """vLLM's manager calls over ``HiSparseState`` (module doc); every other call of the
    plug-in's manager raises UnsupportedByPrefixKV naming it. ``state``: prefixkv's state;
    ``caching``: whether the class serves prefix caching on (hisparse_cache.py's does)."""

    caching = False

    def __init__(self, kv_cache_config: KVCacheConfig, max_model_len: int, scheduler_block_size: int,
                 hash_block_size: int, *args: Any, **kwargs: Any) -> None:
        """The base class's arguments (by position or by name: ``KVCacheManager.__init__``)."""
        o = _bind("KVCacheManager", _OPTIONS, args, kwargs)
        if bool(o["enable_caching"]) != self.caching:
            refused(f"enable_caching={o['enable_caching']!r} in {type(self).__name__} (KVCacheManager "
                    "picks the HiSparse class that serves it)")
        state = hisparse_state(kv_cache_config, max_model_len, enable_caching=o["enable_caching"],
                               max_in_flight_tokens=o["max_in_flight_tokens"],
                               num_prefill_lookahead=o["num_prefill_lookahead"])
        specs = tuple(g.kv_cache_spec for g in kv_cache_config.kv_cache_groups)
        for what, off in (("KV cache events (enable_kv_cache_events)", o["enable_kv_cache_events"]),
                          ("a KV cache metrics collector", o["metrics_collector"] is not None),
                          ("context parallelism", o["dcp_world_size"] != 1 or o["pcp_world_size"] != 1),
                          ("blocks to zero (needs_kv_cache_zeroing)", kv_cache_config.needs_kv_cache_zeroing),
                          (f"scheduler and hash block sizes {scheduler_block_size}, {hash_block_size} "
                           f"other than the groups' {state.block_size}",
                           {scheduler_block_size, hash_block_size} != {state.block_size})):
            if off:
                refused(what)
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.block_size = self.hash_block_size = state.block_size
        self.enable_caching = False
        self.enable_kv_cache_events = False
        self.use_eagle = o["use_eagle"]
        self.log_stats = log_stats = o["log_stats"]
        self.metrics_collector = None
        self.num_kv_cache_groups = 4
        self.mamba_shared_prefix_checkpoint = False
        self.retained_hit_group_ids = (HOST,)  # (vLLM's: the source group retains longer hits)
        self.watermark_blocks = int(o["watermark"] * kv_cache_config.num_blocks)
        self.state = state
        self._device = pool_blocks(state, host=False)  # (ref_cnt read live: hisparse_blocks.py)
        self._host = pool_blocks(state, host=True)
        self.empty_kv_cache_blocks = KVCacheBlocks(((), (), (), ()))
        device_view = DevicePoolView(state, self._device)
        self.block_pool = device_view  # type: ignore[assignment]
        self.host_pool = HostPoolView(state, self._host, "the host pool")
        device_view.other = self.host_pool  # (free_blocks gives host blocks back there)
        self.seam = HiSparseSeam(state, host_group_id=HOST)
        self.coordinator = CoordinatorView(self, specs, self.seam)  # type: ignore[assignment]
        self.seam.bind(self.coordinator.single_type_managers, self.host_pool)
        self._rows: dict[str, list[int]] = {}  # request id -> its resident row's ids as allocated
        self._stats = PrefixCacheStats() if log_stats else None

    # ---- queries ---------------------------------------------------------------------------

    @property
    def usage(self) -> float:
        """Fraction of the device blocks requests hold."""
        return self.block_pool.get_usage()

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """vLLM's stats since the last ``make_prefix_cache_stats`` (None without ``log_stats``)."""
        return self._stats

    def live_request_ids(self) -> list[str]:
        """The requests holding blocks."""
        return list(self._rows)

    def num_cached_tokens(self, request_id: str) -> int:
        """0: nothing is cached."""
        return 0

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's ids per group: host row, indexer, resident row (as allocated: a
        page lost to host keeps its id there, as in vLLM's), hot region."""
        if request_id not in self._rows:
            return [], [], [], []
        host, indexer, _, hot, _ = self.state.request(request_id)
        return host, indexer, list(self._rows[request_id]), hot

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """``get_block_ids`` as vLLM's block objects (the host pool's for group 0)."""
        return self._objects(self.get_block_ids(request_id))

    def _objects(self, ids: tuple[list[int], ...]) -> KVCacheBlocks:
        if not any(ids):
            return self.empty_kv_cache_blocks
        return KVCacheBlocks(tuple([(self._host if g == HOST else self._device)[i] for i in group]
                                   for g, group in enumerate(ids)))

    def get_block_ids_for_computed_tokens(self, request_id: str, num_computed_tokens: int
                                          ) -> tuple[list[int], ...]:
        """The source and indexer ids clipped to ``num_computed_tokens``; the resident and
        hot groups' whole (vLLM clips attention groups only)."""
        check_count("num_computed_tokens", num_computed_tokens, 0, None)
        host, indexer, row, hot = self.get_block_ids(request_id)
        cut = blocks_for(num_computed_tokens, self.block_size)
        return host[:cut], indexer[:cut], row, hot

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """0 per group, as vLLM's."""
        return [0] * 4

    def estimate_cached_tokens(self, request: Request) -> int:
        """0: nothing is cached."""
        return 0

    # ---- lookup: caching is off --------------------------------------------------------------

    def prefix_cache_lookup_enabled(self, request: Request) -> bool:
        """False: caching is off."""
        return False

    def get_computed_blocks(self, request: Request, max_cache_hit_length: int | None = None
                            ) -> tuple[KVCacheBlocks, int, int]:
        """No hit: empty blocks, 0, 0."""
        return self.empty_kv_cache_blocks, 0, 0

    def get_computed_blocks_for_connector(self, request: Request, max_cache_hit_length: int | None = None
                                          ) -> tuple[KVCacheBlocks, int, int, bool]:
        """No hit: empty blocks, 0, 0, False."""
        return self.empty_kv_cache_blocks, 0, 0, False

    def truncate_computed_blocks(self, blocks: KVCacheBlocks, num_computed_tokens: int) -> KVCacheBlocks:
        """``blocks`` cut to the first ``num_computed_tokens`` in every group."""
        cut = num_computed_tokens // self.block_size
        return KVCacheBlocks(tuple(list(g[:cut]) for g in blocks.blocks))

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        """Nothing: no lookup runs."""

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """vLLM's stats since the previous call (no lookup is counted); None without ``log_stats``."""
        if self._stats is None:
            return None
        stats, self._stats = self._stats, PrefixCacheStats()
        return stats

    # ---- allocation and free -----------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int, *args: Any, **kwargs: Any
                       ) -> KVCacheBlocks | None:
        """Slots for the request's tokens up to ``num_computed_tokens + num_new_tokens +
        num_lookahead_tokens`` (at most ``max_model_len``) in every group, all or nothing
        (the other arguments: the base class's, by position or by name): the blocks each
        group took, or None when the device pool (less the watermark for a waiting request
        and ``reserved_blocks``) or the host pool is short, or the whole request does not
        fit when ``full_sequence_must_fit`` (its row capped at the admission window).
        Raises ValueError as vLLM's (nothing to schedule), RequestError for counts that are
        not ints >= 0, UnsupportedByPrefixKV for hits, external and encoder tokens; nothing
        changed."""
        a = _bind("allocate_slots", _SLOTS, args, kwargs)
        num_lookahead_tokens, reserved_blocks = a["num_lookahead_tokens"], a["reserved_blocks"]
        for name, n in (("num_new_tokens", num_new_tokens), ("num_lookahead_tokens", num_lookahead_tokens),
                        ("reserved_blocks", reserved_blocks)):
            check_count(name, n, 0, None)
        hit = a["new_computed_blocks"]
        if a["num_new_computed_tokens"] or a["num_encoder_tokens"] or (hit is not None and any(hit.blocks)):
            refused("hits or encoder tokens in allocate_slots")
        if a["num_external_computed_tokens"]:  # (an external load: hisparse_imports.py)
            return load_slots(self, request, num_new_tokens, a)
        failed = self.state.imports.failed
        if failed and request.request_id in failed:
            refused(f"a step of {request.request_id!r}, whose external load failed (free it)")
        if request.num_computed_tokens and not self.state.holds(request.request_id):
            refused(f"a request holding no blocks with {request.num_computed_tokens} computed tokens "
                    f"(a host prefix) in allocate_slots")
        if not num_new_tokens:
            raise ValueError("num_new_tokens must be greater than 0 when there are no computed "
                             "tokens to adopt")
        rid, state = request.request_id, self.state
        computed = min(request.num_computed_tokens, self.max_model_len)
        total = min(computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        keep = self.watermark_blocks if a["has_scheduled_reqs"] and request.status in (
            RequestStatus.WAITING, RequestStatus.PREEMPTED) else 0
        free = state.device.num_free
        if a["full_sequence_must_fit"] and \
                state.need(rid, min(request.num_tokens, self.max_model_len), cap=True) + keep > free:
            return None
        if state.need(rid, total) + keep > free - reserved_blocks:
            return None
        before = [len(g) for g in self.get_block_ids(rid)]
        got = state.allocate(rid, total)
        assert got, "HiSparse blocks short after the pools were checked"
        host, indexer, row, hot, _ = state.request(rid)
        self._rows.setdefault(rid, []).extend(row[before[RESIDENT]:])
        ids = (host, indexer, row, hot)
        return self._objects(tuple(ids[g][before[g]:] for g in range(4)))

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Nothing: caching is off. Raises RequestError for a count that is not an int >= 0."""
        check_count("num_computed_tokens", num_computed_tokens, 0, None)

    def free(self, request: Request) -> None:
        """The request goes (``HiSparseState.free``: its copies in flight keep their blocks
        until confirmed). A request holding none: nothing happens."""
        if self._rows.pop(request.request_id, None) is not None:
            self.state.free(request.request_id)
            self.seam.forget(request.request_id)

    def pop_blocks_for_free(self, request: Request) -> list[KVCacheBlock]:
        """The request's blocks, handed to the caller, who gives them back with
        ``block_pool.free_blocks`` (hisparse_popped.py: served for a request of dirty pages
        alone, UnsupportedByPrefixKV otherwise, nothing changed)."""
        from .hisparse_popped import pop_for_free
        return pop_for_free(self, request)

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        """Nothing: every group keeps all its pages. Raises RequestError for a count that
        is not an int."""
        if processed_computed_tokens.__class__ is not int:
            raise RequestError(f"processed_computed_tokens must be an int, got {processed_computed_tokens!r}")

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Nothing is cached: the ids are checked (RequestError unless device block ids),
        nothing changes."""
        for i in block_ids:
            check_count("a block id", i, 0, len(self._device) - 1)

    def reset_prefix_cache(self) -> bool:
        """Whether no block of either pool is in use (nothing is cached to drop: vLLM's
        reset then succeeds, and fails while any is)."""
        state = self.state
        if state.device.num_free != len(self._device) - 1 or state.host.num_free != len(self._host) - 1:
            return False
        if self._stats is not None:
            self._stats.reset = True
        return True

    # ---- the per-step calls: nothing to do -----------------------------------------------------

    def new_step_starts(self) -> None:
        """Nothing: the seam plans this layout's copies."""

    def take_events(self) -> list[Any]:
        """[]: KV events are refused at construction."""
        return []

    def take_new_block_ids(self) -> list[int]:
        """[]: no block is zeroed (layouts that need it are refused)."""
        return []

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        """Nothing: no block is zeroed."""

    def take_kv_cache_block_copies(self) -> tuple[list[Any], list[KVCacheBlock]]:
        """No copy on write: ([], [])."""
        return [], []

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """{}: boundary states are Mamba's."""
        return {}

    def finalize_partial_tail_offloads(self, request: Request) -> list[tuple[int, int, int]]:
        """[]: partial tails are Mamba's."""
        return []


refuse_the_rest(HiSparseKVCacheManager, [n for c in KVCacheManager.__mro__[:-1]
                                         for n, v in vars(c).items() if callable(v)], refused)

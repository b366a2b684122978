"""vLLM 0.33's ``KVCacheManager`` surface, every call its scheduler makes, over prefixkv.

Built from the arguments vLLM's ``KVCacheManager.__init__`` takes. One full-attention
group runs on ``prefixkv.KVCacheManager``, full / sliding-window / chunked-local groups on
``prefixkv.groups.HybridKVCacheManager`` (``layout.read_layout`` refuses the rest).

The arguments read into a layout and settings: settings.py (layout.py, options.py,
retention.py); the hit (``get_computed_blocks`` and its kin, listed by the class):
hits.py; how ``allocate_slots`` and ``cache_blocks`` map vLLM's token layout onto
prefixkv: slots.py (admission, and where it takes a request's tokens from) and growth.py
(a live request's growth); freeing, released and evicted blocks: release.py; the
read-only calls on a request's blocks (their ids, their cached tokens): queries.py; the
calls made once a step (its start, stats, events, Mamba's no-ops): step_calls.py; the
prefixkv manager a layout runs on: ``layout.build_core``.

The differences from vLLM's manager, and the tests of vLLM that show them, are listed in
docs/integration.md ("With vLLM").
"""

from __future__ import annotations

from collections.abc import Hashable
from functools import partial
from operator import index
from typing import Any

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.request import Request

from prefixkv.errors import RequestError, check_count

from . import hits, queries, sessions
from .block_hash_view import BlockHashView
from .block_hashes import lookups_for
from .coordinator import CoordinatorView
from .free_count import Reservation
from .growth import grow
from .hit_caps import HitCaps
from .layout import UnsupportedByPrefixKV, build_core
from .mamba import StepCache, allocating, check_call, check_landing, noting
from .pool import BlockPoolView, Blocks
from .popped import PoppedBlocks
from .prepared import PreparedPrompts
from .release import estimate_cached, evict, free_popped, free_request, pop_for_free, release_skipped
from .settings import read_settings
from .slots import allocate
from .step_calls import CowCopies, StepCalls
from .telemetry import Telemetry
from .zeroing import Zeroing

__all__ = ["KVCacheManager"]


class KVCacheManager(StepCalls):
    """vLLM's KVCacheManager calls over prefixkv (see the module docstring; the calls
    made once a step: ``StepCalls``, step_calls.py). Raises
    UnsupportedByPrefixKV at construction for what prefixkv does not offer, and for
    EAGLE's shortened hits (``use_eagle``) beside other groups and lookahead hashing
    (``num_hash_lookahead_tokens`` > 0)."""

    _serves_lookahead = False  # (lookahead hashing: lookahead.LookaheadKVCacheManager)
    _built_with: tuple[tuple[Any, ...], dict[str, Any]]  # (``__new__``'s arguments: retention_setter.py)
    _tail_gap = 1  # the tokens a prompt's last Mamba boundary leaves after it (lookahead.py: max(1, L))
    _watch_sessions = False  # whether a request's session is looked for (sessions.watch)

    def __new__(cls, *args: Any, **kwargs: Any) -> KVCacheManager:
        """A ``hisparse_manager.HiSparseKVCacheManager`` for a ``kv_cache_config`` with a
        HiSparse host pool, a ``cross.CrossAttentionKVCacheManager`` for one with
        cross-attention groups (encoder-decoder models), a ``lookahead.LookaheadKVCacheManager``
        for lookahead hashing with caching on, else this class."""
        if cls is KVCacheManager:
            from .cross import CrossAttentionKVCacheManager, cross_groups
            config = kwargs.get("kv_cache_config", args[0] if args else None)
            if getattr(config, "hisparse_host_num_blocks", None) is not None:
                from .hisparse_manager import hisparse_class  # (a HiSparse layout)
                cls = hisparse_class(args, kwargs)
            elif cross_groups(config):
                cls = CrossAttentionKVCacheManager
            elif (kwargs.get("num_hash_lookahead_tokens", args[7] if len(args) > 7 else 0)
                  and kwargs.get("enable_caching", args[5] if len(args) > 5 else True)):
                from .lookahead import LookaheadKVCacheManager  # (lookahead hashing)
                cls = LookaheadKVCacheManager
        made = super().__new__(cls)
        made._built_with = (args, kwargs)  # (a retention_interval set later rebuilds it: retention_setter.py)
        return made

    def __init__(self, kv_cache_config: KVCacheConfig, max_model_len: int, scheduler_block_size: int,
                 hash_block_size: int, max_in_flight_tokens: int | None = None,
                 enable_caching: bool = True, use_eagle: bool = False,
                 num_hash_lookahead_tokens: int = 0, num_prefill_lookahead: int = 0,
                 log_stats: bool = False, enable_kv_cache_events: bool = False,
                 dcp_world_size: int = 1, pcp_world_size: int = 1, metrics_collector: Any = None,
                 watermark: float = 0.0, enable_mamba_shared_prefix_checkpoint: bool = False) -> None:
        for call in ("allocate_slots", "cache_blocks"):  # (a rebuild, retention_setter.py: the class's
            self.__dict__.pop(call, None)  # calls again, as sessions.py and free_count.py wrap them anew)
        layout, s = read_settings(kv_cache_config, scheduler_block_size=scheduler_block_size,
                                  hash_block_size=hash_block_size, dcp_world_size=dcp_world_size,
                                  pcp_world_size=pcp_world_size, use_eagle=use_eagle,
                                  num_hash_lookahead_tokens=num_hash_lookahead_tokens,
                                  num_prefill_lookahead=num_prefill_lookahead, watermark=watermark,
                                  enable_caching=enable_caching)
        # what the calls read of the layout and arguments (what each is: settings.Settings)
        self.retention_interval = s.retention_interval
        self.block_size = bs = s.block_size
        self.hash_block_size = s.hash_block_size
        self.group_sizes = s.group_sizes
        self.cache_unit = s.cache_unit
        self.hit_group = s.hit_group
        self.eagle_groups = s.eagle_groups
        self.watermark_blocks = s.watermark_blocks
        self.replay_tokens = s.replay_tokens
        self.reprefill_tokens = s.reprefill_tokens
        self.cached_groups = s.cached_groups
        self._retains, self._junctions, self._uncached = s.retains, s.junctions, s.uncached
        self._odd_hit, self._hybrid = s.odd_hit, s.hybrid
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        # set by prefixkv's Scheduler when its publisher builds events (handoff.py)
        self.hands_off_events = False
        self.use_eagle = use_eagle  # (a hit drops its last block: hits.eagle_hit)
        self.log_stats = log_stats
        self.metrics_collector = metrics_collector
        self.num_kv_cache_groups = len(layout.groups)
        # enable_mamba_shared_prefix_checkpoint: vLLM 0.33's manager acts on it only with partial
        # hits and EAGLE beside Mamba, without MTP's re-prefillable tokens (BlockSizes.shared_prefix)
        self.mamba_shared_prefix_checkpoint = bool(enable_mamba_shared_prefix_checkpoint and use_eagle
                                                   and layout.sizes.partial and not self.reprefill_tokens)
        self.retained_hit_group_ids: tuple[int, ...] = ()
        self._mamba = StepCache(tuple(g for g, s in enumerate(layout.groups) if s.sparse),  # mamba.py
                                next((g for g, s in enumerate(layout.groups) if not s.releases), 0),
                                None if layout.sizes.one_size and not layout.sizes.checkpoints
                                else layout.sizes, layout.groups)
        events = enable_kv_cache_events or metrics_collector is not None
        lookahead = index(num_hash_lookahead_tokens) if enable_caching else 0  # (a bool: vLLM's tests')
        if lookahead and not self._serves_lookahead:  # (lookahead.py's class does)
            raise UnsupportedByPrefixKV(f"prefixkv does not offer lookahead hashing "
                                        f"(num_hash_lookahead_tokens={lookahead}) on {type(self).__name__}")
        self.core, offset = build_core(layout, enable_caching=enable_caching, enable_events=events,
                                       peek=self.eagle_groups, lookahead=lookahead, eagle=use_eagle,
                                       shared_prefix=self.mamba_shared_prefix_checkpoint)
        if use_eagle and self._mamba.sizes is not None:  # (EAGLE's positions: BlockSizes.eagle)
            self._mamba.sizes = self.core.sizes
        # the prompts prepared where vLLM builds its Requests (prepared.py, input_thread.py)
        self.prepared_prompts = PreparedPrompts(self.core.prepare, self.hash_block_size)
        fine = self.core._fine if self._hybrid else ()  # (full attention larger than the hash block)
        self._hit_caps = HitCaps(self.group_sizes[fine[0]]) if fine else None  # (hit_caps.py)
        self._odd_hit = self._odd_hit or bool(fine)  # (its lookup: hits.lookup)
        self._blocks = Blocks(layout.num_blocks, self.num_kv_cache_groups, offset, self.core.ref_cnt)
        zeroing = Zeroing(kv_cache_config, layout.specs, offset)  # (the blocks to zero)
        self._zeroes: Zeroing | None = zeroing if zeroing.active else None
        self._plain = not self._mamba.groups and self._zeroes is None  # (allocate_slots)
        self.empty_kv_cache_blocks = self._blocks.empty
        # stats, metrics notes and events (telemetry.py)
        self._telemetry = Telemetry(self.core, self._blocks, bs, layout.specs, log_stats=log_stats,
                                    metrics_collector=metrics_collector,
                                    enable_kv_cache_events=enable_kv_cache_events)
        reservation = Reservation(self)  # (a write of the free count: free_count.py)
        self.block_pool = BlockPoolView(self._blocks, layout.num_blocks, self.hash_block_size, enable_caching,
                                        lambda b: free_popped(self, b), lambda ids: self.evict_blocks(ids),
                                        reservation.free,
                                        self._telemetry.built_events, lambda: self.core.free_block_order(),
                                        lookups_for(self.core, layout, self.prepared_prompts,
                                                    self._blocks.table, offset, events),
                                        lambda: enable_kv_cache_events and self.core.has_pending_events,
                                        reservation.write)
        if isinstance(view := self._blocks.hashes, BlockHashView):  # (its live requests' blocks)
            view.rows_of = partial(queries.rows_of, self)
        self.coordinator = CoordinatorView(self, layout)
        self._keys: dict[Hashable, int] = {}  # vLLM request id -> prefixkv's id of the request
        self._next_key = 0
        self._popped = PoppedBlocks()  # pop_blocks_for_free's, until given back (popped.py)
        self._copies = CowCopies(self._blocks)  # partial hits' copies on write (step_calls.py)
        # live request id -> (group, block index) of its blocks evict_blocks uncached
        self._evicted: dict[str, set[tuple[int, int]]] = {}
        sessions.watch(self)  # (session_id on BlockStored: sessions.py)

    # ---- queries: queries.py (read-only, on a request's blocks), but vLLM's estimate -----

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks (vLLM's null block left out) requests hold."""
        return self.block_pool.get_usage()

    key_of = queries.key_of
    live_request_ids = queries.live_request_ids
    num_cached_tokens = queries.num_cached_tokens
    _ids = queries._ids
    get_blocks = queries.get_blocks
    get_block_ids = queries.get_block_ids
    get_block_ids_for_computed_tokens = queries.get_block_ids_for_computed_tokens

    def estimate_cached_tokens(self, request: Request) -> int:
        """vLLM's estimate: tokens up to the end of the request's last block still holding
        cached content, the least over groups. A block ``evict_blocks`` uncached while
        the request held it holds none (nor does a null block: a window group that
        released every full block of the request counts 0): after vLLM's scheduler
        evicts a request's tail from its first invalid block, that block's start."""
        return estimate_cached(self, request.request_id)

    get_num_common_prefix_blocks = queries.get_num_common_prefix_blocks

    # ---- lookup: hits.py (the hit a waiting request would reuse) -----------------------------

    prefix_cache_lookup_enabled = hits.prefix_cache_lookup_enabled
    get_computed_blocks = hits.get_computed_blocks
    get_computed_blocks_for_connector = hits.get_computed_blocks_for_connector
    truncate_computed_blocks = hits.truncate_computed_blocks
    create_kv_cache_blocks = hits.create_kv_cache_blocks

    # ---- allocation ------------------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlocks | None = None, num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0, delay_cache_blocks: bool = False,
                       num_encoder_tokens: int = 0, full_sequence_must_fit: bool = False,
                       reserved_blocks: int = 0, has_scheduled_reqs: bool = True,
                       skip_zeroing_group_ids: tuple[int, ...] = ()) -> KVCacheBlocks | None:
        """Slots for the request (how: slots.py); the newly allocated blocks,
        or None when the pool is short (nothing changed). ``reserved_blocks`` and vLLM's
        watermark are kept free on top of what the allocation takes. Raises ValueError
        as vLLM's (nothing to schedule), UnsupportedByPrefixKV for encoder tokens,
        RequestError for a count that is not an int >= 0, or when the hit is not the one
        ``get_computed_blocks`` reported, and PromptTooLongError for a request to admit
        of more than ``max_model_len`` tokens (vLLM refuses such prompts before they
        reach its manager, which has no answer for them: it gives slots for
        ``max_model_len`` of their tokens, or with KV events on raises IndexError).
        Beside a Mamba group: UnsupportedByPrefixKV for lookahead tokens, and for
        external tokens beside EAGLE, lookahead hashing, Mamba's checkpoints or sparse
        retention (``mamba.check_call``), and None for a new request whose hit ends on a
        state cached this step (mamba.py)."""
        # (no closure: its cells would be made on every call, decode steps' included)
        args = (self, request, num_new_tokens, num_new_computed_tokens, num_lookahead_tokens,
                num_external_computed_tokens, delay_cache_blocks, num_encoder_tokens,
                full_sequence_must_fit, reserved_blocks, has_scheduled_reqs)
        if self._plain:  # (no Mamba group, no block to zero)
            return allocate(*args)
        admitted = self._keys.get(request.request_id) is None
        loaded = request.num_computed_tokens + num_new_computed_tokens + num_external_computed_tokens
        out: KVCacheBlocks | None
        if self._mamba.groups:
            check_call(self, num_lookahead_tokens, num_external_computed_tokens)
            run = partial(allocate, *args)  # (a step of one token jumps no Mamba entry)
            out = noting(self, request, num_new_computed_tokens, run) if num_new_tokens < 2 else \
                allocating(self, request, num_new_computed_tokens, run)
            if out is not None and delay_cache_blocks and num_external_computed_tokens and admitted:
                self._mamba.loading[request.request_id] = loaded  # (until it lands: check_landing)
        else:
            out = allocate(*args)
        if out is not None and self._zeroes:  # (zeroing.py)
            if admitted:
                self._zeroes.note_admitted(self, self._keys[request.request_id], num_new_computed_tokens,
                                           loaded, skip_zeroing_group_ids)
            else:
                self._zeroes.note(out.get_block_ids())
        return out

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        """Zero the request's blocks from ``start_token`` on again (a failed load left them
        unwritten), as vLLM's (zeroing.py); nothing for a request holding none."""
        key = self.key_of(request_id)
        if key is not None and self._zeroes:
            self._zeroes.note_from(self._ids(key), start_token, self.group_sizes)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Make the request's full blocks up to ``num_computed_tokens`` findable (the tokens
        its finished steps computed, less multi-module MTP's re-prefillable ones; capped at
        what ``request.all_token_ids`` knows).
        Raises RequestError for a count that is not an int >= 0, UnsupportedByPrefixKV
        beside a Mamba group for a load that failed (``mamba.check_landing``)."""
        if num_computed_tokens.__class__ is not int or num_computed_tokens < 0:
            check_count("num_computed_tokens", num_computed_tokens, 0, None)
        if self._mamba.loading:  # (a load beside Mamba lands: mamba.py)
            check_landing(self, request, num_computed_tokens)
        key = self._keys.get(request.request_id)
        if key is None or not self.enable_caching:
            return
        target = min(num_computed_tokens - self.reprefill_tokens, request.num_tokens)
        if target > self.core.num_scheduled_tokens(key):
            noting(self, request, 0, lambda: grow(self, key, request, target, 0))

    # ---- free ---------------------------------------------------------------------------

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first; what was cached stays findable until
        evicted, as in vLLM, but for the full blocks past ``request.num_computed_tokens``
        (vLLM set the count back for invalid KV, or preempts the request in the step
        that scheduled it: ``release.uncache_set_back``), which vLLM's own manager
        leaves findable. A request holding none: nothing happens."""
        free_request(self, request)

    def pop_blocks_for_free(self, request: Request) -> list[KVCacheBlock]:
        """Forget the request but keep its blocks held: the returned blocks (in token
        order, fresh objects of this call) go back with ``block_pool.free_blocks`` later.
        Empty for a request holding none. Blocks past computed tokens vLLM set back:
        as ``free``."""
        return pop_for_free(self, request)

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        """Release the request's blocks that no window reads at
        ``processed_computed_tokens`` (its tokens whose steps ran; vLLM's scheduler calls
        it when a request finishes, before it hands the block table to a connector): the
        table then shows vLLM's null block there, as vLLM's. Growth releases such blocks
        itself; one-group models and requests holding none: nothing happens.
        ``num_prompt_tokens`` is for group kinds prefixkv does not offer (unused).
        Raises RequestError for an unhashable id or a count that is not an int."""
        if processed_computed_tokens.__class__ is not int:  # (below 0: none processed)
            raise RequestError(f"processed_computed_tokens must be an int, got {processed_computed_tokens!r}")
        self.key_of(request_id)
        release_skipped(self, request_id, processed_computed_tokens)

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Make these blocks' content unfindable (KV a connector failed to load). Raises
        RequestError for ids that are not vLLM block ids, UnsupportedByPrefixKV beside
        a Mamba group for a block a live request holds (its recompute would start from
        a state no block may hold; vLLM's reads its null block), nothing changed."""
        if self._mamba.groups and any(self.core.ref_cnt(i) for i in self._blocks.core_ids(block_ids)):
            raise UnsupportedByPrefixKV("prefixkv does not offer evict_blocks beside a Mamba group "
                                        "on blocks a live request holds")
        evict(self, block_ids)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block when none is in use; whether it did."""
        if not self.core.reset_prefix_cache():
            return False
        self._telemetry.on_reset()
        return True

    # ---- stats (the per-step calls: step_calls.py) -------------------------------------

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        """Count the request's lookup in the stats (with ``log_stats``, when it reads the cache)."""
        if self.prefix_cache_lookup_enabled(request):
            self._telemetry.record_prefix_cache_stats(request, num_hits)

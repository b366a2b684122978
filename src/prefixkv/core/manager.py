"""The request-level manager: what an engine's scheduler calls.

Blocks cover ``[0, num_scheduled)`` (and reserved slots past it). Every block that is full
within ``num_scheduled`` has its content recorded and is findable from the step it is
scheduled in: the engine writes a step's K/V before it reads any, so a request admitted in
the same step may share it. The partial last block is never shared and never cached.
Every call checks its input and computes what can fail (encoding, hashing) before it
changes anything; a shortage returns None with nothing changed.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from operator import attrgetter

from ..errors import ConfigError, RequestError, check_count
from ..event_log import EventLog, NullSink
from ..extra_keys import ExtraKeys
from ..hashing import HashFn
from ..index import ContentIndex, Hasher, NoIndex
from ..index.announce import Fresh
from ..results import SharedPrefix
from ..stats import PrefixCacheStats, StatsCounter
from ..store.link import StoreLink
from ..store.shared import SharedStore
from ..tiers import HostTier
from . import (
    admission,
    admit_general,
    decode,
    forks,
    invalidation,
    lookups,
    manager_check,
    release,
    step_outputs,
    store_readmit,
    store_start,
)
from .copies import CopyPlan
from .pool import BlockPool
from .prompt import Prompt, prepare_prompt
from .request import Request
from .sharing import shared_prefixes
from .store_waits import StoreWaits

_ID = attrgetter("block_id")


class KVCacheManager:
    """Paged KV blocks for many requests, with automatic prefix caching.

    Args:
        num_blocks: physical blocks in the pool (1 to ``MAX_BLOCKS``, 2**24: each is an
            object built now).
        block_size: token slots per block (> 0; 16 is usual).
        hash_mode: the chain hash, the blocks' identity outside the process (events,
            routers, stores): ``"xxhash"`` (default; xxh3-128, random seed per manager
            unless ``seed`` is given), ``"sha256"`` (ids stable across processes) or a
            callable ``bytes -> bytes``. Hits never depend on it: a hit is found and
            verified by the block's content.
        seed: chain seed (int >= 0 or bytes).
        enable_caching: False gives plain paged allocation (an index that never finds).
        enable_events: record BlockStored/BlockRemoved/AllBlocksCleared for ``take_events``.
        max_events: the event log's bound (see ``take_events``).
        vocab_size: when given, token ids >= vocab_size are rejected (costs a max() per call).
        host_blocks: slots of the host tier (L2; at most ``MAX_BLOCKS``); 0: none.
        store: a ``prefixkv.store.SharedStore`` (L3) shared with other processes:
            admissions continue a chain past the device and host into it, and the plan
            writes computed blocks to it. Needs ``host_blocks > 0`` and ``hash_mode``
            ``"sha256"`` or ``"xxhash"`` with a ``seed`` (ids equal in every process).

    Raises:
        ConfigError: a size is not a positive int (or ``num_blocks`` or ``host_blocks``
            is past ``MAX_BLOCKS``), a flag not a bool, a bad hash mode/seed,
            a store without host slots or without a hash mode every process shares.

    Thread safety: none, and no lock: one thread (the engine's scheduler) makes every
    call, except ``prepare``, which any thread may call meanwhile.
    """

    # the state, set once by ``__init__`` (``admission.construct``)
    num_blocks: int
    block_size: int
    enable_caching: bool
    vocab_size: int | None
    _max_slots: int  # (num_blocks * block_size: an admission within it needs no fit check)
    _events: EventLog | NullSink
    _host: HostTier | None
    _hasher: Hasher
    _index: ContentIndex | NoIndex
    _pool: BlockPool
    _requests: dict[Hashable, Request]
    _num_prefilling: int  # live requests with prompt tokens not yet scheduled
    _stats: StatsCounter
    _copies: CopyPlan  # the step's fork copies
    _store: StoreLink | None
    _waits: StoreWaits | None
    _computing: list[Fresh]  # contents recorded last step: written to the store next
    _config: tuple[object, ...]  # what ``prepare`` reads
    _prompt_hasher: Hasher | None
    _lean: bool  # ``add_request``'s common case applies
    _ops_pending = False  # (a plan taken with ``pending=True`` awaits ``kv_ops_done``)

    def __init__(
        self, num_blocks: int, block_size: int = 16, *, hash_mode: str | HashFn = "xxhash",
        seed: int | bytes | None = None, enable_caching: bool = True,
        enable_events: bool = False, max_events: int = 1 << 16, vocab_size: int | None = None,
        host_blocks: int = 0, store: SharedStore | None = None,
    ) -> None:
        admission.construct(self, num_blocks, block_size, hash_mode, seed, enable_caching,
                            enable_events, max_events, vocab_size, host_blocks, store)

    # The calls. Each line names the module that holds the call's body and contract.

    # ---- admission: core/admission.py (the common case), core/admit_general.py,
    # store_start.py and store_readmit.py (a store's start, after a fetch), lookups.py
    add_request = admission.add_request
    lookup = lookups.lookup
    lookup_block_ids = lookups.lookup_block_ids
    cached_block_id = lookups.cached_block_id
    block_probe = lookups.block_probe
    held_content = lookups.held_content
    held_contents = lookups.held_contents
    _admit = admit_general._admit
    _readmit = store_readmit._readmit
    _start = store_start._start
    _acquire_loading = admit_general._acquire_loading
    _find = admit_general._find
    _check_fits = admit_general._check_fits
    _get = admission._get
    _encode = admission._encode

    # ---- growth: core/decode.py
    extend = decode.extend
    append_tokens = decode.append_tokens
    append_step = decode.append_step
    reserve = decode.reserve
    _append_at_edge = decode._append_at_edge
    _prepare_fills = decode._prepare_fills
    _step_requests = decode._step_requests
    _grow = decode._grow

    # ---- forks (core/forks.py), leaving (core/release.py), invalid KV (core/invalidation.py)
    fork = forks.fork
    free = release.free
    preempt = release.preempt
    reset_prefix_cache = release.reset_prefix_cache
    uncache_blocks = invalidation.uncache_blocks
    rewind = invalidation.rewind

    # ---- a step's outputs: core/step_outputs.py
    take_kv_ops = step_outputs.take_kv_ops
    kv_ops_done = step_outputs.kv_ops_done
    take_events = step_outputs.take_events
    take_pending_events = step_outputs.take_pending_events
    take_stats = step_outputs.take_stats
    _restated = step_outputs._restated
    _store_puts = step_outputs._store_puts
    _drop_puts = step_outputs._drop_puts

    # ---- checks: core/manager_check.py
    check_invariants = manager_check.check_invariants

    @property
    def stats(self) -> PrefixCacheStats:
        """Cumulative prefix-cache statistics since creation."""
        return self._stats.total

    @property
    def events_dropped(self) -> int:
        """Events dropped because the log overflowed before it was drained."""
        return self._events.dropped

    @property
    def has_pending_events(self) -> bool:
        """Whether ``take_events`` would return any event now (False without events)."""
        return self._events.pending

    # ---- prompts prepared off the scheduler's thread ---------------------------------------

    def prepare(self, prompt_token_ids: Sequence[int], *, extra: ExtraKeys | None = None) -> Prompt:
        """Do once, on any thread, the work admission does on a prompt that does not
        depend on the pool: check it (as ``add_request``), encode it, cut it into block
        chunks, encode its extra keys and, when this manager hashes blocks as it stores
        them (a shared store, a host tier with events on, a hash_mode callable with
        events on), compute the chain hashes of its full blocks. Pass the ``Prompt`` to
        ``add_request``, ``lookup`` or ``lookup_block_ids`` in place of the token ids
        (without ``extra``); any manager of the same block size, vocabulary size, hash
        and seed takes it.

        Thread safety: reads only the manager's configuration, fixed at construction
        (block size, vocabulary size, hash function and root), never its pool, index or
        requests; so an engine's input thread may call it while the scheduler's thread
        admits, decodes and frees (a ``hash_mode`` callable is then called from that
        thread too). Changes nothing.

        Raises TokenError (empty prompt, bad ids or container), ExtraKeysError,
        ConfigError (a hash_mode callable failed), PromptError (``prompt_token_ids`` is a
        Prompt already)."""
        return prepare_prompt(prompt_token_ids, extra, self.block_size, self.vocab_size,
                              self._prompt_hasher, self._config)

    # ---- the shared store's fetches -------------------------------------------------------

    def poll_store(self) -> list[Hashable]:
        """Land the store fetches that ended since the last call, and return the ids of
        the waiting requests (``StoreWait``) whose wait is over: their next
        ``add_request`` admits them with what arrived (checked) as hits (device blocks
        the fetch held for them, or host slots), or computes
        what did not (the fetch failed, found nothing, or passed ``SharedStore.timeout``).
        Call it once a step, before admitting (it never waits; without a store it
        returns [])."""
        return self._waits.poll() if self._waits is not None else []

    def attach_host_memory(self, buffers: Sequence[Sequence[memoryview]]) -> None:
        """Let store fetches read straight into the host slots: ``buffers[slot]`` are
        writable byte views of that slot's memory (e.g. its K and V), in payload order,
        ``StoreLayout.block_bytes`` in all (``prefixkv.store.torch_io.host_slot_views``
        makes them from torch caches). Then no ``StoreFetched`` op is stated. Without it,
        payloads arrive in buffers of their own and ``StoreFetched`` copies them.
        Raises ConfigError without a store, for buffers that do not fit, or while store
        fetches are under way (nothing changes)."""
        if self._waits is None:
            raise ConfigError("attach_host_memory: built without store= (host_blocks=N, store=SharedStore)")
        self._waits.attach(buffers)

    # ---- queries ---------------------------------------------------------------------

    def get_block_ids(self, request_id: Hashable) -> tuple[int, ...]:
        """The request's block ids in token order. Raises RequestError for an unknown id."""
        return tuple(map(_ID, self._get(request_id).blocks))

    def num_blocks_held(self, request_id: Hashable) -> int:
        """How many blocks the request holds: ``len(get_block_ids(request_id))`` without
        the tuple (O(1)). Raises RequestError for an unknown id."""
        return len(self._get(request_id).blocks)

    def shared_prefixes(self, request_ids: Sequence[Hashable]) -> list[SharedPrefix]:
        """Which of these requests hold the same first blocks (a shared system prompt, one
        document asked many questions, forks): for each group, the positions of its
        members in ``request_ids`` and how many leading blocks all of them share, for
        cascade attention (``prefixkv.kernels.build_cascade_batch``). Plain ints; changes
        nothing. Shared blocks are full, but the engine may compute one of them in this
        very step: the kernel side keeps only blocks before each member's new tokens.
        Raises RequestError for an unknown id (before looking at any), or ids not given
        as an iterable, or as a str or bytes (a sequence of one-character ids, never what
        is meant)."""
        if isinstance(request_ids, (str, bytes)) or not isinstance(request_ids, Iterable):
            raise RequestError(f"request_ids must be a sequence of ids, not {request_ids!r}")
        return shared_prefixes([self._get(rid).blocks for rid in request_ids])  # Blocks: identity

    def num_tokens(self, request_id: Hashable) -> int:
        """Known tokens of the request (prompt and appended), scheduled or not. Raises
        RequestError for an unknown id."""
        return len(self._get(request_id).tokens)

    def num_scheduled_tokens(self, request_id: Hashable) -> int:
        """Tokens of the request that have slots (computed or scheduled). Raises
        RequestError for an unknown id."""
        return self._get(request_id).num_scheduled

    @property
    def num_free_blocks(self) -> int:
        """Blocks no live request holds (empty ones and cached ones that may be evicted);
        an admission or growth needing more than this returns None."""
        return self._pool.num_free

    @property
    def num_cached_blocks(self) -> int:
        """Distinct block contents findable by a lookup, whether in use or free."""
        return len(self._index)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live requests (0.0 to 1.0)."""
        return 1.0 - self._pool.num_free / self.num_blocks

    def free_block_order(self) -> list[int]:
        """Free block ids in the order they will be reused (empty ones, then LRU)."""
        return self._pool.free_order()

    def ref_cnt(self, block_id: int) -> int:
        """How many live requests hold block ``block_id`` (RequestError for an id that
        is not one of this pool's)."""
        return self._pool.blocks[check_count("block id", block_id, 0, self.num_blocks - 1)].ref_cnt


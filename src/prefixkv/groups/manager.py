"""The hybrid manager: layer groups (full attention, sliding window, chunked local) with a
block table each, over one shared pool and one prefix-id table.

As a request advances, every windowed group releases the leading blocks that no query at
or after the step's first position reads, but a window's retained tokens'
(``GroupSpec.num_released``): the block goes back to
the pool (cached, findable in its group, if it is full and indexed) and the table entry
becomes the null block. Calls check their input and compute what can fail before any
change; a shortage returns None with nothing changed (blocks a call would release count
as free for it, and stay held when it returns None).

The class body states the whole surface; the long calls are written as functions in a
module each (``self`` the manager), listed here as ``name = module.function``: parts.py
(construction and the helpers every path shares), admission.py (``add_request``,
``lookup``), growth.py (window release and table growth), decode.py (``extend``,
``append_tokens``, ``append_step``, ``reserve``, ``rewind``), forks.py, release.py (frees,
preemption, uncache, reset), manager_check.py; the queries are written here.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from ..core.block import Block
from ..core.pool import BlockPool
from ..core.prompt import Prompt
from ..errors import check_count
from ..event_log import EventLog, NullSink, PendingEvents
from ..events import AllBlocksCleared, Event
from ..extra_keys import ExtraKeys
from ..hashing import HashFn
from ..index import Hasher
from ..stats import PrefixCacheStats, StatsCounter
from . import admission, cached, checkpoints, decode, forks, growth, manager_check, partial, parts, release
from . import lookahead as ahead
from .index import GroupIndex
from .lookup import peeking
from .pins import RewindPins
from .prefixes import Prefix, PrefixTable
from .request import GroupRequest
from .results import GroupBlockCopy, GroupStats
from .sizes import BlockSizes
from .spec import GroupSpec
from .taint import reads_lost


class HybridKVCacheManager:
    """Paged KV blocks for a model whose layers form attention groups, with automatic
    prefix caching per group.

    Args:
        groups: one ``GroupSpec`` per group of layers (``full_attention()``,
            ``sliding_window(W)``, ``chunked_local(C)``), in the engine's group order.
        block_size: one block size (tokens) for every group, or a ``BlockSizes``
            (``BlockSizes.of(sizes, hash_size, align)``: one size per group, the hash
            block and the alignment of hits and caching; docs/groups.md). Sizes that
            are not ``one_size``, or a window's ``retention`` at one size, make the
            manager a ``SizedHybridKVCacheManager`` (groups/sized.py: what it serves
            and refuses); one size is the one-size manager (``sizes`` says what it was
            given).
        num_blocks, hash_mode, seed, enable_events, max_events, vocab_size:
            as ``KVCacheManager``. One block is reserved as ``null_block_id`` when some
            group releases blocks. No host tier.
        enable_caching: False records no block's content in any group (as every group
            were an uncached window: nothing is found, every block goes back empty,
            to be reused first; vLLM's manager with prefix caching off).
        hash_lookahead_tokens: L > 0 keys each hash block with the L tokens after it
            (vLLM's ``num_hash_lookahead_tokens``; groups/lookahead.py): prompts are
            prepared with those keys, ``know_tokens`` hands a request the tokens known
            past its own, and a block gets its prefix id once its L tokens are known.
            With groups of different block sizes, without events (ConfigError).

    Raises:
        ConfigError: no groups or not GroupSpecs, a size not a positive int (or
            ``num_blocks`` past ``MAX_BLOCKS``), a flag not a bool, a bad hash mode/seed,
            no block left beside the null block; ``block_size`` a ``BlockSizes`` that
            ``BlockSizes.of`` refuses, of another number of groups than ``groups``, or
            (not served yet) not ``one_size`` (or a window's ``retention``) in a
            subclass or beside an uncached window (``GroupSpec.cached``).

    Thread safety: as ``KVCacheManager``'s (one thread makes every call but ``prepare``).
    """

    # the state, set once by ``__init__`` (``parts.construct``)
    groups: tuple[GroupSpec, ...]
    num_blocks: int
    _serves_sizes = False  # (sizes that are not ``one_size``: ``SizedHybridKVCacheManager``)
    _hash_size: int  # ``sizes.hash_size``: the prefix ids' (``nodes``') block of tokens
    _group_sizes: tuple[int, ...]  # ``sizes.sizes``
    sizes: BlockSizes  # per group, the hash block and the alignment (one size: all equal)
    block_size: int  # the one block size (with different sizes: ``sizes.align``, the lcm)
    vocab_size: int | None
    _hasher: Hasher
    _events: EventLog | NullSink
    _table: PrefixTable
    _index: GroupIndex
    _pool: BlockPool
    _null: Block | None  # (``null_block_id``)
    _requests: dict[Hashable, GroupRequest]
    _stats: StatsCounter
    _released: list[int]  # per group: blocks released
    _hit_blocks: list[int]  # per group: hit blocks taken
    _kv_ops: list[GroupBlockCopy]  # the fork copies since ``take_kv_ops``
    _held_copies: list[GroupBlockCopy] | None = None  # copies on write holding their blocks
    _owners: partial.Owners | None = None  # (request id -> the partial entries it owns)
    _fine: tuple[int, ...] = ()  # full-attention groups larger than the hash block (partial_full.py)
    _fine_top: tuple[Sequence[Prefix], int, int] | None = None  # (partial_full.extend)
    _fine_plain: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())  # (partial_full.longest_hit)
    _checkpoints: checkpoints.Steps | None = None  # (request id -> its last step's checkpoints)
    _nothing: tuple[tuple[int, ...], ...]  # (no block ids in any group)
    _sparse: tuple[int, ...]  # the sparse (Mamba) groups
    _ahead: tuple[int, ...] | None  # blocks each group holds ahead (spec_blocks.py), None if none
    _ahead0: int  # group 0's (its table length measures growth)
    _uncached: bool  # some group is an uncached window (``GroupSpec.cached``)
    _retains: bool  # requests keep GroupRequest.marks: a group's retention, or checkpoints' junction
    _least_new: int  # the fewest tokens an admission schedules (0 beside an uncached window)
    _record_kinds: tuple[int, ...]  # per group, how ``_record`` treats its blocks (parts.py)
    _config: tuple[object, ...]  # what ``prepare`` reads
    _prompt_hasher: Hasher | None
    _num_prefilling = 1  # no count of prefilling requests is kept here: always check
    _lookahead = 0  # (``hash_lookahead_tokens``: groups/lookahead.py)
    _tail_gap = 1  # the tokens a prompt's partial tail or checkpoint leaves after it: max(1, L)
    _pins: RewindPins | None = None  # (made by the first rewind: most managers never rewind)

    def __init__(
        self, groups: Sequence[GroupSpec], num_blocks: int, block_size: int | BlockSizes = 16, *,
        hash_mode: str | HashFn = "xxhash", seed: int | bytes | None = None,
        enable_events: bool = False, max_events: int = 1 << 16, vocab_size: int | None = None,
        enable_caching: bool = True, hash_lookahead_tokens: int = 0,
    ) -> None:
        parts.construct(self, groups, num_blocks, block_size, hash_mode, seed, enable_events,
                        max_events, vocab_size, enable_caching, hash_lookahead_tokens)

    # The calls. Each line names the module that holds the call's body and contract.

    # ---- admission and lookups: groups/admission.py
    prepare = admission.prepare
    add_request = admission.add_request
    lookup = admission.lookup
    lookup_block_ids = admission.lookup_block_ids
    cached_block_ids = cached.cached_block_ids
    prefix_probe = cached.prefix_probe
    held_content = cached.held_content
    held_contents = cached.held_contents
    know_tokens = ahead.know_tokens  # (groups/lookahead.py)
    _find = admission._find
    _admit = admission._admit
    _enter = admission._enter
    _hit_nodes = admission._hit_nodes

    # ---- growth: groups/decode.py (the calls), groups/growth.py (their mechanism)
    extend = decode.extend
    append_tokens = decode.append_tokens
    append_step = decode.append_step
    reserve = decode.reserve
    num_blocks_to_allocate = decode.num_blocks_to_allocate
    release_unread = decode.release_unread
    bound_release = decode.bound_release
    rewind = decode.rewind
    num_blocks_released = decode.num_blocks_released
    _step_requests = decode._step_requests
    _release = growth._release
    _release_order = growth._release_order
    _going = growth._going
    _roomy = growth._roomy
    _prepare_fills = growth._prepare_fills
    _grow = growth._grow
    _holes = growth._holes
    _fill = growth._fill
    _take = growth._take

    # ---- forks (groups/forks.py), leaving and invalid KV (groups/release.py)
    fork = forks.fork
    free = release.free
    preempt = release.preempt
    uncache_blocks = release.uncache_blocks
    reset_prefix_cache = release.reset_prefix_cache
    release_copies = partial.release_copies  # (partial hits' copies on write: groups/partial.py)
    num_pending_copies = partial.num_pending_copies
    owned_entries = partial.owned_entries
    _free_order = release._free_order

    # ---- the helpers every path shares: groups/parts.py
    _prepare = parts._prepare
    _record = parts._record
    _num_fresh = parts._num_fresh
    _ids = parts._ids
    _step_encode = parts._step_encode
    _get = parts._get

    # ---- checks: groups/manager_check.py
    check_invariants = manager_check.check_invariants
    _check_request = manager_check._check_request

    @property
    def hash_lookahead_tokens(self) -> int:
        """L, the tokens after each hash block its key covers (0: none; groups/lookahead.py)."""
        return self._lookahead

    @property
    def null_block_id(self) -> int | None:
        """The block id that fills released positions of windowed groups' tables (block
        0, reserved for this at construction: never handed to a request, never written,
        never read by the kernels, which skip keys outside the window); None when no
        group releases blocks."""
        return self._null.block_id if self._null is not None else None

    # ---- queries ---------------------------------------------------------------------

    def lookup_per_group(self, prompt_token_ids: Sequence[int] | Prompt, *,
                         extra: ExtraKeys | None = None, peek: bool = False) -> tuple[int, ...]:
        """Per group, the tokens of the longest prefix of this prompt (at most all its
        blocks but the one holding its last token; with ``peek``, that one too when it
        is full, as vLLM's EAGLE looks at it) that the group alone could serve now:
        where ``lookup``, which every group must serve, is shorter, a shared prefix some
        group has not cached (vLLM's Mamba junction). Changes nothing. Raises as
        ``add_request`` for bad input, and ConfigError for ``peek`` with groups of
        different block sizes."""
        alone = [0] * len(self.groups)
        self._find(None, prompt_token_ids, extra, True, alone, None,
                   peeking(self.groups, True) if peek else ())
        return tuple(k * self._hash_size for k in alone)

    def get_block_ids(self, request_id: Hashable) -> tuple[tuple[int, ...], ...]:
        """The request's block ids per group, in token order (``null_block_id`` where a
        windowed group released the block). Raises RequestError for an unknown id."""
        return tuple(map(tuple, self._ids(self._get(request_id))))

    def num_tokens(self, request_id: Hashable) -> int:
        """Known tokens of the request (prompt and appended), scheduled or not. Raises
        RequestError for an unknown id."""
        return len(self._get(request_id).tokens)

    def num_scheduled_tokens(self, request_id: Hashable) -> int:
        """Tokens of the request that have slots (computed or scheduled). Raises
        RequestError for an unknown id."""
        return self._get(request_id).num_scheduled

    def reads_released(self, request_id: Hashable, num_tokens: int) -> bool:
        """Whether a step of the request computing from ``num_tokens`` would read KV its
        tables no longer hold: an entry a window released (after a ``rewind``, or below
        an admission's ``num_external_tokens`` whose load then failed), an uncached
        window's position below those its engine rebuilt at admission, or a Mamba state
        no block holds. ``rewind`` to such a point keeps what is computed from there
        uncached (groups/taint.py). Changes nothing. Raises RequestError (unknown id,
        ``num_tokens`` outside ``[0, num_scheduled_tokens]``)."""
        req = self._get(request_id)
        check_count("num_tokens", num_tokens, 0, req.num_scheduled)
        if num_tokens >= req.step_start and not self._sparse:
            return False  # (what the windows released no query at the last step's start read)
        return reads_lost(self.groups, req, num_tokens, self._group_sizes)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no live request holds (the null block is held)."""
        return self._pool.num_free

    @property
    def num_cached_blocks(self) -> int:
        """Findable contents, summed over the groups."""
        return len(self._index)

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks (all but the null block) held by live requests."""
        usable = self.num_blocks - (self._null is not None)
        return 1.0 - self._pool.num_free / usable

    def free_block_order(self) -> list[int]:
        """Free block ids in the order they will be reused (empty ones, then LRU)."""
        return self._pool.free_order()

    def ref_cnt(self, block_id: int) -> int:
        """How many live requests hold block ``block_id`` (RequestError for an id that
        is not one of this pool's)."""
        return self._pool.blocks[check_count("block id", block_id, 0, self.num_blocks - 1)].ref_cnt

    @property
    def stats(self) -> PrefixCacheStats:
        """Cumulative prefix-cache statistics (a hit counts the tokens every group served)."""
        return self._stats.total

    def take_stats(self) -> PrefixCacheStats:
        """Statistics since the previous ``take_stats`` (get-and-reset)."""
        return self._stats.take()

    def group_stats(self) -> tuple[GroupStats, ...]:
        """Per group: blocks held and cached now, blocks released and hit blocks taken."""
        held: list[set[int]] = [set() for _ in self.groups]
        for req in self._requests.values():
            for g, t in enumerate(req.tables):
                held[g].update(b.block_id for b in t if b is not None)
        return tuple(GroupStats(g, s.kind, s.tokens, len(held[g]), len(self._index.entries[g]),
                                self._released[g], self._hit_blocks[g])
                     for g, s in enumerate(self.groups))

    @property
    def events_dropped(self) -> int:
        """Events dropped because the log overflowed before it was drained."""
        return self._events.dropped

    @property
    def has_pending_events(self) -> bool:
        """Whether ``take_events`` would return any event now (False without events)."""
        return self._events.pending

    def take_events(self) -> list[Event]:
        """Events since the previous call (``GroupBlockStored`` / ``GroupBlockRemoved``,
        ``AllBlocksCleared``), as ``KVCacheManager.take_events``: after an overflow,
        ``AllBlocksCleared`` and one ``GroupBlockStored`` per findable content."""
        out = self._events.take()
        return [AllBlocksCleared(), *self._index.snapshot()] if out is None else out

    def take_pending_events(self) -> PendingEvents:
        """``take_events()`` as a ``PendingEvents`` (see ``KVCacheManager
        .take_pending_events``); a hybrid manager builds its events as it stores, so the
        batch is built already."""
        return PendingEvents.built(self.take_events())

    def take_kv_ops(self) -> list[GroupBlockCopy]:
        """The fork copies since the previous call (run them before the next forward
        pass, in this order); call it once a step. Every copy stated is kept, even when
        its child or parent is freed first: no host tier, so nothing of the plan runs
        before the copies, a block freed and handed out again in the step is written
        after its copy, and a chain (a fork of a fork) runs in order. With partial hits
        (``BlockSizes.partial``), the copies on write too, whose two blocks stay held
        until ``release_copies`` gives them back once the copy ran (groups/partial.py)."""
        out, self._kv_ops = self._kv_ops, []
        return out


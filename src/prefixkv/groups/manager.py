"""The hybrid manager: layer groups (full attention, sliding window, chunked local) with a
block table each, over one shared pool and one prefix-id table.

As a request advances, every windowed group releases the leading blocks that no query at
or after the step's first position reads (``GroupSpec.num_unread``): the block goes back to
the pool (cached, findable in its group, if it is full and indexed) and the table entry
becomes the null block. Calls check their input and compute what can fail before any
change; a shortage returns None with nothing changed (blocks a call would release count
as free for it, and stay held when it returns None).

The class is built in layers, one noun each: ``GroupParts`` (construction and the
helpers every path shares; parts.py), ``GroupAdmitter`` (``add_request``, ``lookup``;
admission.py), ``GroupGrowth`` (window release and table growth; growth.py),
``GroupDecoder`` (``extend``, ``append_tokens``, ``append_step``, ``reserve``,
``rewind``; decode.py), and here forks, frees, preemption, reset and the queries.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

from ..core.block import Block
from ..core.dependents import computed_on
from ..core.prompt import Prompt
from ..errors import ConfigError, RequestError, check_block_ids, check_count, check_new_request
from ..event_log import PendingEvents
from ..events import AllBlocksCleared, Event
from ..extra_keys import ExtraKeys
from ..hashing import HashFn
from ..stats import PrefixCacheStats
from .decode import GroupDecoder
from .free_order import free_order
from .free_runs import finder, unfound
from .request import GroupRequest
from .results import GroupBlockCopy, GroupFork, GroupStats
from .spec import GroupSpec
from .taint import reads_lost


class HybridKVCacheManager(GroupDecoder):
    """Paged KV blocks for a model whose layers form attention groups, with automatic
    prefix caching per group.

    Args:
        groups: one ``GroupSpec`` per group of layers (``full_attention()``,
            ``sliding_window(W)``, ``chunked_local(C)``), in the engine's group order.
        num_blocks, block_size, hash_mode, seed, enable_events, max_events, vocab_size:
            as ``KVCacheManager``. One block is reserved as ``null_block_id`` when some
            group releases blocks. No host tier.

    Raises:
        ConfigError: no groups or not GroupSpecs, a size not a positive int (or
            ``num_blocks`` past ``MAX_BLOCKS``), a flag not a bool, a bad hash mode/seed,
            no block left beside the null block.

    Thread safety: as ``KVCacheManager``'s (one thread makes every call but ``prepare``).
    """

    def __init__(
        self, groups: Sequence[GroupSpec], num_blocks: int, block_size: int = 16, *,
        hash_mode: str | HashFn = "xxhash", seed: int | bytes | None = None,
        enable_events: bool = False, max_events: int = 1 << 16, vocab_size: int | None = None,
    ) -> None:
        """The arguments and what they raise: the class docstring. (Stated here, not
        inherited: a wrong keyword's TypeError names this class, and mypy checks it.)"""
        super().__init__(groups, num_blocks, block_size, hash_mode=hash_mode, seed=seed,
                         enable_events=enable_events, max_events=max_events, vocab_size=vocab_size)

    # ---- forks, free, preemption -------------------------------------------------------

    def fork(self, parent_id: Hashable, child_id: Hashable) -> GroupFork | None:
        """Create ``child_id`` sharing the parent's full blocks in every group (and its
        released entries); each group's partial last block (and any reserved block) is
        copied on write (the copies are in the result and in ``take_kv_ops()``). Returns
        None when those blocks cannot be had (nothing changed). Raises RequestError (unknown parent, child
        id in use, parent's prefill not fully scheduled), ConfigError when a group is
        sparse (Mamba: a fork would need its state block copied, not offered)."""
        parent = self._get(parent_id)
        if any(s.sparse for s in self.groups):
            raise ConfigError("fork is not offered for a model with a Mamba (sparse) group")
        check_new_request(self._requests, child_id)
        if parent.num_scheduled != len(parent.tokens):
            raise RequestError(f"cannot fork {parent_id!r} before its prefill is fully scheduled")
        full = parent.num_scheduled // self.block_size
        held: list[Block] = [b for t in parent.tables for b in t[:full] if b is not None]
        # the entries from ``full`` on are copied on write; a released one (None) stays
        # released: a rewind can take a request back before blocks its windows released
        need = sum(b is not None for t in parent.tables for b in t[full:])
        if not self._pool.can_acquire(held, need):
            return None
        fresh = iter(self._pool.acquire(held, need)[len(held):])
        child = GroupRequest(child_id, parent.tokens[:], parent.keys, len(self.groups))
        copies = []
        for g, table in enumerate(parent.tables):
            new = [None if b is None else next(fresh) for b in table[full:]]
            self._index.own(g, [b for b in new if b is not None])
            child.tables[g] = table[:full] + new
            copies += [GroupBlockCopy(a.block_id, b.block_id, g)
                       for a, b in zip(table[full:], new, strict=True) if a is not None and b is not None]
        child.cut = parent.cut[:]
        child.num_reserved = parent.num_reserved
        child.next_release = parent.next_release
        child.nodes = parent.nodes[:]
        self._table.hold(child.nodes[-1] if child.nodes else None)
        child.num_scheduled, child.step_start = parent.num_scheduled, parent.step_start
        child.num_cached = full * self.block_size
        child.tainted_from, child.losses = parent.tainted_from, parent.losses  # (the
        # parent's KV, found as the parent's is)
        self._kv_ops += copies
        self._requests[child_id] = child
        return GroupFork(child_id, tuple(map(tuple, self._ids(child))), tuple(copies))

    def free(self, request_id: Hashable, *, num_computed_tokens: int | None = None) -> None:
        """Release a request's blocks in every group; cached ones stay findable in their
        group until evicted, which takes first those released first: vLLM's order (group
        by group, each group's tail first), but a block no hit of the request's prefix
        can use goes ahead as soon as it becomes so (free_order.py): however many of
        them are evicted, every hit of its prefix that vLLM's order keeps is kept.
        ``num_computed_tokens``: as ``KVCacheManager.free`` (full blocks past it were
        never computed and become unfindable); blocks a window already released are not
        reached, so pass at least the start of the last step scheduled (what an engine
        dropping a request before that step ran knows). Raises RequestError for an unknown or
        freed id, or a count outside ``[0, num_scheduled_tokens]``."""
        req = self._get(request_id)
        if num_computed_tokens is not None:
            check_count("num_computed_tokens", num_computed_tokens, 0, req.num_scheduled)
            bs = self.block_size
            first = max(num_computed_tokens, req.num_cached) // bs
            for t in req.tables:
                self._pool.emptied(self._index.uncache(
                    [b for b in t[first:req.num_scheduled // bs] if b is not None]))
        del self._requests[request_id]
        nodes = req.nodes
        # a longer prefix exists (a child, or another request ending here): a reference on
        # the last node beside its blocks' and the request's own
        longer = bool(nodes) and nodes[-1].refs > self._index.num_blocks_of(nodes[-1]) + 1
        self._pool.release(free_order(self.groups, self.block_size, req,
                                      finder(self._index, req), longer))
        self._table.unhold(req.nodes[-1] if req.nodes else None)

    def preempt(self, request_id: Hashable, *,
                num_computed_tokens: int | None = None) -> tuple[int, ...]:
        """Free a running request (as ``free``) and return all its known token ids, for
        ``add_request(..., resumed=True)``. Raises as ``free``."""
        tokens = tuple(self._get(request_id).tokens)
        self.free(request_id, num_computed_tokens=num_computed_tokens)
        return tokens

    def uncache_blocks(self, block_ids: Iterable[int]) -> None:
        """As ``KVCacheManager.uncache_blocks``: make the content of these blocks
        unfindable in their group (their KV turned out invalid) while live requests hold
        them; a block no request holds is left as it is. Each live request holding one
        loses the content of its full blocks after it too, in every group (computed on
        top of it), and so on for a request holding one of those (it hit it, and
        computed its own after it: ``computed_on``). A prefix left in no block of a
        group goes from every group with its descendants (``GroupIndex.uncache``), and
        what a request fills after such a block is never found. Raises RequestError for
        an id outside the pool, or ``block_ids`` not an iterable (nothing changes)."""
        blocks = self._pool.blocks
        ids = check_block_ids(block_ids, len(blocks))
        going = [blocks[i] for i in ids if blocks[i].ref_cnt > 0]
        if going:  # (and what live requests computed on top of them, hits of it included)
            going = computed_on(((r.tables, len(r.nodes)) for r in self._requests.values()),
                                going, () if self._null is None else (self._null,))
        self._pool.emptied(self._index.uncache(going))

    def reset_prefix_cache(self) -> bool:
        """Drop all cached content in every group, only when no request holds a block
        (and the pending copies, whose blocks no request holds then). Returns whether it
        did."""
        if self._requests:
            return False
        self._kv_ops.clear()  # every pending copy writes a block that no request holds
        if self._null is not None:
            self._pool.release([self._null])
        cleared = self._pool.reset()
        assert cleared, "no request is live, yet a block is held"
        if self._null is not None:
            self._null = self._pool.take(1)[0]
        self._events.clear()
        self._events.append(AllBlocksCleared())
        return True

    # ---- queries ---------------------------------------------------------------------

    def lookup_per_group(self, prompt_token_ids: Sequence[int] | Prompt, *,
                         extra: ExtraKeys | None = None) -> tuple[int, ...]:
        """Per group, the tokens of the longest prefix of this prompt (at most all its
        blocks but the one holding its last token) that the group alone could serve now:
        where ``lookup``, which every group must serve, is shorter, a shared prefix some
        group has not cached (vLLM's Mamba junction). Changes nothing. Raises as
        ``add_request`` for bad input."""
        alone = [0] * len(self.groups)
        self._find(None, prompt_token_ids, extra, True, alone)
        return tuple(k * self.block_size for k in alone)

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
        an admission's ``num_external_tokens`` whose load then failed), or a Mamba state
        no block holds. ``rewind`` to such a point keeps what is computed from there
        uncached (groups/taint.py). Changes nothing. Raises RequestError (unknown id,
        ``num_tokens`` outside ``[0, num_scheduled_tokens]``)."""
        req = self._get(request_id)
        check_count("num_tokens", num_tokens, 0, req.num_scheduled)
        if num_tokens >= req.step_start and not self._sparse:
            return False  # (what the windows released no query at the last step's start read)
        return reads_lost(self.groups, req, num_tokens, self.block_size)

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
        after its copy, and a chain (a fork of a fork) runs in order."""
        out, self._kv_ops = self._kv_ops, []
        return out

    def check_invariants(self) -> None:
        """Verify every count and link: the pool and free queue, each group's index, the
        prefix-id table and its references, refcounts against the live requests, each
        request's tables against its tokens and its windows. Raises InvariantError."""
        refs: dict[int, int] = {}
        if self._null is not None:
            refs[self._null.block_id] = 1
        node_refs = self._index.node_refs()
        for req in self._requests.values():
            self._require(req.check(self.groups, self.block_size) or unfound(self._index, req))
            for t in req.tables:
                for b in t:
                    if b is not None:
                        refs[b.block_id] = refs.get(b.block_id, 0) + 1
            if req.nodes:
                pid = req.nodes[-1].pid
                node_refs[pid] = node_refs.get(pid, 0) + 1
        self._require(self._pool.check(refs))
        self._require(self._table.check(node_refs))

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

from ..errors import ConfigError, RequestError, check_block_ids, check_count, check_new_request
from ..events import AllBlocksCleared
from ..extra_keys import ExtraKeys
from ..hashing import HashFn
from ..results import Fork, SharedPrefix
from ..store.shared import SharedStore
from .block import Block
from .dependents import computed_on
from .prompt import Prompt, prepare_prompt
from .sharing import shared_prefixes
from .step_outputs import StepOutputs
from .store_giveup import give_up, held_by_others

_ID = attrgetter("block_id")


class KVCacheManager(StepOutputs):
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

    def __init__(
        self, num_blocks: int, block_size: int = 16, *, hash_mode: str | HashFn = "xxhash",
        seed: int | bytes | None = None, enable_caching: bool = True,
        enable_events: bool = False, max_events: int = 1 << 16, vocab_size: int | None = None,
        host_blocks: int = 0, store: SharedStore | None = None,
    ) -> None:
        """The arguments and what they raise: the class docstring. (Stated here, not
        inherited: a wrong keyword's TypeError names this class, and mypy checks it.)"""
        super().__init__(num_blocks, block_size, hash_mode=hash_mode, seed=seed,
                         enable_caching=enable_caching, enable_events=enable_events,
                         max_events=max_events, vocab_size=vocab_size,
                         host_blocks=host_blocks, store=store)

    # ---- admission (Admitter), growth (Decoder) -----------------------------------------

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

    def lookup(self, prompt_token_ids: Sequence[int] | Prompt, *,
               extra: ExtraKeys | None = None, max_hit_tokens: int | None = None) -> int:
        """Tokens of this prompt that an admission now (with this ``max_hit_tokens``)
        would find cached on the device and in host slots. Changes nothing (no
        references, no stats, no LRU update) and never asks the shared store. Takes a
        ``Prompt`` as ``add_request`` does. Raises as ``add_request`` for bad input."""
        if max_hit_tokens is not None:
            check_count("max_hit_tokens", max_hit_tokens, 0, None)
        return len(self._find(None, prompt_token_ids, extra, True, None, max_hit_tokens)[1]) * self.block_size

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
            raise ConfigError("attach_host_memory needs a manager with a shared store")
        self._waits.attach(buffers)

    def lookup_block_ids(self, prompt_token_ids: Sequence[int] | Prompt, *,
                         extra: ExtraKeys | None = None, max_hit_tokens: int | None = None
                         ) -> tuple[int, ...]:
        """The device blocks of the prefix ``lookup`` finds, in token order (it stops at
        the first block that is not in the device pool: host tier, store). Changes
        nothing. Takes a ``Prompt``. Raises as ``add_request`` for bad input."""
        if max_hit_tokens is not None:
            check_count("max_hit_tokens", max_hit_tokens, 0, None)
        hits = self._find(None, prompt_token_ids, extra, True, None, max_hit_tokens)[1]
        out = []
        for b in hits:
            if type(b) is not Block:
                break
            out.append(b.block_id)
        return tuple(out)

    # ---- forks, free, preemption -------------------------------------------------------

    def fork(self, parent_id: Hashable, child_id: Hashable) -> Fork | None:
        """Create ``child_id`` sharing the parent's full blocks (parallel sampling, beam
        search). The parent's partial last block is copied on write: the child gets a new
        block, and the copy is in ``copies`` and in ``take_kv_ops()``. The copy runs
        before this step's forward pass: fork once the parent's scheduled tokens were
        computed (after their step ran, as an engine forks after sampling).
        Returns None when that block cannot be had (nothing changed). Raises RequestError
        (unknown parent, child id in use: live, or waiting on the store; parent's prefill
        not fully scheduled)."""
        parent = self._get(parent_id)
        check_new_request(self._requests, child_id)
        if self._waits is not None and child_id in self._waits.waiting:  # (its ``free``
            # would end the wait and leave the child live)
            raise RequestError(f"request {child_id!r} is waiting on the store (StoreWait)")
        if parent.num_scheduled != len(parent.tokens):
            raise RequestError(f"cannot fork {parent_id!r} before its prefill is fully scheduled")
        full = parent.num_scheduled // self.block_size
        shared = parent.blocks[:full]
        if not self._pool.can_acquire(shared, len(parent.blocks) - full):
            return None
        child = parent.fork(child_id, self.block_size)
        child.blocks = self._pool.acquire(shared, len(parent.blocks) - full)
        copies = self._copies.add(parent.blocks[full:], child.blocks[full:])
        self._requests[child_id] = child
        return Fork(child_id, tuple(map(_ID, child.blocks)), copies)

    def free(self, request_id: Hashable, *, num_computed_tokens: int | None = None) -> None:
        """Release a finished, aborted or preempted request's blocks, tail of the chain
        first (so of these, the block ending the longest prefix is evicted first). Cached
        blocks keep their content and stay findable until evicted.

        ``num_computed_tokens``: pass it when the request is dropped before all its
        scheduled tokens were computed (aborted before its step ran): full blocks past it
        are made unfindable, so no later request hits KV that was never written. Default:
        every scheduled token was computed. (Requests that hit those blocks in the same
        step must not run without them either.) A request that waits on the store
        (``StoreWait``) is not live: its wait is forgotten (its fetch still lands, and
        gives back the device blocks it holds: at once if it landed, else then), and its
        ``num_computed_tokens`` can only be 0.
        Raises RequestError for an unknown or already freed id, or a count outside
        ``[0, num_scheduled_tokens]``.
        """
        if self._waits is not None and self._waits.leave(request_id, num_computed_tokens) is not None:
            return  # it waited on the store, holding nothing
        req = self._get(request_id)
        if num_computed_tokens is not None:
            check_count("num_computed_tokens", num_computed_tokens, 0, req.num_scheduled)
            bs = self.block_size
            first = max(num_computed_tokens, req.num_cached) // bs
            self._pool.emptied(self._index.uncache(req.blocks[first:req.num_scheduled // bs]))
        del self._requests[request_id]
        if req.num_scheduled < len(req.tokens):
            self._num_prefilling -= 1
        # a pending copy into a block going back to the pool must not run (the block may
        # be a load's target in this step); its source may go back then, ahead of these
        # blocks (it may hold content computed on them: copies.py)
        if self._copies.copies:
            unpinned = self._copies.settle(req.blocks, self._pool.blocks)
            if unpinned:
                self._pool.release(unpinned)
        self._pool.release(reversed(req.blocks))

    def uncache_blocks(self, block_ids: Iterable[int]) -> None:
        """Make the content of these blocks unfindable (their KV turned out invalid, e.g.
        a load that failed) while live requests hold them; a block no request holds is
        left as it is. The shared store's pending writes of these blocks and of every
        block computed on top of them are dropped. A content that leaves the index so
        takes the cached blocks recorded under it along (and theirs: withdrawn, free ones
        empty), and blocks its request fills after it are not findable until ``rewind``
        recomputes them. Each live request holding one loses the content of its full
        blocks after it too (computed on top of it), also when another block keeps the
        named one's content findable (a spare), and so on for a request holding one of
        those. A store fetch holding one of these blocks, or one that lost its content
        with them (its device hits, or its landed run), gives it up, with every block
        after it in its chain (``rewind`` then finds them the request's alone); a fetch
        left with no valid hit before its run landed ends its request's wait (listed by
        the next ``poll_store``: it computes). Raises RequestError for an id outside
        the pool, or ``block_ids`` not an iterable (nothing changes)."""
        blocks = self._pool.blocks
        ids = check_block_ids(block_ids, len(blocks))
        held = [blocks[i] for i in ids if blocks[i].ref_cnt > 0]
        if held:  # (and the blocks live requests computed on top of them)
            bs = self.block_size
            # (the holds of pending copies and store fetches: no request to look for)
            outside = self._copies.pins + (self._waits.holds() if self._waits is not None else [])
            held = computed_on((((r.blocks,), r.num_scheduled // bs)
                                for r in self._requests.values()), held, outside)
        landing = getattr(self._index, "landing", None)
        if landing:  # (blocks a store fetch fills: no findable content yet, as a free block)
            apart = {id(b) for run in landing.values() for b in run}
            held = [b for b in held if id(b) not in apart]
        self._drop_puts(held)  # (the store's pending writes: before the index forgets)
        self._pool.emptied(self._index.uncache(held, cut=True))
        if self._waits is not None and self._waits.holders:  # (a store fetch's holds on
            give_up(self._waits, held, True)  # them, and on what lost its content with them)

    def rewind(self, request_id: Hashable, num_tokens: int) -> None:
        """Take the request back to its first ``num_tokens`` scheduled tokens, to be
        recomputed (KV after them turned out invalid: ``uncache_blocks``; vLLM then sets
        its computed tokens back). Its tokens stay known: ``extend`` schedules them again
        in the step that recomputes them, and the full blocks they fill are cached anew
        (before, a block ``uncache_blocks`` emptied stayed unfindable while its request
        lived, recomputed or not). Its full blocks from ``num_tokens`` on lose their
        content and pending store writes, and stay in its table as reserved slots.
        Raises RequestError (unknown id, ``num_tokens`` outside ``[0,
        num_scheduled_tokens]``, or one of those blocks held by another request too,
        which must be freed or preempted first), before any change. A store fetch
        holding one of them (another request's device hits, or its run landed on the
        device) is no such request: it gives them up, as after ``uncache_blocks``."""
        req = self._get(request_id)
        check_count("num_tokens", num_tokens, 0, req.num_scheduled)
        full = num_tokens // self.block_size
        tail = req.blocks[full:req.num_scheduled // self.block_size]
        waits = self._waits
        shared = [b.block_id for b in held_by_others(waits, tail)]  # (a store fetch's hold
        if shared:  # is given up: ``store_giveup.py``)
            raise RequestError(f"request {request_id!r} cannot rewind to {num_tokens}: blocks "
                               f"{shared} are held by other requests too")
        if waits is not None and waits.holders:  # (before ``uncache``: the request's alone,
            give_up(waits, tail, False)  # they lose their content, never kept as spares)
        self._drop_puts(tail)  # (before the index forgets)
        self._pool.emptied(self._index.uncache(tail, cut=True))  # (and their cached children)
        if req.num_scheduled == len(req.tokens) > num_tokens:
            self._num_prefilling += 1
        req.num_reserved = max(req.num_reserved, req.num_scheduled)
        req.num_scheduled = num_tokens
        req.num_cached = min(req.num_cached, full * self.block_size)

    def preempt(self, request_id: Hashable, *, num_computed_tokens: int | None = None) -> tuple[int, ...]:
        """Free a running request (as ``free``, same ``num_computed_tokens``) and return
        all its known token ids (prompt and generated), to pass to ``add_request(...,
        resumed=True)`` when it is re-admitted; it will hit whatever is still cached.
        A request waiting on the store (``StoreWait``) stops waiting, as in ``free``, and
        its prompt is returned (its re-admission hits what its fetch landed meanwhile).
        Raises as ``free``."""
        waits = self._waits
        waited = waits.leave(request_id, num_computed_tokens) if waits is not None else None
        if waited is not None:
            return tuple(waited.tokens)
        tokens = tuple(self._get(request_id).tokens)
        self.free(request_id, num_computed_tokens=num_computed_tokens)
        return tokens

    def reset_prefix_cache(self) -> bool:
        """Drop all cached content, only when no block is in use (a store fetch's held
        blocks included), no store fetch is under way and no plan's copies run
        (``take_kv_ops(pending=True)``). Returns whether it did."""
        if self._ops_pending or self._waits is not None and self._waits.in_flight \
                or not self._pool.reset():
            return False
        if self._host is not None:
            self._host.clear()
        self._events.append(AllBlocksCleared())
        return True

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

    def check_invariants(self) -> None:
        """Verify every count and link (pool, free queue, index, refcounts against the
        live requests, each request's blocks against its tokens). Raises InvariantError."""
        refs: dict[int, int] = {}
        bs = self.block_size
        prefilling = sum(r.num_scheduled < len(r.tokens) for r in self._requests.values())
        self._require(None if prefilling == self._num_prefilling else
                      f"{prefilling} requests are prefilling, counted {self._num_prefilling}")
        for req in self._requests.values():
            self._require(req.check(bs) or self._index.check_request(req, bs))
            for b in req.blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for b in self._copies.pins + [b for held in self._copies.kept for b in held]:
            refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for b in self._waits.holds() if self._waits is not None else ():  # store fetches'
            refs[b.block_id] = refs.get(b.block_id, 0) + 1
        self._require(self._pool.check(refs))
        self._require(self._copies.check(self._pool.blocks,
                                         self._host.load_dst if self._host is not None else ()))
        if self._host is not None:
            self._require(self._host.check()
                          or self._host.check_loads(self._pool.blocks))
        if self._waits is not None:
            landing = self._host.num_landing  # type: ignore[union-attr]
            self._require(None if landing == self._waits.reserved else
                          f"{landing} host slots are landing, fetches reserved {self._waits.reserved}")

"""The manager's parts and its admission path (``KVCacheManager`` extends this class).

Admission in one pass over the prompt: encode it once, slice it into block chunks, then
find, verify and take a reference on each cached block in the same loop, stopping at the
first miss (``Index.claim``; ``match`` then ``acquire`` where the index cannot do it in
one pass); then check the pool can serve the rest and compute what the new full blocks
need (chain hashes only if someone consumes them), undoing the references exactly if not;
then take new blocks and record.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Sequence

from ..chunks import Chunks
from ..errors import (
    MAX_BLOCKS,
    ConfigError,
    InvariantError,
    PromptTooLongError,
    RequestError,
    check_count,
    check_flag,
    check_new_request,
    check_positive,
    live_request,
)
from ..event_log import EventLog, NullSink
from ..extra_keys import ExtraKeys
from ..hashing import HashFn, encode_tokens, make_hash_fn, token_bytes
from ..index import ContentIndex, Hasher, NoIndex
from ..index.announce import Fresh
from ..results import Admission, StoreWait
from ..stats import StatsCounter
from ..store.fetch import Fetch
from ..store.shared import SharedStore
from ..tiers import HostTier
from .block import Block, blocks_for, hit_limit, key_chunk
from .copies import CopyPlan
from .pool import BlockPool
from .prompt import Prompt, encode_prompt, unpack_prompt
from .request import GROW_AT, Request, grow_room
from .store_waits import StoreWaits


class Admitter:
    """Construction and ``add_request``; see ``KVCacheManager`` for the arguments."""

    def __init__(
        self, num_blocks: int, block_size: int = 16, *, hash_mode: str | HashFn = "xxhash",
        seed: int | bytes | None = None, enable_caching: bool = True,
        enable_events: bool = False, max_events: int = 1 << 16, vocab_size: int | None = None,
        host_blocks: int = 0, store: SharedStore | None = None,
    ) -> None:
        check_positive("num_blocks", num_blocks, MAX_BLOCKS)
        check_positive("block_size", block_size)
        check_flag("enable_caching", enable_caching, ConfigError)
        check_flag("enable_events", enable_events, ConfigError)
        check_positive("max_events", max_events)
        if vocab_size is not None:
            check_positive("vocab_size", vocab_size)
        if host_blocks:
            check_positive("host_blocks", host_blocks, MAX_BLOCKS)
        elif host_blocks != 0 or type(host_blocks) is not int:
            raise ConfigError(f"host_blocks must be an int >= 0, got {host_blocks!r}")
        if store is not None and not (isinstance(store, SharedStore) and enable_caching
                                      and host_blocks):
            raise ConfigError(f"store must be a SharedStore, with enable_caching=True and "
                              f"host_blocks > 0 (store hits land in host slots), got "
                              f"{store!r}, enable_caching={enable_caching}, host_blocks={host_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._max_slots = num_blocks * block_size  # (``_check_fits``: within it, all fit)
        self.enable_caching = enable_caching
        self.vocab_size = vocab_size
        fn, root = make_hash_fn(hash_mode, seed)
        self._events = EventLog(max_events) if enable_events else NullSink()
        self._host = HostTier(host_blocks, self._events) if host_blocks and enable_caching else None
        self._hasher = Hasher(fn, root, callable(hash_mode))
        self._index = (ContentIndex(self._hasher, self._events, block_size, lower=self._host)
                       if enable_caching else NoIndex())
        self._pool = BlockPool(num_blocks, self._index, self._index.run_counts
                               if isinstance(self._index, ContentIndex) else None)
        self._requests: dict[Hashable, Request] = {}
        self._num_prefilling = 0  # live requests with prompt tokens not yet scheduled
        self._stats = StatsCounter()
        self._copies = CopyPlan()  # the step's fork copies (a closed set: see copies.py)
        self._store = self._waits = None
        self._computing: list[Fresh] = []  # contents recorded last step: written to the store next
        if store is not None:  # the store's keys are chain hashes: every block needs its own
            self._store = store.bind(hash_mode, seed, root, block_size, self._stats, self._hasher.chain)
            self._waits = StoreWaits(self._store, self._host, self._index, self._events,  # type: ignore[arg-type]
                                     block_size, root, self._pool)
            self._index.hashing = True
            self._index.fresh = []  # type: ignore[union-attr]
        # what ``prepare`` reads, all fixed from here on: a Prompt is valid for any manager
        # of equal configuration, and hashes its blocks only if they are hashed as stored
        self._config = (block_size, vocab_size, fn, root)
        self._prompt_hasher = (self._hasher if self._index.hashing
                               and not getattr(self._index, "lazy", False) else None)
        # ``add_request``'s common case applies: a claiming index that hashes nothing as
        # it stores (events deferred, or none), no host tier, no shared store
        self._lean = (isinstance(self._index, ContentIndex) and self._host is None
                      and store is None and self._prompt_hasher is None)

    def add_request(
        self, request_id: Hashable, prompt_token_ids: Sequence[int] | Prompt, *,
        extra: ExtraKeys | None = None, num_new_tokens: int | None = None, resumed: bool = False,
        read_cache: bool = True, num_lookahead_tokens: int = 0, require_full_fit: bool = False,
        keep_free: int = 0, max_hit_tokens: int | None = None,
    ) -> Admission | StoreWait | None:
        """Admit a request: find its longest cached prefix, take references on those
        blocks, allocate blocks for the tokens scheduled now and record the full ones.
        With a shared store, a prefix that continues past the device and host into the
        store (when fetching beats computing) is not waited for: the answer is a
        ``StoreWait`` (see there and ``poll_store``).

        ``num_new_tokens`` limits how many tokens after the cached prefix are scheduled
        now (chunked prefill; the rest follow through ``extend``); default: all of them.
        At least one prompt token is always scheduled, even on a full hit. ``resumed``:
        this re-admits a preempted request (its tokens from ``preempt``); the stats count
        it in the ``preempted_*`` fields rather than as new traffic. ``read_cache=False``:
        use no cached block (prompt logprobs, pooling: every position is computed); the
        blocks it computes are still cached for others. ``num_lookahead_tokens``: slots
        reserved past the scheduled tokens (see ``reserve``). ``require_full_fit``: admit
        only if blocks for the whole prompt are free now, even when ``num_new_tokens``
        schedules less (nothing beyond what is scheduled is held); the lookahead counts
        with this call's blocks, not on top of the whole prompt (vLLM's
        ``full_sequence_must_fit``). ``keep_free``: admit only if this many blocks stay
        free besides what this call takes (new blocks, and cached hits that were free;
        hits other requests hold take nothing); ``require_full_fit`` still checks the
        whole prompt against every free block: vLLM's ``reserved_blocks`` (and
        watermark), which constrain the current allocation, not the whole prompt.
        ``max_hit_tokens``: use at most this many cached tokens (the hit is cut to the
        whole blocks below it; None: no cap), e.g. an engine that must recompute the
        prefix's last block (vLLM's EAGLE) or caps a hit (vLLM's ``max_cache_hit_length``).

        ``prompt_token_ids`` may be a ``Prompt`` from ``prepare`` (then ``extra`` must be
        None: the Prompt carries it): its checks, encoding, block chunks and chain hashes
        are not done again; the request gets its own copy of the tokens, so one Prompt
        may be admitted many times. A re-admission after ``StoreWait`` with the same
        Prompt object skips comparing the prompt with the one the fetch started from.

        Returns the Admission, ``StoreWait``, or None when the pool is short of blocks;
        then nothing has changed (no references, no stats) and the engine may wait or
        preempt (a fetch that ended stays landed: the next call finds it).
        Raises PromptTooLongError when it can never fit (its prompt, or this call's blocks
        with the lookahead, need more blocks than the pool has), RequestError (id in use
        or unhashable, a count or flag out of range), TokenError (empty prompt, bad ids or
        container), ExtraKeysError, ConfigError (a hash_mode callable failed), PromptError
        (a RequestError: a Prompt prepared under another configuration, or with ``extra``).

        The common case runs here, in this one function: a ``Prompt`` this manager
        prepared (no multimodal keys), no ``extra``, every other argument at its default
        (``resumed`` False), a new id, a prompt within the pool, an index that claims (no
        host tier, no shared store) and hashes nothing as it stores (no hash callable
        with events on). Every other case falls through to ``_admit``, the general path,
        before anything changes; both give the same result.
        """
        p = prompt_token_ids
        requests = self._requests
        try:  # (``check_new_request``'s probe inline: a new id costs no call)
            live = request_id in requests
        except Exception:
            live = True
        if (live or not isinstance(p, Prompt) or not self._lean
                or p.config is not self._config
                or extra is not None or num_new_tokens is not None or max_hit_tokens is not None
                or resumed is not False or read_cache is not True or require_full_fit is not False
                or num_lookahead_tokens.__class__ is not int or num_lookahead_tokens
                or keep_free.__class__ is not int or keep_free
                or p.keys.mm is not None
                or len(p.tokens) > self._max_slots):
            return self._admit(request_id, prompt_token_ids, extra, num_new_tokens, resumed,
                               read_cache, num_lookahead_tokens, require_full_fit, keep_free,
                               max_hit_tokens)
        try:  # the request's own tokens: the copy ``prepare`` made, else a copy (``_find``)
            tokens = p.spare.pop()
        except IndexError:
            tokens = p.tokens[:]
            if len(tokens) >= GROW_AT:
                grow_room(tokens)
        n, bs, chunks, keys = len(tokens), self.block_size, p.chunks, p.keys
        req = Request(request_id, tokens, keys)  # (no prompt fields: nothing here reads them)
        # the hits: every block but the one holding the last token (``hit_limit``)
        limit = (n - 1) // bs
        index = self._index
        hits, unlinked = index.claim(chunks if limit == len(chunks) else chunks[:limit],  # type: ignore[misc]
                                     keys.base, None, p.data)
        first = len(hits)
        need = (n + bs - 1) // bs - first  # (``blocks_for``; >= 1: the last token's block)
        pool = self._pool
        cached = pool._cached  # (``claimed`` and ``num_free``, inline)
        cached.size -= unlinked
        if need > len(pool._empty) + cached.size:  # (claimed hits have left the free ones)
            pool.unclaim(hits, unlinked)
            p.spare.append(tokens)  # its tokens, unwritten: the next admission's
            return None
        if need > 1:
            hits += pool.take(need)
        else:
            b = pool.take_one()
            assert b is not None, "a free block was counted above"
            hits.append(b)
        req.blocks = hits
        num_cached = first * bs
        req.num_cached = num_cached
        req.num_scheduled = req.num_reserved = n
        last = n // bs
        if last > first:  # (``Announcer.prepare``'s case without hashes, inline)
            w = 4 * bs  # (the chunks' bytes in one piece: a slice of the prompt's)
            index.store(req, first, (chunks[first:last], [keys.base] * (last - first), None),
                        p.data[first * w:last * w])
        requests[request_id] = req
        stats = self._stats  # (``StatsCounter.record``, inline)
        stats.requests += 1
        stats.queries += n
        stats.hits += num_cached
        return Admission.of(request_id, hits, num_cached, n - num_cached)

    def _admit(
        self, request_id: Hashable, prompt_token_ids: Sequence[int] | Prompt,
        extra: ExtraKeys | None, num_new_tokens: int | None, resumed: bool, read_cache: bool,
        num_lookahead_tokens: int, require_full_fit: bool, keep_free: int,
        max_hit_tokens: int | None,
    ) -> Admission | StoreWait | None:
        """``add_request``'s general path: every case (its arguments, checked here)."""
        try:  # (``check_new_request``'s probe inline: a new id costs no call)
            live = request_id in self._requests
        except Exception:
            live = True
        if live:
            check_new_request(self._requests, request_id)  # raises RequestError
        if num_new_tokens is not None:
            check_count("num_new_tokens", num_new_tokens, 1, None)
        if num_lookahead_tokens or num_lookahead_tokens.__class__ is not int:  # (None, [], 0.0)
            check_count("num_lookahead_tokens", num_lookahead_tokens, 0, None)
        if keep_free or keep_free.__class__ is not int:
            check_count("keep_free", keep_free, 0, None)
        if resumed.__class__ is not bool or read_cache is not True or require_full_fit is not False:
            for name, flag in (("resumed", resumed), ("read_cache", read_cache),
                               ("require_full_fit", require_full_fit)):
                check_flag(name, flag, RequestError)
        if max_hit_tokens is not None:
            check_count("max_hit_tokens", max_hit_tokens, 0, None)
        admit = (num_new_tokens, num_lookahead_tokens, require_full_fit)
        waits = self._waits
        fetch: Fetch | None = None
        reused = d = None  # (d, ``reuse``'s: how many hits are device blocks, which come first)
        if waits is not None:
            got = waits.take(request_id)
            if isinstance(got, StoreWait):  # (its input raises as it would without a wait)
                self._find(None, prompt_token_ids, extra, False, admit)
                return got
            fetch = got
            # a re-admission whose fetch landed may skip the walk: ``reuse`` answers what it finds
            reused = (waits.reuse(fetch, prompt_token_ids, extra)
                      if fetch and read_cache and max_hit_tokens is None else None)  # (capped: the walk)
        if reused is None:
            req, hits, claimed = self._find(request_id, prompt_token_ids, extra, read_cache, admit,
                                            max_hit_tokens)
        else:
            (req, hits, d), claimed = reused, None
            self._check_fits(len(req.tokens), *admit)
        n, bs = len(req.tokens), self.block_size
        if fetch is None and waits is not None and read_cache:
            limit = hit_limit(n, bs, max_hit_tokens)
            wait = waits.start(req, hits, req.prompt_chunks, limit,  # type: ignore[arg-type]
                               prompt_token_ids) if len(hits) < limit else None
            if wait is not None:
                return wait
        num_cached = len(hits) * bs
        num_new = n - num_cached if num_new_tokens is None else min(n - num_cached, num_new_tokens)
        total = num_cached + num_new
        pool = self._pool
        if claimed is not None:  # the hits hold their references already (one pass)
            pool.claimed(claimed)
        loads, held = self._split(hits, d) if self._host is not None and claimed is None else ((), hits)
        need = blocks_for(total + num_lookahead_tokens, bs) - len(held)
        take = need + keep_free  # (claimed hits have left the free ones already)
        if require_full_fit:
            take = max(take, blocks_for(n, bs) - len(held))
        taken = reused is not None and fetch is not None and fetch.on_device  # the fetch's
        # held blocks are the hits; the block it took for the tokens after them is a new one
        spare = self._waits.spare(fetch, bool(taken)) if fetch is not None else 0  # type: ignore[union-attr]
        if not (take <= pool.num_free if claimed is not None  # (taken: the fetch holds
                else take - spare <= pool.num_free if taken  # every hit: none is free)
                else pool.can_acquire(held, take - spare)):
            if claimed is not None:
                pool.unclaim(hits, claimed)
            if fetch is not None:  # (its run stays cached; the wait goes on)
                self._waits.give_back(fetch)  # type: ignore[union-attr]
            elif isinstance(req.prompt, Prompt):  # its tokens, unwritten: the next admission's
                req.prompt.spare.append(req.tokens)
            return None
        first, last = len(hits), total // bs
        try:
            prepared = (self._index.prepare(req, first, last, hits[-1] if hits else None)
                        if last > first else None)
        except BaseException:
            if claimed is not None:
                pool.unclaim(hits, claimed)
            raise
        fetched = loaded = 0  # blocks of the fetch's run among the hits; of them, host loads
        if fetch:
            if fetch.on_device:  # (landed on the device: device hits; the host hits before
                # the run went up with it, their loads stated then)
                fetched = len(fetch.cids) if reused else sum(h.content_id in fetch.cids for h in hits)
                loaded = -fetch.promoted
            else:
                fetched = loaded = (len(fetch.cids) if reused
                                    else sum(h.content_id in fetch.cids for h in loads))
        if claimed is not None:  # ``hits`` is the claim's own list
            if need > 1:
                hits += pool.take(need)
            elif need:
                b = pool.take_one()
                assert b is not None, "a free block was counted above"
                hits.append(b)
            req.blocks = hits
        elif taken:  # (each holds the fetch's reference: the request's now; ``hits`` is
            if need or spare:  # a list ``reuse`` handed over, grown in place)
                hits += self._waits.tail(fetch, need)  # type: ignore[union-attr,arg-type]
            req.blocks = hits
        else:
            req.blocks = (pool.acquire(hits, need) if not loads
                          else self._acquire_loading(req, hits, held, need))
        req.num_cached = num_cached
        req.num_scheduled = total
        req.num_reserved = total + num_lookahead_tokens
        if total < n:
            self._num_prefilling += 1
        if prepared is not None:
            self._index.store(req, first, prepared)
        req.prompt = None
        if req.prompt_hashes is None or total == n:  # (a prepared prompt's chunks and hashes
            req.prompt_chunks = req.prompt_hashes = None  # serve its next chunks: ``extend``)
        self._requests[request_id] = req
        if fetch is not None:  # the wait is over
            self._waits.cancel(request_id, bool(taken))  # type: ignore[union-attr]
        self._stats.record(n, num_cached, resumed, (len(loads) - loaded) * bs, fetched * bs)
        return Admission.of(request_id, req.blocks, num_cached, num_new)

    @staticmethod
    def _split(hits: list[Block], device: int | None) -> tuple[list[Block], list[Block]]:
        """The hits that are not device blocks (host slots, fetched blocks: to load), and
        the device blocks; in the common case (the device blocks first), two slices.
        ``device``: how many device blocks come first and are all there are, if known."""
        if device is not None:  # (all of them: the list itself, not a copy)
            return (hits[device:], hits[:device]) if device < len(hits) else ([], hits)
        kinds = list(map(type, hits))
        n = kinds.count(Block)
        if n == len(hits):
            return [], hits
        if kinds[:n].count(Block) == n:
            return hits[n:], hits[:n]
        return [h for h in hits if type(h) is not Block], [h for h in hits if type(h) is Block]

    def _acquire_loading(self, req: Request, hits: list[Block], held: list[Block], need: int) -> list[Block]:
        """``acquire`` when some hits are host slots: pin the slots, take fresh device blocks
        for them (the evictions this causes may offload, never into a pinned slot), record
        their content and state the loads: each of these once for all the admission's slots."""
        host, index = self._host, self._index
        assert host is not None and isinstance(index, ContentIndex), "loads need a host tier"
        first = hits[:len(held)] == held  # the device hits come first (the common case)
        slots = hits[len(held):] if first else [h for h in hits if type(h) is not Block]
        host.hold(slots)
        taken = self._pool.acquire(held, need)  # held, then the fresh blocks
        if first:  # the fresh blocks follow the device hits, in the order of the slots
            blocks = taken
            into = taken[len(held):len(hits)]
            assert req.prompt_chunks is not None, "an admission keeps its chunks until it ends"
            chunks = req.prompt_chunks[len(held):len(hits)]  # (the slots' keys' bytes)
        else:  # a device hit after host hits: the fresh blocks go where the slots were
            fresh = iter(taken[len(held):])
            blocks = [h if type(h) is Block else next(fresh) for h in hits]
            into = [b for b, h in zip(blocks, hits, strict=True) if h is not b]
            blocks += fresh
            chunks = [key_chunk(s.key) for s in slots]
        index.adopt(into, slots, chunks, held[-1] if first and held else None, first)
        host.load(slots, into)
        return blocks

    def _find(self, request_id: Hashable, prompt_token_ids: Sequence[int] | Prompt,
              extra: ExtraKeys | None, read_cache: bool,
              admit: tuple[int | None, int, bool] | None, max_hit_tokens: int | None = None
              ) -> tuple[Request, list[Block], int | None]:
        """Check and encode a prompt and find its cached prefix (at most all blocks but
        the one holding the last token, and ``hit_limit``'s): the request, the hits and, when ``admit`` and
        the index claimed them (took their references), how many left the cached tier;
        else None, and no side effects (but a prepared prompt's spare tokens taken, for an
        admission). ``admit``: an admission's ``num_new_tokens``,
        ``num_lookahead_tokens`` and ``require_full_fit`` (None: a lookup); it is
        refused with PromptTooLongError, before any claim, if it can never fit."""
        if isinstance(prompt_token_ids, Prompt):  # prepared: checked, encoded and cut already
            p = prompt_token_ids
            if p.config is not self._config or extra is not None:  # (this manager's own: valid)
                unpack_prompt(p, extra, self._config)  # raises PromptError, or it is valid
            keys = p.keys
            data: bytes | None = p.data
            chunks: Sequence[bytes] = p.chunks
            if admit is None:  # a lookup: the request's tokens are read, never written
                tokens = p.tokens
            else:  # the request's own array (decode appends to it): the copy ``prepare``
                try:  # made, grown, for the first admission (``pop``: one taker, whatever
                    tokens = p.spare.pop()  # the threads), else a copy
                except IndexError:
                    tokens = p.tokens[:]
                    if len(tokens) >= GROW_AT:
                        grow_room(tokens)
        else:
            p = None
            tokens, keys, cut = encode_prompt(prompt_token_ids, extra, self.block_size,
                                              self.vocab_size, admit is not None)
            chunks, data = cut, cut.buf if type(cut) is Chunks else None
        n, bs = len(tokens), self.block_size
        if admit is not None and n + admit[1] > self._max_slots:  # (else it always fits)
            self._check_fits(n, *admit)
        req = Request(request_id, tokens, keys)
        req.prompt_chunks = chunks
        if p is not None:
            req.prompt, req.prompt_hashes = p, p.hashes
        if not read_cache:
            return req, [], None
        # (``hit_limit``, uncapped inline: all blocks but the one holding the last token)
        limit = (n - 1) // bs if max_hit_tokens is None else hit_limit(n, bs, max_hit_tokens)
        probe = chunks if limit == len(chunks) else chunks[:limit]
        claim = admit is not None and self._store is None
        claimed = (self._index.claim(probe, keys.base, keys.mm,
                                     token_bytes(tokens) if data is None else data)
                   if claim else None)
        if claimed is not None:
            hits, host = claimed[0], self._host
            if host is None or len(hits) == limit or host.find(
                    hits[-1].content_id if hits else 0, probe[len(hits)], keys.base) is None:
                return req, hits, claimed[1]
            self._pool.claimed(claimed[1])  # the host tier goes on where the device missed:
            self._pool.unclaim(hits, claimed[1])  # undone exactly; the walk goes on from the
            return req, self._index.match(probe, keys.base, None, start=hits), None  # device's run
        return req, self._index.match(probe, keys.base, keys.mm), None

    def _check_fits(self, n: int, num_new: int | None, lookahead: int, full_fit: bool) -> None:
        """PromptTooLongError if an admission of ``n`` tokens with these arguments can
        never get its blocks, even from an empty pool: the whole prompt's (all held once
        its prefill is done) and this call's at best (a chunk scheduled with no hit before
        it, and the lookahead); ``full_fit`` asks for no more than the whole prompt's."""
        bs = self.block_size
        if n + lookahead <= self._max_slots:  # the most either count can need
            return
        first = n if num_new is None else min(n, num_new)
        need = max(blocks_for(n, bs), blocks_for(first + lookahead, bs))
        if need > self.num_blocks:
            raise PromptTooLongError(n, need, self.num_blocks, "" if need == blocks_for(n, bs)
                                     else f" (with {lookahead} lookahead slots)")

    def _get(self, request_id: Hashable) -> Request:
        try:  # every call goes through here, decode included: one dict access when live
            return self._requests[request_id]
        except Exception:  # unknown, unhashable, or a __hash__ that raises
            return live_request(self._requests, request_id)  # raises RequestError

    def _encode(self, token_ids: Sequence[int]) -> array[int]:
        return encode_tokens(token_ids, self.vocab_size)

    @staticmethod
    def _require(problem: str | None) -> None:
        if problem:
            raise InvariantError(problem)

"""``add_request``'s general path (``_admit``: every case the lean path in
``admission.py`` does not cover) and the finding and fitting it shares with the lookups
(``_find``, ``_check_fits``): functions ``KVCacheManager``'s body lists, ``self`` the
manager, whose state ``admission.construct`` sets.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from ..chunks import Chunks
from ..errors import (
    PromptTooLongError,
    RequestError,
    check_count,
    check_flag,
    check_new_request,
)
from ..extra_keys import ExtraKeys
from ..hashing import token_bytes
from ..index import ContentIndex
from ..results import Admission, StoreWait, admission_of
from ..store.fetch import Fetch
from .block import Block, blocks_for, hit_limit, key_chunk
from .prompt import Prompt, encode_prompt, unpack_prompt
from .request import GROW_AT, Request, grow_room, new_request
from .store_reuse import taken_up

if TYPE_CHECKING:
    from .manager import KVCacheManager


def _admit(
    self: KVCacheManager, request_id: Hashable, prompt_token_ids: Sequence[int] | Prompt,
    extra: ExtraKeys | None, num_new_tokens: int | None, resumed: bool, read_cache: bool,
    num_lookahead_tokens: int, require_full_fit: bool, keep_free: int,
    max_hit_tokens: int | None, found: tuple[Request, list[Block]] | None = None,
) -> Admission | StoreWait | None:
    """``add_request``'s general path: every case (its arguments, checked here).
    ``found``: a store start's request and hits, walked, whose ``StoreWaits.start``
    answered None (``store_start._start``: its arguments the defaults, a Prompt of this
    manager's, checked); the admission goes on from there."""
    waits = self._waits
    fetch: Fetch | None = None
    reused = d = None  # (d, ``reuse``'s: how many hits are device blocks, which come first)
    claimed: int | None
    if found is not None:  # (a store start that answered None: its arguments the defaults)
        (req, hits), claimed = found, None
        n, bs = len(req.tokens), self.block_size
    else:
        try:  # (``check_new_request``'s probe inline: a new id costs no call)
            live = request_id in self._requests
        except Exception:
            live = True
        if live:
            check_new_request(self._requests, request_id)  # raises RequestError
        if num_new_tokens is not None:
            check_count("num_new_tokens", num_new_tokens, 1, None)
        # (the class first: an object without a truth value, a numpy array, is refused too)
        if num_lookahead_tokens.__class__ is not int or num_lookahead_tokens:  # (None, [], 0.0)
            check_count("num_lookahead_tokens", num_lookahead_tokens, 0, None)
        if keep_free.__class__ is not int or keep_free:
            check_count("keep_free", keep_free, 0, None)
        if resumed.__class__ is not bool or read_cache is not True or require_full_fit is not False:
            for name, flag in (("resumed", resumed), ("read_cache", read_cache),
                               ("require_full_fit", require_full_fit)):
                check_flag(name, flag, RequestError)
        if max_hit_tokens is not None:
            check_count("max_hit_tokens", max_hit_tokens, 0, None)
        admit = (num_new_tokens, num_lookahead_tokens, require_full_fit)
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
    loads, held = _split(hits, d) if self._host is not None and claimed is None else ((), hits)
    need = blocks_for(total + num_lookahead_tokens, bs) - len(held)
    take = need + keep_free  # (claimed hits have left the free ones already)
    if require_full_fit:
        take = max(take, blocks_for(n, bs) - len(held))
    taken = reused is not None and fetch is not None and fetch.on_device  # the fetch's
    # held blocks are the hits; the block it took for the tokens after them is a new one
    spare = self._waits.held.spare(fetch, bool(taken)) if fetch is not None else 0  # type: ignore[union-attr]
    if not (take <= pool.num_free if claimed is not None  # (taken: the fetch holds
            else take - spare <= pool.num_free if taken  # every hit: none is free)
            else pool.can_acquire(held, take - spare)):
        if claimed is not None:
            pool.unclaim(hits, claimed)
        if fetch is not None:  # (its run stays cached; the wait goes on)
            self._waits.held.give_back(fetch)  # type: ignore[union-attr]
        elif isinstance(req.prompt, Prompt):  # its tokens, unwritten: the next admission's
            req.prompt._give_back(req.tokens)
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
            if fetch.promoted:  # (its host hits went up at the start, for this request)
                loaded -= taken_up(fetch, hits)
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
            hits += self._waits.held.tail(fetch, need)  # type: ignore[union-attr,arg-type]
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
    return admission_of(request_id, req.blocks, num_cached, num_new)


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


def _acquire_loading(self: KVCacheManager,
                     req: Request, hits: list[Block], held: list[Block], need: int) -> list[Block]:
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


def _find(self: KVCacheManager, request_id: Hashable, prompt_token_ids: Sequence[int] | Prompt,
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
            for tokens in p.spare:  # noqa: B007 (made, grown, for the first admission;
                break  # one taker, whatever the threads: ``Prompt.spare``), else a copy
            else:
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
    req = new_request(request_id, tokens, keys)
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


def _check_fits(self: KVCacheManager, n: int, num_new: int | None, lookahead: int, full_fit: bool) -> None:
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

"""The manager's construction and its admission path (``KVCacheManager.__init__`` and
``add_request``: functions the class body lists, ``self`` the manager).

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
from typing import TYPE_CHECKING

from ..errors import (
    MAX_BLOCKS,
    ConfigError,
    check_flag,
    check_positive,
    live_request,
)
from ..event_log import EventLog, NullSink
from ..extra_keys import ExtraKeys
from ..hashing import HashFn, encode_tokens, make_hash_fn
from ..index import ContentIndex, Hasher, NoIndex
from ..results import Admission, StoreWait, _Admitted
from ..stats import StatsCounter
from ..store.shared import SharedStore
from ..tiers import HostTier
from .copies import CopyPlan
from .pool import BlockPool
from .prompt import Prompt
from .request import GROW_AT, Request, grow_room
from .store_waits import StoreWaits

if TYPE_CHECKING:
    from .manager import KVCacheManager


def construct(
    self: KVCacheManager, num_blocks: int, block_size: int, hash_mode: str | HashFn,
    seed: int | bytes | None, enable_caching: bool, enable_events: bool, max_events: int,
    vocab_size: int | None, host_blocks: int, store: SharedStore | None,
) -> None:
    """``KVCacheManager.__init__``: check every argument, then build the parts (see there
    for the arguments and what raises)."""
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
    self._requests = {}
    self._num_prefilling = 0  # live requests with prompt tokens not yet scheduled
    self._stats = StatsCounter()
    self._copies = CopyPlan()  # the step's fork copies (a closed set: see copies.py)
    self._store = self._waits = None
    self._computing = []  # contents recorded last step: written to the store next
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
    self: KVCacheManager, request_id: Hashable, prompt_token_ids: Sequence[int] | Prompt, *,
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
    prepared (no multimodal keys), no ``extra``, the counts and flags valid (any
    values: vLLM's plug-in passes them all), a new id, the prompt and the lookahead
    within the pool, an index that claims (no
    host tier, no shared store) and hashes nothing as it stores (no hash callable
    with events on). Every other case falls through to ``_admit``, the general path,
    before anything changes; both give the same result.
    """
    p = prompt_token_ids
    requests = self._requests
    try:  # (``check_new_request``'s probe inline: a new id costs no call; ``get``, not
        live = requests.get(request_id) is not None  # ``in``: a C path claim's probes run)
    except Exception:
        live = True
    if (live or type(p) is not Prompt or not self._lean  # (not ``isinstance``: a cold C path)
            or p.config is not self._config or extra is not None or p.keys.mm is not None
            or (num_new_tokens is not None  # (the counts' and flags' checks: ``_admit``)
                and (num_new_tokens.__class__ is not int or num_new_tokens < 1))
            or (max_hit_tokens is not None
                and (max_hit_tokens.__class__ is not int or max_hit_tokens < 0))
            or (resumed is not False and resumed is not True)  # (a default: one test)
            or (read_cache is not True and read_cache is not False)
            or (require_full_fit is not False and require_full_fit is not True)
            or num_lookahead_tokens.__class__ is not int or num_lookahead_tokens < 0
            or keep_free.__class__ is not int or keep_free < 0
            or len(p.tokens) + num_lookahead_tokens > self._max_slots):
        if self._waits is not None and not live:  # a store's start (``_start``: a Prompt
            # of this manager's, no multimodal keys, within the pool, a new id no fetch
            # waits for) or a re-admission after a store fetch (``_readmit``'s case: the
            # fetch's run landed whole on the device, held: ``Fetch.blocks``; the start's
            # Prompt object), every other argument its default
            f = self._waits.waiting.get(request_id)
            if (type(p) is Prompt and extra is None and num_new_tokens is None
                    and max_hit_tokens is None and resumed is False and read_cache is True
                    and require_full_fit is False and num_lookahead_tokens.__class__ is int
                    and not num_lookahead_tokens and keep_free.__class__ is int and not keep_free):
                if f is None:
                    if (p.config is self._config and p.keys.mm is None
                            and len(p.tokens) <= self._max_slots):
                        return self._start(request_id, p)
                elif f.blocks is not None and p is f.req.prompt:
                    return self._readmit(request_id, p, f)
        return self._admit(request_id, prompt_token_ids, extra, num_new_tokens, resumed,
                           read_cache, num_lookahead_tokens, require_full_fit, keep_free,
                           max_hit_tokens)
    for tokens in p.spare:  # noqa: B007 (the request's own tokens: the copy ``prepare``
        break  # made, one taker: ``Prompt.spare``; else a copy, ``_find``)
    else:
        tokens = p.tokens[:]
        if len(tokens) >= GROW_AT:
            grow_room(tokens)
    n, bs, chunks, keys = len(tokens), self.block_size, p.chunks, p.keys
    # (``new_request`` inline, its list not made: ``Request`` has no ``__init__``, whose
    # call enters the interpreter again from C, paths cold after the forward pass)
    req = Request()
    req.request_id, req.tokens, req.keys = request_id, tokens, keys
    req.prompt_chunks = req.prompt = req.prompt_hashes = None
    # the prompt's blocks counted from its full ones, ``n // bs``, without ``//``: its C
    # path (``long_div``, ~12 lines of machine code) is cold after the forward pass
    full = len(chunks)
    blocks = full + 1 if full * bs < n else full  # (``blocks_for(n)``)
    # the hits: every block but the one holding the last token, at most the cap's
    limit = blocks - 1  # (``hit_limit``: ``(n - 1) // bs``)
    if max_hit_tokens is not None and max_hit_tokens // bs < limit:
        limit = max_hit_tokens // bs
    index = self._index
    if read_cache:
        hits, unlinked = index.claim(chunks if limit == full else chunks[:limit],  # type: ignore[misc]
                                     keys.base, None, p.data)
    else:
        hits, unlinked = [], 0
    first = len(hits)
    num_cached = first * bs
    if num_new_tokens is None or num_cached + num_new_tokens >= n:
        total = n  # (>= 1 scheduled: the hit is below n)
        last = full  # the full blocks scheduled: ``total // bs``
        need = blocks - first  # (``blocks_for``; >= 1)
        if num_lookahead_tokens:
            need = (total + num_lookahead_tokens + bs - 1) // bs - first
    else:  # a chunk
        total = num_cached + num_new_tokens
        last = total // bs
        need = (total + num_lookahead_tokens + bs - 1) // bs - first
    take = need + keep_free
    if require_full_fit and blocks - first > take:
        take = blocks - first
    pool = self._pool
    cached = pool._cached  # (``claimed`` and ``num_free``, inline)
    cached.size -= unlinked
    if take > len(pool._empty) - pool._lo + cached.size:  # (claimed hits have left the
        # free ones; the empty tier is ``_empty[_lo:]``)
        if hits:
            pool.unclaim(hits, unlinked)
        p._give_back(tokens)  # its tokens, unwritten: the next admission's
        return None
    if need > 1:
        # (not ``+=``: ``PyNumber_InPlaceAdd``'s C path, cold; ``stale`` given: a call
        # with defaults is an opcode of its own, run nowhere else in the step)
        hits.extend(pool.take(need, False))
    else:
        b = pool.take_one()
        assert b is not None, "a free block was counted above"
        hits.append(b)
    req.blocks = hits
    req.num_cached = num_cached
    req.num_scheduled = total
    req.num_reserved = total + num_lookahead_tokens
    if total < n:  # a chunk: ``extend`` schedules the rest
        self._num_prefilling += 1
        if p.hashes is not None:  # (a prepared prompt's serve its next chunks)
            req.prompt_chunks, req.prompt_hashes = chunks, p.hashes
    if last > first:  # (``Announcer.prepare``'s case without hashes, inline)
        w = 4 * bs  # (the chunks' bytes in one piece: a slice of the prompt's)
        cs, xs, d = chunks[first:last], p.extras[first:last], p.data[first * w:last * w]
        # (``store``'s common case first, called as ``store`` calls it: a frame fewer)
        if last - first < 3 or not index._store_run(req, first, cs, xs, d):  # type: ignore[union-attr]
            index.store(req, first, (cs, xs, None), d)
    requests[request_id] = req
    stats = self._stats  # (``StatsCounter.record``, inline)
    if resumed:  # (rare: the call)
        stats.record(n, num_cached, True)
    else:
        stats.requests += 1
        stats.queries += n
        stats.hits += num_cached
    # (``admission_of``, inline: a frame fewer a step)
    adm: Admission = _Admitted()
    adm.request_id, adm.num_cached_tokens, adm.num_new_tokens = request_id, num_cached, total - num_cached
    adm._blocks, adm._n, adm._ids = hits, len(hits), None
    return adm


def _get(self: KVCacheManager, request_id: Hashable) -> Request:
    try:  # every call goes through here, decode included: one dict access when live
        return self._requests[request_id]
    except Exception:  # unknown, unhashable, or a __hash__ that raises
        return live_request(self._requests, request_id)  # raises RequestError


def _encode(self: KVCacheManager, token_ids: Sequence[int]) -> array[int]:
    return encode_tokens(token_ids, self.vocab_size)

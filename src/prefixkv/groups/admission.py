"""The hybrid manager's admission path and its lookups: functions
``HybridKVCacheManager``'s body lists (``self`` the manager; its construction and shared
helpers are in parts.py).

Admission: encode the prompt, walk the prefix ids of its full blocks (``PrefixTable``),
apply the hit rule over the groups (``longest_hit``), then, before any change, check the
pool can serve every group and compute what the new full blocks need (chain hashes only
when events are recorded); then take references and record. A windowed group takes only
the hit blocks its window at the hit point needs; its earlier entries are released ones.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from ..core.block import Block, blocks_for, hit_limit
from ..core.prompt import Prompt, encode_prompt, prepare_prompt, unpack_prompt
from ..core.request import RequestKeys
from ..errors import PromptTooLongError, RequestError, check_count, check_flag, check_new_request
from ..extra_keys import ExtraKeys
from ..index.announce import Prepared
from . import loads, lookahead, spec_states
from .fit import least_blocks
from .lookup import hit_nodes, peeking, window_hits
from .prefixes import Prefix
from .request import GroupRequest
from .results import GroupAdmission
from .spec_blocks import lengths

if TYPE_CHECKING:
    from .manager import HybridKVCacheManager


def prepare(self: HybridKVCacheManager,
            prompt_token_ids: Sequence[int], *, extra: ExtraKeys | None = None) -> Prompt:
    """As ``KVCacheManager.prepare``: check, encode and cut the prompt once, on any
    thread (it reads only the configuration fixed at construction: block size,
    vocabulary size, hash function and root), with the chain hashes of its full
    blocks when events are on. A Prompt serves any manager, plain or hybrid, of the
    same block size, vocabulary size, hash and seed. Raises as
    ``KVCacheManager.prepare``."""
    if self._lookahead:  # (lookahead keys: groups/lookahead.py)
        tokens, keys, cut = encode_prompt(prompt_token_ids, extra, self._hash_size, self.vocab_size)
        return Prompt(tokens, lookahead.prompt_keys(self, tokens, keys), list(cut), None, self._config)
    return prepare_prompt(prompt_token_ids, extra, self._hash_size, self.vocab_size,
                          self._prompt_hasher, self._config)


def add_request(
    self: HybridKVCacheManager, request_id: Hashable, prompt_token_ids: Sequence[int] | Prompt, *,
    extra: ExtraKeys | None = None, num_new_tokens: int | None = None, resumed: bool = False,
    read_cache: bool = True, num_lookahead_tokens: int = 0, require_full_fit: bool = False,
    keep_free: int = 0, num_external_tokens: int = 0, max_hit_tokens: int | None = None,
    peek: bool | Sequence[bool] = False, num_prompt_tokens: int | None = None, junction: int = 0,
    hold_tail: bool = True,
) -> GroupAdmission | None:
    """Admit a request: find the longest cached prefix every group can serve, take
    references on the blocks each group needs of it, allocate every group's blocks
    for the tokens scheduled now and record the full ones. Arguments as
    ``KVCacheManager.add_request``, a ``Prompt`` from ``prepare`` included
    (``num_lookahead_tokens`` slots are reserved in every group; ``require_full_fit``
    asks for every group's blocks of the whole prompt, windows not deducted;
    ``keep_free`` blocks must stay free besides what this call takes).
    ``num_external_tokens``: tokens after the cached prefix whose KV an outside source
    writes (a connector's load; scheduled or reserved as the other counts say): the
    request's first query sits after them, so a windowed group takes no block that
    only positions below its reach hold (their entries are released ones, never
    written nor cached; vLLM gives them its null block), and a sparse (Mamba) group
    none of the hit's but the block where the load ends, whose state the source
    writes (groups/loads.py).
    ``max_hit_tokens``: a hit of at most this many tokens (None: no cap): the longest
    prefix every group serves within it, not the longest hit cut short (a window's
    blocks there may be gone). ``peek``: a hit of ``k > 0`` blocks needs block ``k``
    cached too in every group but a sparse one (True), or in the groups a sequence
    of one bool per group names (never a sparse one): vLLM's EAGLE, which matches one
    block past the hit and drops it (``prefixkv.groups.hits``); it may be the
    prompt's last full block, even the one holding its last token.
    ``num_new_tokens`` 0: the hit alone is adopted, its last blocks recomputed in an
    uncached window (vLLM's SWA bounded replay; RequestError but with a hit beside
    one). ``num_prompt_tokens``: how many of the tokens are the request's prompt (None: all).
    A preempted request comes back with its prompt and the tokens it decoded, but
    vLLM's partial tail entry (groups/sized.py ``_tail``) stays at its prompt's last
    hash boundary (``Request.num_prompt_tokens``). Beside a window's ``retention``
    (``GroupSpec``), the blocks a hit reads at the prompt's last position (vLLM's replay
    boundary, ``num_prompt_tokens - 1``) and at ``junction`` (when > 0: vLLM's
    ``shared_prefix_boundary``) stay cached; with Mamba's checkpoints
    (``BlockSizes.checkpoints``) a checkpoint at ``junction`` is cached (groups/checkpoints.py);
    otherwise ``junction`` does nothing. ``hold_tail`` False: a hit at the prompt's last
    hash boundary inside a full-attention block larger than the hash block leaves the
    block's copy on write without that partial entry (groups/partial_full.py ``on_hit``)
    until a growth past the hit records it (vLLM's ``delay_cache_blocks``).

    Returns the GroupAdmission, or None when the pool is short of blocks (nothing
    changed). Raises PromptTooLongError when it can never fit (``groups.fit``: its
    prefill, or this call with its lookahead, needs more blocks than the pool has,
    whatever is cached), RequestError (id in use or unhashable, a count or flag out of
    range), TokenError (empty prompt, bad ids or container), ExtraKeysError,
    ConfigError (a hash_mode callable failed), PromptError.
    """
    check_new_request(self._requests, request_id)
    if num_new_tokens is not None:  # (0 beside an uncached window: a hit adopted alone, _admit)
        check_count("num_new_tokens", num_new_tokens, self._least_new, None)
    check_count("num_lookahead_tokens", num_lookahead_tokens, 0, None)
    check_count("keep_free", keep_free, 0, None)
    check_count("num_external_tokens", num_external_tokens, 0, None)
    check_flag("resumed", resumed, RequestError)
    check_flag("require_full_fit", require_full_fit, RequestError)
    if hold_tail is not True:  # (True, the default: nothing to check)
        check_flag("hold_tail", hold_tail, RequestError)
    if type(junction) is not int or junction:  # (0, the default: nothing to check)
        check_count("junction", junction, 0, None)
    if num_prompt_tokens is not None:  # (a Prompt's length first: _find takes its spare tokens)
        check_count("num_prompt_tokens", num_prompt_tokens, 1,
                    len(prompt_token_ids) if isinstance(prompt_token_ids, Prompt) else None)
    req, nodes, prompt = self._find(request_id, prompt_token_ids, extra,
                                    check_flag("read_cache", read_cache, RequestError),
                                    max_hit_tokens=max_hit_tokens,
                                    peek=peeking(self.groups, peek), admit=True)
    if num_prompt_tokens is not None:
        req.num_prompt = check_count("num_prompt_tokens", num_prompt_tokens, 1, len(req.tokens))
    if self._retains:
        req.marks = (req.num_prompt - 1, junction) if junction else (req.num_prompt - 1,)
    return self._admit(req, nodes, prompt, num_new_tokens, resumed, num_lookahead_tokens,
                       require_full_fit, keep_free, num_external_tokens, hold_tail)


def _admit(self: HybridKVCacheManager, req: GroupRequest, nodes: list[Prefix], prompt: Prompt | None,
           num_new_tokens: int | None, resumed: bool, num_lookahead_tokens: int,
           require_full_fit: bool, keep_free: int, num_external_tokens: int,
           hold_tail: bool = True) -> GroupAdmission | None:
    """``add_request`` once its arguments are checked and its hit found (``nodes``;
    ``hold_tail``: the sized manager's, unused at one size)."""
    n, bs, k = len(req.tokens), self.block_size, len(nodes)
    usable = self.num_blocks - (self._null is not None)
    ahead = self._ahead
    if blocks_for(n + num_lookahead_tokens, bs) * len(self.groups) + sum(ahead or ()) > usable:  # else fits
        need = least_blocks(self.groups, bs, n, num_new_tokens, num_lookahead_tokens,
                            require_full_fit, usable)
        if need > usable:
            raise PromptTooLongError(n, need, usable, " usable (all groups' blocks counted together)")
    num_cached = k * bs
    todo = n - num_cached if num_new_tokens is None else min(n - num_cached, num_new_tokens)
    if not todo and not k:  # (nothing changed yet)
        raise RequestError("num_new_tokens must be >= 1 but with a hit beside an uncached window "
                           "(its engine replays the window below the hit), got 0")
    total = num_cached + todo
    first = min(num_cached + num_external_tokens, n)  # the first query's position
    cuts, hits = window_hits(self.groups, self._index.find, bs, nodes, first, self._uncached)
    held = [b for h in hits for b in h]
    covered = blocks_for(total + num_lookahead_tokens, bs)
    per_group = [max(0, covered - max(k, c)) for c in cuts]  # (a window's: none below its cut)
    if self._uncached:  # (an uncached window's: fresh from its cut, the hit's part included)
        per_group = [max(0, covered - (max(k, c) if s.cached else c))
                     for c, s in zip(cuts, self.groups, strict=True)]
    # a sparse group takes the block where this step ends only (its lookahead slots
    # get theirs when a step ends there: decode.py), if past the hit and its cut, and
    # after a load the block where it ends (the state the load writes: ``loads``)
    places = loads.places(bs, num_cached, first, total) if self._sparse else ()
    taken = [loads.count(places, covered - p) if s.sparse else p
             for p, s in zip(per_group, self.groups, strict=True)]
    if ahead is not None:  # (the blocks a group holds past the table's end: spec_blocks.py)
        spec_states.refuse_load(self, num_cached, first)
        per_group, taken = lengths(per_group, ahead), lengths(taken, ahead)
    fit = 0
    if require_full_fit:  # (an uncached window's blocks of the hit are fresh too)
        fit = self._num_fresh(blocks_for(n, bs) - k) + sum(
            max(0, k - c) for c, s in zip(cuts, self.groups, strict=True) if not s.cached) + sum(ahead or ())
    if not self._pool.can_acquire(held, max(sum(taken) + keep_free, fit)):
        return None
    last = total // bs
    prepared = (self._prepare(req, k, last, nodes[-1] if nodes else None, prompt)
                if last > k else None)
    fresh = self._pool.acquire(held, sum(taken))[len(held):]
    if first > num_cached and self._sparse:  # (a load's blocks first, as vLLM's: groups/loads.py)
        end = blocks_for(first, bs)
        fresh = loads.in_order(fresh, taken, [loads.loaded(t, covered - p, end, places if s.sparse else None)
                                              for t, p, s in zip(taken, per_group, self.groups, strict=True)])
    for g, h in enumerate(hits):
        new, fresh = fresh[:taken[g]], fresh[taken[g]:]
        self._index.own(g, new)
        row: list[Block | None] = list(new)
        if ahead is not None and ahead[g] and self.groups[g].sparse:  # (and its blocks ahead)
            row = spec_states.first_row(per_group[g], ahead[g], new, covered - 1 - places[-1])
        elif self.groups[g].sparse:  # (None but where the step ends, and the load)
            row = loads.row(places, covered - per_group[g], per_group[g], new)
        req.tables[g] = [None] * min(cuts[g], covered) + h + row
        req.cut[g] = min(cuts[g], covered)
        self._hit_blocks[g] += len(h)
    if self._sparse and first > num_cached:
        loads.mark(self._sparse, (bs,) * len(self.groups), req, first)
    return self._enter(req, nodes, prompt, prepared, first, total, num_lookahead_tokens, resumed)


def _enter(self: HybridKVCacheManager, req: GroupRequest, nodes: list[Prefix], prompt: Prompt | None,
           prepared: Prepared | None, first: int, total: int, num_lookahead_tokens: int,
           resumed: bool) -> GroupAdmission:
    """An admission's last part, once its tables are set: the request's counts, its
    hold on its hit's last prefix id, its new full blocks recorded, its stats."""
    n, k, num_cached = len(req.tokens), len(nodes), len(nodes) * self._hash_size
    req.plan_release(self.groups, self._group_sizes)
    req.nodes = nodes
    self._table.hold(nodes[-1] if nodes else None)
    req.num_cached, req.step_start = num_cached, first
    if self._uncached:  # (a load wrote from the hit on, the engine rebuilt the window below first)
        req.sound_from = [0 if s.cached else min(num_cached, s.first_needed(first)) for s in self.groups]
    req.num_scheduled = total
    req.num_reserved = total + num_lookahead_tokens
    if total < n:  # its chunks and hashes serve the prefill's next chunks (``extend``)
        req.prompt = prompt
    if prepared is not None:
        self._record(req, k, prepared)
    self._requests[req.request_id] = req
    self._stats.record(n, num_cached, resumed)
    return GroupAdmission(req.request_id, self._ids(req), num_cached, total - num_cached)


def lookup(self: HybridKVCacheManager, prompt_token_ids: Sequence[int] | Prompt, *,
           extra: ExtraKeys | None = None, max_hit_tokens: int | None = None,
           peek: bool | Sequence[bool] = False) -> int:
    """Tokens of this prompt that an admission now (with this ``max_hit_tokens`` and
    ``peek``) would find cached in every group. Changes nothing. Raises as
    ``add_request`` for bad input."""
    return len(self._find(None, prompt_token_ids, extra, True, max_hit_tokens=max_hit_tokens,
                          peek=peeking(self.groups, peek))[1]) * self._hash_size


def lookup_block_ids(self: HybridKVCacheManager, prompt_token_ids: Sequence[int] | Prompt, *,
                     extra: ExtraKeys | None = None, max_hit_tokens: int | None = None,
                     peek: bool | Sequence[bool] = False) -> tuple[tuple[int, ...], ...]:
    """Per group, the blocks of the prefix ``lookup`` finds, in token order, as an
    admission now would put them in its tables: ``null_block_id`` for the leading
    blocks that the group's window no longer reads. Changes nothing. Raises as
    ``add_request`` for bad input."""
    cuts, hits = window_hits(self.groups, self._index.find, self.block_size, self._find(
        None, prompt_token_ids, extra, True, max_hit_tokens=max_hit_tokens,
        peek=peeking(self.groups, peek))[1], uncached=self._uncached)
    null = self.null_block_id
    return tuple((null,) * cut + tuple(b.block_id for b in h)  # type: ignore[misc]
                 for cut, h in zip(cuts, hits, strict=True))


def _find(self: HybridKVCacheManager, request_id: Hashable, prompt_token_ids: Sequence[int] | Prompt,
          extra: ExtraKeys | None,
          read_cache: bool, alone: list[int] | None = None,
          max_hit_tokens: int | None = None, peek: Sequence[bool] = (), *,
          admit: bool = False) -> tuple[GroupRequest, list[Prefix], Prompt | None]:
    """Check and encode a prompt (or take a prepared one); the prefix ids of its hit
    (at most ``hit_limit``'s blocks: all but the one holding the last token, and
    within ``max_hit_tokens``; in the groups ``peek`` names (``peeking``), the block
    after it is looked at too), and
    the Prompt if it was one; ``alone[g]`` set to the blocks group ``g`` alone would
    serve (without peeking), when given. ``admit``: the request is admitted (it gets
    its own token array; else it is a lookup's, which reads a prepared prompt's). No
    side effects (but the check of ``max_hit_tokens``)."""
    if max_hit_tokens is not None:
        check_count("max_hit_tokens", max_hit_tokens, 0, None)
    if isinstance(prompt_token_ids, Prompt):
        prompt: Prompt | None = unpack_prompt(prompt_token_ids, extra, self._config)
        keys = prompt_token_ids.keys
        if self._lookahead:
            lookahead.check_prompt(self, keys)
        chunks: Sequence[bytes] = prompt_token_ids.chunks
        if not admit:  # a lookup: the tokens are read, never written
            tokens = prompt_token_ids.tokens
        else:  # the request's own (decode appends to them): ``prepare``'s copy, once
            for tokens in prompt_token_ids.spare:  # noqa: B007 (one taker: ``Prompt.spare``)
                break
            else:
                tokens = prompt_token_ids.tokens[:]
    else:
        prompt = None
        tokens, keys, chunks = encode_prompt(prompt_token_ids, extra, self._hash_size,
                                             self.vocab_size)
        if self._lookahead:
            keys = lookahead.prompt_keys(self, tokens, keys)
    n = len(tokens)
    req = GroupRequest(request_id, tokens, keys, len(self.groups))
    req.losses = self._index.losses  # (its hits are found now: ``GroupRequest``)
    if not read_cache:
        return req, [], prompt
    return req, self._hit_nodes(chunks, keys, n, max_hit_tokens, peek, alone), prompt


def _hit_nodes(self: HybridKVCacheManager, chunks: Sequence[bytes], keys: RequestKeys, n: int,
               max_hit_tokens: int | None, peek: Sequence[bool], alone: list[int] | None) -> list[Prefix]:
    """``_find``'s hit: the prefix ids of the longest prefix every group serves (at
    most ``hit_limit``'s blocks; ``alone`` as ``_find``'s). Changes nothing."""
    limit = hit_limit(n, self.block_size, max_hit_tokens)
    if not limit:
        return []
    return hit_nodes(self.groups, self._table, self._index.find, self.block_size,
                     chunks, keys, n, limit, peek, alone, self._uncached)

"""The hybrid manager for groups of different block sizes (vLLM's hybrid layouts,
docs/groups.md): ``HybridKVCacheManager(groups, num_blocks, BlockSizes.of(sizes))``
makes a ``SizedHybridKVCacheManager`` when the sizes are not ``one_size`` (or a window has a ``retention``).

    tokens       | 0 .. h-1 | h .. 2h-1 | 2h .. 3h-1 | 3h .. 4h-1 | ...
    prefix ids   | nodes[0] | nodes[1]  | nodes[2]   | nodes[3]   |  (one per hash block)
    group of 2h  |        block 0       |        block 1          |  keyed nodes[1], nodes[3]

A request's ``nodes`` are the prefix ids of its full hash blocks (``sizes.hash_size``
tokens each); group g's table holds ``blocks_for(n, sizes.sizes[g])`` entries, its block
j found under ``nodes[sizes.key_index(g, j)]`` (the fine hash at the block's last
boundary, as vLLM keys it). A group records (makes findable) its blocks only up to the
scheduled tokens rounded down to ``sizes.align``, and a window only those a hit can read
(``BlockSizes.caches``: vLLM's ``reachable_block_mask``); hits are
``BlockSizes.longest_hit``'s, multiples of ``align`` (sized_admission.py). Windows
release per group at the group's own size; released and freed blocks go in vLLM's plain
order (group by group, each group's last block first). A lookup or admission with
``peek`` (vLLM's EAGLE) finds its hit by vLLM's EAGLE rule (``hits.peeking_sized_hit``);
the groups ``sizes.peek`` names cache the block after each aligned end too
(``BlockSizes.caches``), as vLLM's EAGLE groups. A Mamba (sparse) group takes, at its
own size, one block where a step ends (the entries it jumps over empty), releases every
block below the state it reads, and records only the blocks that hold the state at
their own end (a step ended there: ``GroupRequest.states``, sized_admission.py
``_mark``); its hits are ``longest_hit``'s (the state at the aligned hit), as vLLM's
align mode with its fine-grained partial hits off (with them: partial.py; with
``BlockSizes.checkpoints``, a step also takes a chunk-end checkpoint block where vLLM
does: checkpoints.py). ``rewind``: sized_rewind.py; the
orders of release and free, the request check and the refusals: sized_release.py. Not
served yet, refused with ConfigError: ``fork``, ``uncache_blocks``, ``peek`` beyond
``sized_admission.check_peek``, ``rewind`` beside Mamba or over what a window
released. With events on, a full-attention group larger than the hash block announces
the partial tail entry of a prompt of a multiple of ``align`` (``_tail``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from ..core.block import Block, blocks_for
from ..errors import ConfigError, RequestError, check_count
from ..hashing import token_bytes
from ..index.announce import Prepared
from . import checkpoints, lookahead, partial, partial_full, sized_admission, sized_release, sized_rewind
from .events import GroupBlockStored
from .growth import Growth
from .manager import HybridKVCacheManager
from .request import GroupRequest
from .spec import FULL, MAMBA
from .spec_states import refuse_slots, shift


def _record(self: HybridKVCacheManager, req: GroupRequest, first: int, prepared: Prepared) -> None:
    """Give hash blocks ``first..`` their prefix ids (the request's hold moves to the
    last), then index in each group its blocks from the aligned end before them
    (``first`` hash blocks, rounded down to ``align``) up to ``num_scheduled``
    rounded down to ``align`` (in a group ``sizes.peek`` names, one block more),
    where ``BlockSizes.caches`` says. After a block the
    request reads lost its content (``GroupIndex.uncache``, while its prefix stays in
    another copy), the new prefix ids are lost ones, as the one-size ``_record``'s."""
    chunks, extras, hashes = prepared
    old = req.nodes[-1] if req.nodes else None
    cut = old is not None and not old.lost and _cut_off(self, req, first * self._hash_size)
    nodes = self._table.extend(old, chunks, extras, hashes, cut)
    req.nodes += nodes
    self._table.hold(nodes[-1])
    self._table.unhold(old)
    sizes, h, every = self.sizes, self._hash_size, req.nodes
    u = h if sizes.partial else sizes.align  # (``sizes.unit``, without its call)
    lo = first * h // u * u
    hi = req.num_scheduled // u * u
    if self._lookahead:  # (blocks past the known keys wait for them: groups/lookahead.py)
        hi = min(hi, len(every) * h // u * u)
    n, peek = req.num_scheduled, sizes.peek or (False,) * len(self.groups)
    states = req.states or ()  # (sparse groups' blocks holding the state at their end)
    marks = req.marks  # (a window's retention: BlockSizes.caches)
    for g, (spec, table, b) in enumerate(zip(self.groups, req.tables, self._group_sizes, strict=True)):
        end = min(n, hi + b) if peek[g] and hi else hi  # (a peeking group: one block past hi)
        span = range(lo // b, end // b)
        if span:
            part = [table[j] if sizes.caches(spec, g, n, j, marks) else None for j in span]
            if spec.kind == MAMBA:  # (sparse: only blocks holding the state at their end)
                part = [x if (g, j) in states else None for j, x in zip(span, part, strict=True)]
            keyed = [every[sizes.key_index(g, j)] for j in span]
            events = ([req.keys.for_event(j, b) for j in span] if self._index.hashing else None)
            self._index.store(g, part, keyed, span.start, req.tokens, events, b,  # type: ignore[arg-type]
                              b // h)
        if self._index.hashing and spec.kind == FULL and b > h and not sizes.partial:
            _tail(self, req, g, table, hi)
    if sizes.partial:
        if not (sizes.checkpoints and checkpoints.record(self, req)):
            partial.tail(self, req)
        if self._fine:  # (at every caching: a step reaching the boundary passed it)
            partial_full.tail(self, req)
    elif sizes.eagle or self._lookahead and sizes.checkpoints:  # (one size: EAGLE's, or under
        # lookahead keys, a checkpoint in the block after its entry's)
        checkpoints.record(self, req)


def _tail(self: HybridKVCacheManager, req: GroupRequest, g: int, table: Sequence[Block | None],
          hi: int) -> None:
    """vLLM's ``_cache_partial_tail_block`` for full-attention group ``g``, larger than
    the hash block, once ``hi`` tokens are cached: the prompt's last hash boundary before
    its last token, when it lies inside a block of the group at or below ``hi`` (so only
    for a prompt of a multiple of ``align``: in its last block, full and just recorded),
    is announced as one more entry of that block, the hash block before the boundary
    (``BlockSizes.stored``). It never serves a hit (hits look only at whole blocks)."""
    h, b = self._hash_size, self._group_sizes[g]
    end = (req.num_prompt - 1) // h * h
    if not 0 < end <= hi or not end % b:
        return
    blk, i = table[end // b], end // h - 1
    node = req.nodes[i]
    if blk is None or node.lost:
        return
    assert node.hash is not None, f"{node!r}: events need its chain hash"
    up = node.parent
    spec = self.groups[g]
    self._index.tails.store(blk, GroupBlockStored(
        (node.hash,), None if up is None else up.hash, token_bytes(req.tokens[i * h:end]), (blk.block_id,),
        req.keys.for_event(i, h), i, group_idx=g, spec_kind=spec.kind, spec_tokens=spec.tokens),
        self._index.nodes)


def _cut_off(self: HybridKVCacheManager, req: GroupRequest, end: int) -> bool:
    """Whether, in some group, the block holding position ``end - 1`` was recorded
    (``BlockSizes.caches`` at ``end``) and holds no content now: its KV was found
    invalid (``GroupIndex.cut_off``'s question, at each group's own size; a sparse group,
    whose blocks hold states, not keys, is not asked)."""
    for g, (spec, table, b) in enumerate(zip(self.groups, req.tables, self._group_sizes, strict=True)):
        j = (end - 1) // b
        if spec.kind != MAMBA and j < len(table) and (blk := table[j]) is not None and blk.key is None \
                and self.sizes.caches(spec, g, end, j, req.marks):
            return True
    return False


def _more(self: HybridKVCacheManager, req: GroupRequest, covered: int) -> list[int]:
    """Per group, the entries its table lacks to cover ``[0, covered)`` (and its blocks
    ahead: spec_blocks.py)."""
    if self._ahead is not None:
        return [max(0, blocks_for(covered, b) + a - len(t))
                for b, t, a in zip(self._group_sizes, req.tables, self._ahead, strict=True)]
    return [max(0, blocks_for(covered, b) - len(t))
            for b, t in zip(self._group_sizes, req.tables, strict=True)]


def _fresh(self: HybridKVCacheManager, more: Sequence[int]) -> int:
    """The free blocks that ``more[g]`` new entries per group take: a sparse group's
    only its last (none for none)."""
    if not self._sparse:
        return sum(more)
    return sum(min(m, 1) if s.sparse else m for s, m in zip(self.groups, more, strict=True))


def _holes(self: HybridKVCacheManager, req: GroupRequest, total: int) -> list[int]:
    """The sparse groups whose table covers a step ending at ``total`` but whose entry
    where it writes its state is empty (reserved slots the step stops short of): each
    takes a block there."""
    out = []
    for g in self._sparse:
        t, j = req.tables[g], blocks_for(total, self._group_sizes[g]) - 1
        if j < len(t) and t[j] is None:
            out.append(g)
    return out


def _take(self: HybridKVCacheManager, req: GroupRequest, more: Sequence[int], holes: Sequence[int] = (),
          total: int = 0, cows: Sequence[int] = (), marks: Sequence[int] = ()) -> Growth:
    """Append ``more[g]`` entries to group g's table, free blocks but for a sparse
    group's jumped-over ones, and a free block into each of ``holes`` (where a step
    ending at ``total`` writes; the caller checked the blocks are there); their ids,
    per group. Each group of ``cows`` first takes the block its owned partial entry
    moves to (``partial.moved``; not in the ids), each of ``marks`` a checkpoint block
    before its last (groups/checkpoints.py)."""
    added = []
    if not self._sparse:
        fresh = self._pool.take(sum(more))
        for g, (table, m) in enumerate(zip(req.tables, more, strict=True)):
            new, fresh = fresh[:m], fresh[m:]
            self._index.own(g, new)
            table += new
            added.append(tuple([b.block_id for b in new]))
        return tuple(added)
    fresh = self._pool.take(_fresh(self, more) + len(holes) + len(cows) + len(marks))
    ahead = self._ahead
    for g, (spec, table, m) in enumerate(zip(self.groups, req.tables, more, strict=True)):
        ck = g in marks  # (then ``new[0]``, put at the entry before the step's end)
        k = (min(m, 1) if spec.sparse else m) + (g in holes) + (g in cows) + ck
        new, fresh = fresh[:k], fresh[k:]
        self._index.own(g, new)
        if g in cows:
            partial.moved(self, req, g, new[0])
            new = new[1:]
        if ahead is not None and ahead[g] and spec.sparse:  # (its blocks ahead: spec_states.py)
            assert g not in holes, "a step short of a sparse group's state entry beside blocks ahead"
            shift(table, m, ahead[g], new, ck)
            ck = False  # (in its place already)
        elif g in holes:
            table[blocks_for(total, self._group_sizes[g]) - 1] = new[-1]
        elif ck:
            table += [None] * (m - k + 1) + new[1:]  # type: ignore[operator]
        else:
            table += [None] * (m - k) + new  # type: ignore[operator]
        if ck:  # (also where ``reserve`` grew the table past it: that entry is empty)
            table[blocks_for(total, self._group_sizes[g]) - 2] = new[0]
        added.append(tuple([b.block_id for b in new]))
    return tuple(added)


def _grow(self: HybridKVCacheManager, req: GroupRequest, total: int, new_tokens: Sequence[int] | None,
          prepared: Prepared | None = None) -> Growth | None:
    """As the one-size ``_grow`` (growth.py), each group covering ``[0, total)`` at
    its own block size, the prefix ids at the hash size."""
    h, start, n = self._hash_size, req.num_scheduled, len(req.tokens)
    going, freed = self._going(req, start)
    more = _more(self, req, total)
    holes: Sequence[int] = ()
    cows = _cows(self, req) if self._owners else ()  # (none but with partial hits)
    marks: Sequence[int] = ()
    if self._sparse:
        holes = _holes(self, req, total)
        if self.sizes.checkpoints:
            last = checkpoints.prefill_end(self, req, n + len(new_tokens or ()))
            marks = checkpoints.count(self, req.tables, start, total, last)
        if _fresh(self, more) + len(holes) + len(cows) + len(marks) > self._pool.num_free + freed:
            return None
    elif sum(more) > self._pool.num_free + freed:
        return None
    first, last = start // h, total // h
    if self._lookahead:  # (the hash blocks whose keys are known: groups/lookahead.py)
        first, last = lookahead.span(self, req, last)
    if new_tokens is not None:
        req.tokens.extend(new_tokens)
    try:
        if prepared is None and first < last:
            prepared = self._prepare(req, first, last, req.nodes[-1] if req.nodes else None, req.prompt)
    except (ConfigError, RequestError):
        del req.tokens[n:]  # (a hash_mode callable failed, lookahead.check_keyed: nothing changes)
        raise
    self._release(req, going)
    if marks:
        checkpoints.note(self, req, start, total, req.tables, last)
    added = _take(self, req, more, holes, total, cows, marks)
    if self._sparse:
        sized_admission._mark(self, req, total)
    req.num_scheduled, req.step_start = total, max(start, req.step_start)
    if total >= n:  # (the prefill's last chunk: its prepared prompt is done with)
        req.prompt = None
    if prepared is not None:
        self._record(req, first, prepared)
    return added


def _cows(self: HybridKVCacheManager, req: GroupRequest) -> list[int]:
    """The groups whose partial entry ``req`` owns (its next growth moves each)."""
    return [g for g, _, _ in partial.pending(self, req)]


def _roomy(self: HybridKVCacheManager, req: GroupRequest) -> bool:
    """Whether one more token at ``num_scheduled`` fills no hash block (so no block of
    any group, nor an aligned end), lands in a block every table has (a sparse group's
    included: its state goes there), moves no window past a block and moves no owned
    partial entry."""
    n, h = req.num_scheduled, self._hash_size
    if self._owners and partial.pending(self, req):
        return False
    return n % h != h - 1 and n < req.next_release and all(
        n < len(t) * b for t, b in zip(req.tables, self._group_sizes, strict=True)) and (
        not self._sparse or all(req.tables[g][n // self._group_sizes[g]] is not None for g in self._sparse))


def reserve(self: HybridKVCacheManager, request_id: Hashable, num_slots: int) -> Growth | None:
    """As ``HybridKVCacheManager.reserve``, each group at its own block size."""
    req = self._get(request_id)
    check_count("num_slots", num_slots, 0, None)
    covered = req.num_scheduled + num_slots
    if self._ahead is not None:
        refuse_slots(self, covered - req.num_reserved if covered > req.num_reserved else 0)
    more, cows = _more(self, req, covered), _cows(self, req)
    if _fresh(self, more) + len(cows) > self._pool.num_free:
        return None
    req.num_reserved = max(req.num_reserved, covered)
    return _take(self, req, more, cows=cows)


def num_blocks_to_allocate(self: HybridKVCacheManager, request_id: Hashable, num_slots: int) -> int:
    """As ``HybridKVCacheManager.num_blocks_to_allocate``, each group at its own
    block size."""
    req = self._get(request_id)
    check_count("num_slots", num_slots, 0, None)
    marks = () if not self.sizes.checkpoints else checkpoints.count(
        self, req.tables, req.num_scheduled, num_slots, checkpoints.prefill_end(self, req, len(req.tokens)))
    return max(0, _fresh(self, _more(self, req, num_slots)) + len(_cows(self, req)) + len(marks)
               - self._going(req, req.num_scheduled)[1])


class SizedHybridKVCacheManager(HybridKVCacheManager):
    """A ``HybridKVCacheManager`` whose groups' block sizes differ (or whose hash block
    or alignment is not its one size): made by ``HybridKVCacheManager(groups,
    num_blocks, block_size=BlockSizes.of(...))``; the module says what differs.
    ``block_size`` is ``sizes.align``: every hit and every recorded prefix is a
    multiple of it."""

    _serves_sizes = True
    _admit = sized_admission._admit
    _hit_nodes = sized_admission._hit_nodes
    lookup_block_ids = sized_admission.lookup_block_ids
    _record = _record
    _grow = _grow
    _roomy = _roomy
    reserve = reserve
    num_blocks_to_allocate = num_blocks_to_allocate
    _release_order = sized_release._release_order
    _free_order = sized_release._free_order
    _check_request = sized_release._check_request
    rewind = sized_rewind.rewind
    fork = sized_release.fork
    uncache_blocks = sized_release.uncache_blocks

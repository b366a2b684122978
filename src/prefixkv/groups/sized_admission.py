"""Admission and lookups of a hybrid manager whose groups' block sizes differ
(``SizedHybridKVCacheManager``, sized.py): the hit is ``BlockSizes.longest_hit``'s over
the prefix ids of the prompt's full hash blocks, a multiple of ``align``; group g takes
the hit's ``L // b_g`` blocks but those its window no longer reads, and fresh blocks up
to the scheduled tokens and the lookahead at its own size (a sparse, Mamba, group one
only, where the step ends: the entries before it empty). The checks before any change
are ``add_request``'s (admission.py), which calls ``_admit`` here once they pass."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice
from typing import TYPE_CHECKING

from ..core.block import Block, blocks_for, hit_limit
from ..core.prompt import Prompt
from ..core.request import RequestKeys
from ..errors import ConfigError, PromptTooLongError
from ..extra_keys import ExtraKeys
from . import checkpoints, loads, partial, partial_eagle, partial_full, spec_states
from .hits import longest_sized_hit, peeking_sized_hit
from .lookup import hit_nodes, peeking
from .prefixes import Prefix
from .request import GroupRequest
from .results import GroupAdmission
from .spec import FULL, SLIDING, GroupSpec
from .spec_blocks import lengths

if TYPE_CHECKING:
    from .manager import HybridKVCacheManager


def _hit_nodes(self: HybridKVCacheManager, chunks: Sequence[bytes], keys: RequestKeys, n: int,
               max_hit_tokens: int | None, peek: Sequence[bool], alone: list[int] | None) -> list[Prefix]:
    """The prefix ids (one per hash block) of the longest prefix, a multiple of
    ``align`` and at most ``n - 1`` tokens (and ``max_hit_tokens``), that every group
    serves; ``alone[g]``: the hash blocks group g alone serves (aligned to its own
    size). With ``peek``, vLLM's EAGLE hit (``hits.peeking_sized_hit``), which may look
    at the prompt's last full hash block (``alone`` then within the hash blocks it walks,
    up to one largest block past the cap). Raises ConfigError for a ``peek`` on a layout
    ``check_peek`` refuses."""
    h, sizes, find = self._hash_size, self.sizes, self._index.find
    cap = n - 1 if max_hit_tokens is None else min(n - 1, max_hit_tokens)
    if any(peek):
        if sizes.eagle and sizes.partial:
            return partial_eagle.eagle_hit(self, chunks, keys, n, cap, peek, alone)
        if sizes.eagle:  # (at one size, beside checkpoints: the one-size manager's hit, Mamba's too)
            limit = hit_limit(n, h, max_hit_tokens)
            return hit_nodes(self.groups, self._table, find, h, chunks, keys, n, limit, peek, alone,
                             self._uncached) if limit else []
        check_peek(self.groups, sizes.sizes)
    walked = (min(n, cap + max(sizes.sizes)) if any(peek) else cap) // h
    nodes = self._table.walk(chunks, keys.of_blocks(0, walked), walked)

    def cached(g: int, j: int) -> bool:
        i = sizes.key_index(g, j)
        return i < len(nodes) and find(g, nodes[i]) is not None
    if alone is not None:  # (with peek: each group's run within the nodes the peek walks)
        for g, (spec, b) in enumerate(zip(self.groups, self._group_sizes, strict=True)):
            alone[g] = longest_sized_hit((spec,), (b,), b, len(nodes) * h,
                                         lambda _, j, g=g: cached(g, j)) // h  # type: ignore[misc]
        for g in self._fine:  # (vLLM's full attention alone looks inside its next block too)
            alone[g] = partial_full.alone(self, nodes, g, alone[g])
    if any(peek):
        return nodes[:peeking_sized_hit(self.groups, sizes.sizes, sizes.align, cap, n // h * h, cached,
                                        peek) // h]
    if sizes.partial:
        return nodes[:partial.longest_hit(self, nodes, len(nodes))]
    return nodes[:sizes.longest_hit(self.groups, len(nodes) * h, cached) // h]


def check_peek(specs: Sequence[GroupSpec], sizes: Sequence[int]) -> None:
    """Raises ConfigError unless the sized manager finds a ``peek`` hit (vLLM's EAGLE)
    on groups ``specs`` of block ``sizes`` as vLLM does: full-attention and
    sliding-window groups of at most two (spec, size) sets, full attention one of them
    when two (vLLM's hit is then one pass: ``hits.peeking_sized_hit``)."""
    sets = set(zip(specs, sizes, strict=True))
    if any(s.kind not in (FULL, SLIDING) for s in specs) or len(sets) > 2 or (
            len(sets) == 2 and all(s.kind != FULL for s, _ in sets)):
        raise ConfigError(f"peek with groups of different block sizes is served on full-attention and "
                          f"sliding-window groups of two (spec, size) sets at most, full attention one "
                          f"of them when two (docs/groups.md), got {len(sets)} sets of "
                          f"{sorted({s.kind for s in specs})}")


def _window_hits(self: HybridKVCacheManager, nodes: list[Prefix],
                 first: int | None = None) -> tuple[list[int], list[list[Block]]]:
    """Per group, the leading blocks a request admitted on the hit ``nodes`` holds none
    of when its first query sits at ``first`` (default: the hit's end;
    ``GroupSpec.admitted_cut``) and the hit's blocks past them (``L // b_g`` in all), in
    order."""
    sizes, hit = self.sizes, len(nodes) * self._hash_size
    at = hit if first is None else first
    cuts = [s.admitted_cut(hit, at, b) for s, b in zip(self.groups, sizes.sizes, strict=True)]
    rows: list[list[Block]] = [[self._index.find(g, nodes[sizes.key_index(g, j)])  # type: ignore[misc]
                                for j in range(cuts[g], hit // b)] for g, b in enumerate(sizes.sizes)]
    if sizes.partial and hit % sizes.align:
        partial.hit_rows(self, nodes, cuts, rows)
    return cuts, rows


def lookup_block_ids(self: HybridKVCacheManager, prompt_token_ids: Sequence[int] | Prompt, *,
                     extra: ExtraKeys | None = None, max_hit_tokens: int | None = None,
                     peek: bool | Sequence[bool] = False) -> tuple[tuple[int, ...], ...]:
    """As ``HybridKVCacheManager.lookup_block_ids``: group g's ``L // b_g`` entries."""
    nodes = self._find(None, prompt_token_ids, extra, True, max_hit_tokens=max_hit_tokens,
                       peek=peeking(self.groups, peek))[1]
    null = self.null_block_id
    cuts, hits = _window_hits(self, nodes)
    return tuple((null,) * cut + tuple([b.block_id for b in found])  # type: ignore[misc]
                 for cut, found in zip(cuts, hits, strict=True))


def least_blocks(self: HybridKVCacheManager, n: int, num_new: int | None, lookahead: int,
                 full_fit: bool) -> int:
    """The fewest blocks, all groups together, that an admission of ``n`` tokens with
    these arguments and the rest of its prefill need at some point, over every aligned
    hit it could find (``groups.fit.least_blocks`` at per-group sizes; a sparse group
    holds one block once the prefill is done, and takes one at most)."""
    pairs = list(zip(self.groups, self._group_sizes, strict=True))
    done = sum(1 if s.sparse else blocks_for(n, b) - s.num_released(n - 1, b) + s.ahead for s, b in pairs)

    def after(hit: int) -> int:  # blocks held right after an admission that hit ``hit`` tokens
        total = n if num_new is None else min(n, hit + num_new)
        out = 0
        for s, b in pairs:
            fresh = blocks_for(total + lookahead, b) - hit // b
            if full_fit:
                fresh = max(fresh, blocks_for(n, b) - hit // b)
            out += (min(fresh, 1) if s.sparse else fresh + s.ahead) + (hit % b > 0) + hit // b - s.num_unread(
                hit, b)
        return out
    return max(done, min(after(hit) for hit in range(0, n, self.sizes.unit)))


def _mark(self: HybridKVCacheManager, req: GroupRequest, total: int) -> None:
    """A step (or a hit) ends at ``total``: the sparse groups' blocks ending there hold
    the state at their end (what ``_record`` may record; a block a step ran past holds
    the state it had when the step before ended in it)."""
    for g in self._sparse:
        b = self._group_sizes[g]
        if total and not total % b:
            if req.states is None:
                req.states = set()
            req.states.add((g, total // b - 1))


def _admit(self: HybridKVCacheManager, req: GroupRequest, nodes: list[Prefix], prompt: Prompt | None,
           num_new_tokens: int | None, resumed: bool, num_lookahead_tokens: int,
           require_full_fit: bool, keep_free: int, num_external_tokens: int,
           hold_tail: bool = True) -> GroupAdmission | None:
    """``add_request`` once its arguments are checked and its hit found (``nodes``),
    each group at its own block size (``hold_tail``: ``add_request``'s)."""
    sizes, h = self._group_sizes, self._hash_size
    n, k = len(req.tokens), len(nodes)
    num_cached, usable = k * h, self.num_blocks - (self._null is not None)
    ahead = self._ahead
    if sum(blocks_for(n + num_lookahead_tokens, b) for b in sizes) + sum(ahead or ()) > usable:  # else fits
        need = least_blocks(self, n, num_new_tokens, num_lookahead_tokens, require_full_fit)
        if need > usable:
            raise PromptTooLongError(n, need, usable, " usable (all groups' blocks counted together)")
    total = n if num_new_tokens is None else min(n, num_cached + num_new_tokens)
    first = min(num_cached + num_external_tokens, n)  # the first query's position
    cuts, hits = _window_hits(self, nodes, first)
    covered = [blocks_for(total + num_lookahead_tokens, b) for b in sizes]
    cuts = [min(c, v) for c, v in zip(cuts, covered, strict=True)]  # (a window's: none below its cut)
    more = [v - c - len(found) for v, c, found in zip(covered, cuts, hits, strict=True)]
    # a sparse group takes the block where this step ends only, if a new entry (its
    # lookahead slots get theirs when a step ends there)
    # (and after a load the block where it ends: groups/loads.py)
    where = [loads.places(b, num_cached, first, total) if s.sparse else ()
             for s, b in zip(self.groups, sizes, strict=True)]
    ends = [w[-1] if w else blocks_for(total, b) - 1 for w, b in zip(where, sizes, strict=True)]
    taken = [loads.count(w, v - m) if s.sparse else m
             for s, v, m, w in zip(self.groups, covered, more, where, strict=True)]
    if ahead is not None:  # (the blocks a group holds past the table's end: spec_blocks.py)
        spec_states.refuse_slots(self, num_lookahead_tokens)
        spec_states.refuse_load(self, num_cached, first)
        more, taken = lengths(more, ahead), lengths(taken, ahead)
    cows = partial.cows(self, num_cached, cuts, hits) if self.sizes.partial else set()
    for g in cows:
        taken[g] += 1  # (first of its new blocks: the copy on write)
    marks: Sequence[int] = ()
    if self.sizes.checkpoints:
        rows = [[None] * c + found for c, found in zip(cuts, hits, strict=True)]
        last = checkpoints.prefill_end(self, req, n)
        marks = checkpoints.count(self, rows, num_cached, total, last)
        for g in marks:
            taken[g] += 1  # (before the block where the step ends: the checkpoint)
    held = [b for found in hits for b in found]
    fit = 0
    if require_full_fit:  # (a Mamba group: its block, and a checkpoint where the prompt's would take one)
        whole = checkpoints.count(self, rows, num_cached, n, last) if self.sizes.checkpoints else []
        fit = len(cows) + sum(ahead or ()) + sum(min(x, 1 + (g in whole)) if s.sparse else x for g, (s, x) in
            enumerate(zip(self.groups, [blocks_for(n, b) - num_cached // b for b in sizes], strict=True)))
    if not self._pool.can_acquire(held, max(sum(taken) + keep_free, fit)):
        return None
    prepared = None  # (the new full hash blocks' data: computed before any change)
    keyed = total // h if not self._lookahead else min(total // h, len(req.keys.mm))  # type: ignore[arg-type]
    if keyed > k:  # (under lookahead keys, those known: groups/lookahead.py)
        prepared = self._prepare(req, k, keyed, nodes[-1] if nodes else None, prompt)
    got = self._pool.acquire(held, sum(taken))[len(held):]
    if first > num_cached and self._sparse:  # (a load's blocks first, as vLLM's: groups/loads.py)
        got = loads.in_order(got, taken, [
            loads.loaded(t, v - m, blocks_for(first, b), w if s.sparse else None)
            for t, v, m, b, w, s in zip(taken, covered, more, sizes, where, self.groups, strict=True)])
    fresh = iter(got)
    req.cut = cuts
    for g, (found, m) in enumerate(zip(hits, more, strict=True)):
        new: list[Block | None] = list(islice(fresh, taken[g]))
        self._index.own(g, new)  # type: ignore[arg-type]
        copy = new.pop(0) if g in cows else None
        if ahead is not None and ahead[g] and self.groups[g].sparse:  # (and its blocks ahead)
            new = spec_states.first_row(m, ahead[g], new, covered[g] - 1 - ends[g])  # type: ignore[arg-type]
        elif self.groups[g].sparse:  # (None but where the step ends, and at its checkpoint)
            ck = new.pop(0) if g in marks else None
            row = loads.row(where[g], covered[g] - m, m, new)
            if ck is not None:
                row[ends[g] - 1 - (covered[g] - m)] = ck
            new = row
        req.tables[g] = [*[None] * cuts[g], *found, *new]
        self._hit_blocks[g] += len(found)
        if copy is not None:
            partial.on_hit(self, req, g, cuts[g] + len(found) - 1, copy)
            if prepared is None and g in self._fine and hold_tail:  # (``_record`` does not run)
                partial_full.on_hit(self, req, g, nodes, copy)
    if self._sparse:
        _mark(self, req, k * h)  # (the hit's state block)
        _mark(self, req, total)
        if first > num_cached:  # (a load's: groups/loads.py)
            loads.mark(self._sparse, sizes, req, first)
    if marks:
        checkpoints.note(self, req, num_cached, total, rows, last)
    return self._enter(req, nodes, prompt, prepared, first, total, num_lookahead_tokens, resumed)



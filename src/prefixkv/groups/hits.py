"""The hit rule of a hybrid model: the longest prefix every group can serve.

A candidate hit of ``k`` blocks (the request computes from position ``k*bs`` on) is
accepted by a group when it holds, cached, every block its future queries read:

    full attention : blocks 0 .. k-1
    other groups   : blocks spec.num_unread(k*bs, bs) .. k-1  (the window or chunk at k*bs)

The hit is the largest ``k <= limit`` that every group accepts. Rule (one pass downward,
no fixed-point iteration): start from ``k`` = the shortest full-attention run; for each
other group scan its blocks from ``k - 1`` down to the first one it needs. A miss at block
``j`` rejects ``k`` and every ``k'`` in ``(j, k]`` too, because ``num_unread`` never
decreases, so each ``k'`` there still needs block ``j``: the candidate drops straight to
``k = j`` and the groups are checked again. Blocks a group already showed cached below the
candidate are remembered, so every block of every group is probed at most once:
``O(limit)`` probes per group, whatever the windows. tests/test_groups_hits.py checks the
rule against brute force over every ``k``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..core.block import blocks_for
from ..errors import ConfigError
from .spec import FULL, GroupSpec


def longest_hit(specs: Sequence[GroupSpec], block_size: int, limit: int,
                cached: Callable[[int, int], bool], peek: Sequence[bool] = ()) -> int:
    """The largest ``k`` in ``[0, limit]`` that every group accepts (module docstring).
    ``cached(g, j)``: whether block ``j`` of the prefix is cached in group ``g`` (called
    at most once per ``(g, j)``, only for ``j < limit``, and ``j <= limit`` in a group
    that peeks).

    ``peek[g]`` (default: no group): group ``g`` accepts a hit ``k > 0`` only when block
    ``k`` is cached too, beside the blocks it reads (vLLM's EAGLE: its groups match one
    block past the hit, then drop it). Then a miss at ``j`` rejects every ``k`` in
    ``[j, ...]`` that reads it, so the candidate drops to ``j - 1``. Raises ConfigError
    for a ``block_size`` that is not a positive int or a ``limit`` that is not an int."""
    if (block_size.__class__ is not int or block_size < 1 or limit.__class__ is not int):
        raise ConfigError(f"longest_hit needs a positive int block_size and an int limit, "
                          f"got {block_size!r} and {limit!r}"[:200])
    shift = [int(bool(p)) for p in peek] + [0] * (len(specs) - len(peek))
    k = limit
    for g, spec in enumerate(specs):
        if not spec.releases:
            run = 0
            while run < k + shift[g] and cached(g, run):
                run += 1
            k = max(0, run - shift[g])
    windowed = [g for g, s in enumerate(specs) if s.releases]
    # blocks low[g] .. k - 1 + shift[g] (the last one the candidate reads) are known cached in g
    low = {g: k + shift[g] for g in windowed}
    settled = False
    while not settled:
        settled = True
        for g in windowed:
            if not k:
                break  # (no hit: every group accepts it)
            need = specs[g].num_unread(k * block_size, block_size)
            j = min(low[g], k + shift[g]) - 1
            while j >= need and cached(g, j):
                j -= 1
            if j >= need:  # a miss at j: no candidate from j + 1 - shift[g] on can be served by g
                k = max(0, j - shift[g])
                for h in windowed:
                    low[h] = min(low[h], k + shift[h])
                settled = False
                break
            low[g] = min(low[g], max(need, 0))
    return k


def longest_sized_hit(specs: Sequence[GroupSpec], sizes: Sequence[int], align: int, limit: int,
                      cached: Callable[[int, int], bool]) -> int:
    """The hit, in tokens, when the groups' block sizes differ (vLLM's hybrid layouts,
    docs/groups.md "Hits"): the largest ``L <= limit``, a multiple of ``align`` (the lcm
    of ``sizes``, or a multiple of it), at which every group ``g`` holds, cached, the
    blocks a query at ``L`` reads, ``spec.first_needed(L) // sizes[g] .. L // sizes[g] - 1``.
    ``cached(g, j)``: block ``j`` (positions ``j*sizes[g] ..``) of the prefix is cached in
    group ``g``; called at most once per ``(g, j)``, only for blocks below the first
    candidate. The same search as ``longest_hit``, in tokens: a miss at block ``j`` of
    group ``g`` rejects every candidate from ``(j + 1) * sizes[g]`` up (each still reads
    it), so the candidate drops to the aligned length below ``j * sizes[g] + 1``.
    ``sizes`` and ``align`` as ``sizes.BlockSizes`` makes them: raises ConfigError for an
    ``align`` or a size that is not a positive int, a size that does not divide ``align``,
    or a ``limit`` that is not an int."""
    if (align.__class__ is not int or align < 1 or limit.__class__ is not int
            or len(sizes) < len(specs)
            or any(b.__class__ is not int or b < 1 or align % b for b in sizes)):
        raise ConfigError(f"longest_sized_hit needs positive int sizes (one a group) that "
                          f"divide a positive int align, and an int limit, got sizes "
                          f"{sizes!r}, align {align!r}, limit {limit!r}"[:200])
    top = limit - limit % align if limit > 0 else 0
    for g, spec in enumerate(specs):
        if not spec.releases:
            b, run = sizes[g], 0
            while run < top // b and cached(g, run):
                run += 1
            top = min(top, run * b // align * align)
    windowed = [g for g, s in enumerate(specs) if s.releases]
    # blocks known[g] .. top // sizes[g] - 1 are known cached in g (none at first)
    known = {g: top // sizes[g] for g in windowed}
    changed = True
    while changed and top:
        changed = False
        for g in windowed:
            b = sizes[g]
            need = specs[g].first_needed(top) // b
            j = min(known[g], top // b) - 1
            while j >= need and cached(g, j):
                j -= 1
            if j >= need:
                top, changed = j * b // align * align, True
                break
            known[g] = need  # (need never rises as top drops)
    return top


def peeking_sized_hit(specs: Sequence[GroupSpec], sizes: Sequence[int], align: int, limit: int,
                      hashed: int, cached: Callable[[int, int], bool], peek: Sequence[bool]) -> int:
    """The hit, in tokens, as vLLM 0.33 finds it with EAGLE when the groups' block sizes
    differ (docs/groups.md "EAGLE"): ``peek[g]``, group g matches one block past the hit
    and drops it. Groups of one spec and size form a set, looked up together (a block is
    cached in a set when it is in each of its groups; the set peeks when one of them
    does); the sets, full attention first, each take the candidate (first ``limit``)
    down, in one pass (vLLM's, for at most two sets, full attention one of them when
    two: the caller checks that). A set of block size ``b`` looks at its blocks below
    the candidate, plus ``b`` when it peeks (at most ``hashed``, the prompt's full hash
    blocks, in tokens):

    - full attention: its run of cached blocks from block 0, less one block when it
      peeks, rounded down to ``align``;
    - a window W (``per = align // b`` blocks a span): the highest run of
      ``cdiv(W - 1, b)`` (+1 peeking) cached blocks whose top ends an aligned span
      (peeking: starts one), the hit ending there (peeking: at the top's start); else
      the run of cached blocks from 0 up to the highest such top, rounded down to
      ``align``, less one block when it peeks, rounded down again (so with ``per > 1``
      a peeking window there falls one span below its run: vLLM's rule, kept).

    ``cached(g, j)``: block ``j`` of group ``g`` is cached (asked only for blocks within
    ``hashed``)."""
    sets: dict[tuple[GroupSpec, int], list[int]] = {}
    for g, key in enumerate(zip(specs, sizes, strict=False)):
        sets.setdefault(key, []).append(g)
    top = limit
    for (spec, b), gs in sorted(sets.items(), key=lambda s: s[0][0].kind != FULL):
        e = int(any(peek[g] for g in gs))
        end = (min(top + b, hashed) if e else top) // b  # (blocks 0 .. end - 1 are looked at)

        def held(j: int, gs: list[int] = gs) -> bool:
            return all(cached(g, j) for g in gs)
        if spec.kind == FULL:
            run = 0
            while run < end and held(run):
                run += 1
            top = max(0, run - e) * b // align * align
            continue
        per, need = align // b, blocks_for(spec.tokens - 1, b) + e
        count, length = 0, -1
        for i in range(end - 1, -1, -1):
            if not held(i):
                count = 0
            elif count or not (i + 1 - e) % per:  # (a run's top: on a span's edge)
                count += 1
                if count == need:
                    length = i + need - e
                    break
        if length < 0:  # (the run from block 0)
            length = count // per * per
            if e and length:
                length = (length - 1) // per * per
        top = length * b
    return top

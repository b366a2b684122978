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

from ..errors import ConfigError
from .spec import GroupSpec


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

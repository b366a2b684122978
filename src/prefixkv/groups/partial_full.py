"""vLLM's fine-grained partial hits in a full-attention group larger than the hash block
(``BlockSizes.partial`` beside Mamba; docs/groups.md "Full attention larger than the hash
block"): the manager's side of groups/fine.py.

    tokens        | 0 .. h-1 | h .. 2h-1 | 2h .. 3h-1 | 3h .. 4h-1 |
    full (4h)     |                 block 0                       |
                                          ^ P: the prompt's last hash boundary, an entry of block 0

- **Hit** (``longest_hit``, partial.py): full attention's run of whole blocks, then the
  longest hash boundary inside the next block whose partial entry every such group holds
  (``FineEntries.find``, probed longest first, as vLLM's ``find_longest_cache_hit``);
  the Mamba groups then take the hit down. Full attention's hit rows end with the block
  found there (``rows``), even when Mamba took the hit below that boundary.
- **Copy on write**: a hit that ends inside a block of the group copies it, as a Mamba
  hit does (partial.py ``cows``, ``on_hit``). The entry's producer is never copied:
  attention is written append-only, its entry stays on the block it keeps writing.
- **Entry** (``tail``, at each ``_record``; ``on_hit``, at an admission that records
  nothing): at every caching (vLLM's ``cache_blocks``), once the request has computed
  the prompt's last hash boundary ``P`` before its last token, inside one of the
  group's blocks, that block holds ``P``'s prefix (``fine.hold``). A step that first
  reaches ``P`` passes it, so records; the entry then stays on the request's block
  (held) until promoted, which the same ``_record`` follows with ``tail``.
- **Promotion** (``GroupIndex.store``): a block cached whole while its only content is
  its entry loses it first; the step's ``tail`` then adds it back beside the whole key.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import takewhile
from typing import TYPE_CHECKING

from ..core.block import Block
from . import fine, partial
from .prefixes import Prefix

if TYPE_CHECKING:
    from .manager import HybridKVCacheManager
    from .request import GroupRequest


def longest_hit(self: HybridKVCacheManager, nodes: Sequence[Prefix], limit: int) -> int:
    """``partial.longest_hit`` beside full attention larger than the hash block: full
    attention's run of whole blocks (every such group), then ``extend`` inside the next,
    then the Mamba groups take the hit down (``partial.mamba_hit``). Full-attention
    groups of the hash block's size beside them take their run of whole blocks before
    or after, in vLLM's order (its coordinator looks each size up once, under the hit
    the sizes before it found: its first group's first):

        full (2h) first: | 0 .. 2h-1 whole | P at 3h |     -> 3h, then full (h) under 3h
        full (h) first:  full (h)'s run r, then full (2h)'s run and P under r"""
    before, after = self._fine_plain
    cap = min(limit, len(nodes))
    if before:
        cap = _plain_run(self, nodes, before, cap)
    top = extend(self, nodes, whole_run(self, nodes, cap), cap)
    if after:
        top = _plain_run(self, nodes, after, top)
    return partial.mamba_hit(self, nodes, top)


def whole_run(self: HybridKVCacheManager, nodes: Sequence[Prefix], top: int) -> int:
    """The run of whole blocks of ``nodes[:top]`` every fine group finds, in hash
    blocks (vLLM's phase 1)."""
    s = self._group_sizes[self._fine[0]] // self._hash_size
    for g in self._fine:
        k = 0
        for found in self._index.finds(g, nodes[s - 1:top:s]):
            if not found:
                break
            k += 1
        top = k * s
    return top


def _plain_run(self: HybridKVCacheManager, nodes: Sequence[Prefix], groups: Sequence[int], top: int) -> int:
    """The run of ``nodes[:top]`` every group of ``groups`` (full attention of the hash
    block's size) finds whole, in hash blocks."""
    finds = self._index.finds
    for g in groups:
        top = sum(1 for _ in takewhile(bool, finds(g, nodes[:top])))
    return top


def alone(self: HybridKVCacheManager, nodes: Sequence[Prefix], g: int, run: int) -> int:
    """What full-attention group ``g`` alone serves of ``nodes`` (all within the cap),
    in hash blocks, its run of whole blocks being ``run``: the longest boundary inside
    the next block whose partial entry it holds, else ``run`` (vLLM's lookup of that
    group alone: ``lookup_per_group``, the junction's first group)."""
    s = self._group_sizes[g] // self._hash_size
    found = self._index.fine.find
    for i in range(min(run + s - 1, len(nodes)) - 1, run - 1, -1):
        if found(g, nodes[i]) is not None:
            return i + 1
    return run


def extend(self: HybridKVCacheManager, nodes: Sequence[Prefix], run: int, cap: int) -> int:
    """vLLM's phase 2: the longest hash boundary inside the block after full attention's
    run of ``run`` hash blocks (and at most ``cap``) at which every such group finds a
    partial entry, in hash blocks (``run`` when none). What full attention found is
    kept for ``rows`` (``_fine_top``: the walked nodes, the run, the hit)."""
    s = self._group_sizes[self._fine[0]] // self._hash_size
    found = self._index.fine.find
    top = run
    for i in range(min(run + s - 1, cap) - 1, run - 1, -1):
        if all(found(g, nodes[i]) is not None for g in self._fine):
            top = i + 1
            break
    self._fine_top = (nodes, run, top)
    return top


def rows(self: HybridKVCacheManager, nodes: Sequence[Prefix], rows: list[list[Block]]) -> None:
    """A hit of ``nodes`` ending inside a block of the fine groups: each one's row ends
    with that block as full attention found it (vLLM's rows, cut to the hit's blocks):
    whole, or, past its run, by the partial entry at its longest boundary."""
    assert self._fine_top is not None and nodes, "a hit inside a full-attention block comes from ``extend``"
    walked, run, top = self._fine_top
    s = self._group_sizes[self._fine[0]] // self._hash_size
    end = (len(nodes) // s + 1) * s  # (the block's end, in hash blocks)
    for g in self._fine:
        got = self._index.find(g, walked[end - 1]) if end <= run else \
            self._index.fine.find(g, walked[top - 1])
        assert got is not None, (len(nodes), run, top)
        rows[g].append(got)


def on_hit(self: HybridKVCacheManager, req: GroupRequest, g: int, nodes: Sequence[Prefix],
           copy: Block) -> None:
    """An admission on the hit ``nodes`` copied group ``g``'s block on write into
    ``copy`` and computes no hash block past the hit (``_record`` does not run): when
    the hit is the prompt's last hash boundary, the copy holds its entry (``tail``'s
    rule, at the admission's caching)."""
    h, k = self._hash_size, len(nodes)
    if _last(self, req) == k:
        fine.hold(self._index, g, copy, nodes[-1], k - 1, req.tokens,
                  req.keys.for_event(k - 1, h) if self._index.hashing else None, h)


def _last(self: HybridKVCacheManager, req: GroupRequest) -> int:
    """The hash boundary, in hash blocks, of ``req``'s prompt (of ``p`` tokens) that the
    fine groups' partial entry keys: its last before its last token (a resend's longest
    hit); when they peek (vLLM's EAGLE groups: ``sizes.peek``), its last (their lookup
    reads the whole prompt, then drops one hash block); under lookahead keys, its last
    before its last token among the hash blocks whose keys are known (vLLM's
    ``min((p - 1) // h, len(block_hashes))``: it moves up as the request's tokens after
    the prompt become known, ``know_tokens``; groups/lookahead.py)."""
    peek = self.sizes.peek
    h, p = self._hash_size, req.num_prompt
    if peek and peek[self._fine[0]]:
        return p // h
    if self._lookahead:
        return min(max(0, p - 1) // h, len(req.keys.mm))  # type: ignore[arg-type]
    return max(0, p - 1) // h


def tail(self: HybridKVCacheManager, req: GroupRequest) -> None:
    """vLLM's ``_cache_partial_tail_block`` for each fine group after a step: once
    ``req`` computed its prompt's last hash boundary before its last token (with
    ``sizes.eagle``, its last: ``_last``), inside one of the group's blocks, that block
    holds the boundary's prefix (``fine.hold``)."""
    h = self._hash_size
    end = _last(self, req) * h
    i = end // h - 1
    if not end or end > min(req.num_scheduled, len(req.tokens)) or i >= len(req.nodes):
        return
    node = req.nodes[i]
    extra = req.keys.for_event(i, h) if self._index.hashing else None
    for g in self._fine:
        b, table = self._group_sizes[g], req.tables[g]
        j = end // b
        x = table[j] if end % b and j < len(table) else None
        if x is not None:
            fine.hold(self._index, g, x, node, i, req.tokens, extra, h)

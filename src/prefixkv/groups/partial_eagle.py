"""vLLM's EAGLE beside fine-grained partial hits (``BlockSizes.eagle``; docs/groups.md
"EAGLE beside Mamba"), full attention at the hash block's size: the hit of a
lookup that peeks.

    tokens      | ... | F - h .. F - 1 | F .. F + h - 1 |
    full (h)    |  run of cached blocks, at most cap + h, ^ F           |
    hit         | the longest Mamba entry at or below F - h (EAGLE recomputes the rest)

vLLM's coordinator (one pass: full attention, then the Mamba groups) lets full
attention match up to ``cap + h`` (at most the prompt's full hash blocks), drops one hash
block (the drafter recomputes it), and the Mamba groups, whose lookup drops nothing, take
the longest state at or below what is left: a block's own key or a partial entry
(partial.py). Their partial entries are recorded one hash block below the prompt's last
hash boundary, where such a hit resumes (``partial.tail``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..core.request import RequestKeys
from . import partial, partial_full
from .prefixes import Prefix

if TYPE_CHECKING:
    from .manager import HybridKVCacheManager

__all__ = ["eagle_hit"]


def eagle_hit(self: HybridKVCacheManager, chunks: Sequence[bytes], keys: RequestKeys, n: int, cap: int,
              peek: Sequence[bool], alone: list[int] | None) -> list[Prefix]:
    """The prefix ids of the hit of a prompt of ``n`` tokens (``chunks``, ``keys``) within
    ``cap`` tokens when the groups ``peek`` names (full attention at the hash block's
    size: ``sizes.manager_sizes`` checks it) peek: their run of cached blocks within
    ``cap`` plus one hash block (and the prompt's full hash blocks), less one, then the
    Mamba groups' longest entry at or below it (module docstring). ``alone[g]``, when
    given: the hash blocks group ``g`` alone serves of those looked at (a full-attention
    group's run, a Mamba group's longest entry; vLLM's junction reads full attention's).
    Changes nothing."""
    walked = min(n, cap + self._hash_size) // self._hash_size
    nodes = self._table.walk(chunks, keys.of_blocks(0, walked), walked)
    top = len(nodes)
    if self._fine:
        top = _fine_hit(self, nodes, cap // self._hash_size, peek[self._fine[0]], alone)
    for g, spec in enumerate(self.groups):
        if spec.sparse or g in self._fine:
            continue
        run = 0
        for found in self._index.finds(g, nodes):
            if not found:
                break
            run += 1
        if alone is not None:
            alone[g] = run
        top = min(top, max(run - 1, 0) if peek[g] else min(run, cap // self._hash_size))
    if alone is not None:
        for g in self._sparse:
            alone[g] = partial.mamba_hit(self, nodes, len(nodes))
    return nodes[:partial.mamba_hit(self, nodes, top)]


def _fine_hit(self: HybridKVCacheManager, nodes: Sequence[Prefix], cap: int, peek: bool,
              alone: list[int] | None) -> int:
    """The hit, in hash blocks, of the full-attention groups larger than the hash block
    (``_fine``, one spec: vLLM looks them up together) over ``nodes`` (the walk, within
    ``cap`` hash blocks plus one): their run of whole blocks, then the longest hash
    boundary inside the next block whose partial entry every one holds
    (``partial_full.extend``, which keeps what it found for ``rows``), within ``cap``
    unless they ``peek``; peeking, less one hash block (vLLM's drop of one hash unit:
    a hit inside a whole block is then copied on write, ``partial.cows``).

        full (4h)  | block 0 whole  | block 1 whole  | h | h | P |     (P: an entry)
        peek       |                 run 8, extend to 11, hit 10 ^
        no entry   | block 0 whole  | block 1 whole  |              -> hit 7, inside block 1
    """
    limit = len(nodes) if peek else min(cap, len(nodes))
    top = partial_full.extend(self, nodes, partial_full.whole_run(self, nodes, limit), limit)
    if alone is not None:
        for g in self._fine:
            alone[g] = top
    return max(top - 1, 0) if peek else top

"""Which requests of a batch share their first blocks: the groups cascade attention reads
a shared prefix once for.

Two requests hold the same physical block at position j only if their whole prefix up
to j is the same content (a block is shared by a prefix hit or a fork, never by chance),
so sharing is a common prefix of the block-id lists::

    request a | 7 | 3 | 9 | 12 |
    request b | 7 | 3 | 9 | 40 | 41 |      -> SharedPrefix(num_blocks=3, members=(0, 1))
    request c | 5 | ...                    -> in no group

One level: the requests whose first block is the same form a group, and its prefix is
the part all of them share (a sub-group sharing more is not split off).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from ..results import SharedPrefix

__all__ = ["shared_prefixes"]


def shared_prefixes(tables: Sequence[Sequence[Hashable]]) -> list[SharedPrefix]:
    """Groups of the rows of ``tables`` (each a request's blocks in token order: block ids,
    or the manager's Block objects, equal only to themselves) that start with the same
    block: the positions of at least two rows, and how many leading blocks all of them
    hold. Ordered by each group's first row; rows that share no first block are left out.
    Costs one dict entry per row and one comparison per shared block."""
    by_first: dict[Hashable, list[int]] = {}
    for i, ids in enumerate(tables):
        if ids:
            by_first.setdefault(ids[0], []).append(i)
    groups = []
    for members in by_first.values():
        if len(members) < 2:
            continue
        lead = tables[members[0]]
        n = min(len(tables[i]) for i in members)
        for i in members[1:]:
            ids = tables[i]
            k = 1
            while k < n and ids[k] == lead[k]:
                k += 1
            n = k
        groups.append(SharedPrefix(n, tuple(members)))
    return groups

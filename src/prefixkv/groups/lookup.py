"""Finding a prompt's hit in the groups: the prefix ids of its full blocks, walked in the
``PrefixTable``, cut by the hit rule over the groups (``longest_hit``), and, per group,
the blocks of that hit its window still reads. Pure reads: no call here changes the
manager (its lookups and admission, groups/admission.py, call them)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..core.block import Block
from ..core.request import RequestKeys
from ..errors import RequestError
from .hits import longest_hit
from .prefixes import Prefix, PrefixTable
from .spec import GroupSpec

Find = Callable[[int, Prefix], Block | None]
"""``GroupIndex.find``: the block of group g holding a prefix, if any."""


def peeking(specs: Sequence[GroupSpec], peek: bool | Sequence[bool]) -> tuple[bool, ...]:
    """``peek`` as one bool per group (True: every group but a sparse one). Raises
    RequestError for anything else: not a bool nor a sequence of one bool per group,
    or True for a sparse group."""
    if peek is True or peek is False:
        return tuple(peek and not s.sparse for s in specs)
    try:
        out = tuple(peek)
    except TypeError:
        out = ()
    if len(out) != len(specs) or any(type(p) is not bool for p in out) or any(
            p and s.sparse for p, s in zip(out, specs, strict=True)):
        raise RequestError(f"peek must be a bool or one bool per group ({len(specs)}; "
                           f"False for a sparse group), got {peek!r}")
    return out


def hit_nodes(specs: Sequence[GroupSpec], table: PrefixTable, find: Find, block_size: int,
              chunks: Sequence[bytes], keys: RequestKeys, num_tokens: int, limit: int,
              peek: Sequence[bool], alone: list[int] | None, uncached: bool = False) -> list[Prefix]:
    """The prefix ids of the hit of a prompt of ``num_tokens`` tokens (``chunks``: its
    full blocks' token bytes; ``keys``: its extra keys), at most ``limit`` blocks; in the
    groups ``peek`` names, the block after it is looked at too. ``alone[g]`` is set to the
    blocks group ``g`` alone would serve (without peeking), when given. ``uncached``: some
    group is an uncached window, which serves any hit (``GroupSpec.cached``)."""
    bs = block_size
    peeks = any(peek)
    walked = min(num_tokens // bs, limit + 1) if peeks else limit  # (peek: block ``limit`` too)
    nodes = table.walk(chunks, keys.of_blocks(0, walked), walked)
    top = min(limit, len(nodes) - 1) if peeks else len(nodes)
    if top <= 0:
        return []
    if not uncached:
        k = longest_hit(specs, bs, top, lambda g, j: find(g, nodes[j]) is not None, peek)
    else:  # (the other groups' rule alone)
        live = [g for g, s in enumerate(specs) if s.cached]
        k = longest_hit([specs[g] for g in live], bs, top,
                        lambda i, j: find(live[i], nodes[j]) is not None,
                        [p for g, p in enumerate(peek) if specs[g].cached])
    if alone is not None:
        for g, spec in enumerate(specs):
            def held(_: int, j: int, g: int = g) -> bool:
                return find(g, nodes[j]) is not None
            alone[g] = longest_hit((spec,), bs, len(nodes), held) if spec.cached else len(nodes)
    return nodes[:k]


def window_hits(specs: Sequence[GroupSpec], find: Find, block_size: int, nodes: list[Prefix],
                first: int | None = None, uncached: bool = False) -> tuple[list[int], list[list[Block]]]:
    """Per group, how many leading blocks a request admitted on the hit ``nodes``
    holds none of when its first query sits at ``first`` (default: the hit's end;
    ``GroupSpec.admitted_cut``), and the blocks of the hit past them, in token order
    (none in an uncached group, when ``uncached`` says there is one: it takes fresh
    blocks there)."""
    k, bs = len(nodes), block_size
    at = k * bs if first is None else first
    cuts = [s.admitted_cut(k * bs, at, bs) for s in specs]
    if uncached:
        return cuts, [[find(g, nodes[j]) for j in range(cuts[g], k)] if s.cached  # type: ignore[misc]
                      else [] for g, s in enumerate(specs)]
    return cuts, [[find(g, nodes[j]) for j in range(cuts[g], k)]  # type: ignore[misc]
                  for g in range(len(specs))]

"""vLLM's ``KVCacheCoordinator.find_longest_cache_hit_per_group(block_hashes,
max_cache_hit_length)``: each group's own longest hit, as if it were alone, answered
from prefixkv's index (``CoordinatorView``).

vLLM runs each group's ``find_longest_cache_hit`` on the request's block hashes under
the cap. With its fine-grained partial hits (the hits' unit is the hash block ``h``):

    full attention (b):  | whole block | whole block | h h h . |   phase 1: the run of whole
                                                      ^ phase 2: the longest boundary inside
                                                        the next block holding a partial entry
    Mamba (b):           | null        | null        | h h ^ . |   the longest boundary (whole
                                                                  block end or partial entry)

each within ``max_cache_hit_length`` and the hashes given; groups of one spec are looked
up together (vLLM's attention groups: a prefix is found where each of them holds it).
prefixkv asks the same questions of the same prefixes: the hashes name a prefix of a
request its block hasher noted (block_hashes.py), whose probe answers, per hash
boundary, the block of each group holding that prefix now
(``HybridKVCacheManager.prefix_probe``: a whole block, a full-attention partial entry
or a Mamba state), as vLLM's ``get_cached_block`` does.

Served beside vLLM's fine-grained partial hits on full-attention and Mamba groups
(every Mamba block larger than the hash block), without EAGLE (its lookup margin and
dropped block); refused by name elsewhere (UnsupportedByPrefixKV), and for hashes that
are not the first hashes of one noted live request (as ``get_cached_block``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from prefixkv.errors import RequestError, check_count
from prefixkv.groups.spec import FULL, MAMBA

from .layout import Layout, UnsupportedByPrefixKV

if TYPE_CHECKING:
    from .manager import KVCacheManager

__all__ = ["PerGroupHits"]


class PerGroupHits:
    """``find_longest_cache_hit_per_group`` for one manager of ``layout`` (module
    docstring); ``unserved``: why it is refused there, or None."""

    def __init__(self, manager: KVCacheManager, layout: Layout) -> None:
        self._manager = manager
        s = layout.sizes
        self._h, self._sizes = s.hash_size, s.sizes
        self._mamba = tuple(g.kind == MAMBA for g in layout.groups)
        sets: dict[Any, list[int]] = {}
        for g, spec in enumerate(layout.specs):
            sets.setdefault(spec, []).append(g)
        self._sets = tuple(tuple(ids) for ids in sets.values())
        self.unserved: str | None = None
        if not s.partial or manager.use_eagle or any(manager.eagle_groups) or any(
                g.kind not in (FULL, MAMBA) or g.kind == MAMBA and b <= s.hash_size
                for g, b in zip(layout.groups, s.sizes, strict=True)):
            self.unserved = ("find_longest_cache_hit_per_group is served beside vLLM's fine-grained partial "
                             "hits on full-attention and Mamba groups (Mamba blocks larger than the hash "
                             "block), without EAGLE, only")

    def find(self, block_hashes: Sequence[bytes],
             max_cache_hit_length: int) -> tuple[tuple[list[Any], ...], tuple[int, ...]]:
        """(per group, the blocks of its own longest hit; per group, its tokens), vLLM's
        shapes. Raises UnsupportedByPrefixKV (module docstring), RequestError for a cap
        that is not an int >= 0 or hashes that are not a sequence of bytes; changes
        nothing."""
        if self.unserved is not None:
            raise UnsupportedByPrefixKV(self.unserved)
        check_count("max_cache_hit_length", max_cache_hit_length, 0, None)
        if isinstance(block_hashes, (bytes, str)) or not all(isinstance(x, bytes) for x in block_hashes):
            raise RequestError(f"block_hashes are a sequence of vLLM's BlockHash (bytes), "
                               f"got {block_hashes!r}")
        n = len(self._sizes)
        blocks: list[list[Any]] = [[] for _ in range(n)]
        hits = [0] * n
        k = min(len(block_hashes), max_cache_hit_length // self._h)  # (hash boundaries within the cap)
        if not k:
            return tuple(blocks), tuple(hits)
        held = self._held(block_hashes, k)
        null = self._manager.block_pool.null_block
        for ids in self._sets:  # (groups of one spec: found together, as vLLM's attention groups)
            s = self._sizes[ids[0]] // self._h

            def found(i: int, ids: tuple[int, ...] = ids) -> list[Any] | None:
                row = held(i)
                return None if any(row[g] is None for g in ids) else [row[g] for g in ids]
            got: list[list[Any]] = [[] for _ in ids]
            hit = 0
            if self._mamba[ids[0]]:  # (the longest boundary holding a state)
                i = next((i for i in range(k - 1, -1, -1) if found(i) is not None), None)
                if i is not None:
                    got = [[null] * (i // s) + [x] for x in found(i)]  # type: ignore[union-attr]
                    hit = (i + 1) * self._h
            else:
                for j in range(k // s):  # (phase 1: whole blocks)
                    xs = found((j + 1) * s - 1)
                    if xs is None:
                        break
                    for row, x in zip(got, xs, strict=True):
                        row.append(x)
                first = len(got[0]) * s
                hit = first * self._h
                for i in range(min(first + s - 1, k) - 1, first - 1, -1):  # (phase 2: a partial entry)
                    xs = found(i)
                    if xs is not None:
                        for row, x in zip(got, xs, strict=True):
                            row.append(x)
                        hit = (i + 1) * self._h
                        break
            for g, row in zip(ids, got, strict=True):
                blocks[g], hits[g] = row, hit
        return tuple(blocks), tuple(hits)

    def _held(self, block_hashes: Sequence[bytes], k: int) -> Any:
        """``held(i)``: per group, vLLM's block holding the prefix the hash ``i`` names
        (None where none), over the probe of the noted request whose first ``k`` hashes
        are ``block_hashes[:k]``."""
        lookups = self._manager.block_pool._hashes
        found = lookups.prefixes.prefix(block_hashes[k - 1])
        if found is None or list(found[0].block_hashes[:k]) != list(block_hashes[:k]):
            raise UnsupportedByPrefixKV(
                "find_longest_cache_hit_per_group: prefixkv finds blocks by content, and no live request "
                "its block hasher noted holds these block hashes as its first ones")
        probe = lookups.probe_for(found[0], k * self._h, block_hashes[k - 1])
        table, offset, got = lookups._table, lookups._offset, {}

        def held(i: int) -> tuple[Any, ...]:
            if i not in got:
                got[i] = tuple(None if x is None else table[x + offset] for x in probe.ids((i + 1) * self._h))
            return got[i]
        return held

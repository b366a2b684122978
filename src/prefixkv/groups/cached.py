"""Which block of each group holds a prefix now: a read of the hybrid manager's index by
content, for an engine that asks its pool about one prefix at a time (vLLM's
``BlockPool.get_cached_block``, called by connectors per block per step).
``HybridKVCacheManager``'s body lists ``cached_block_ids`` and ``prefix_probe``; they
change nothing.

A probe (``PrefixProbe``) keeps a prompt encoded and the prefix nodes its last walk
found. A node that is still the table's node of its prefix (``PrefixTable.holds``: one
dict probe; a node dropped, lost, or left out by a reset, whose table is cleared while
requests hold its nodes, is not) is the answer's node; otherwise the walk goes on from the
deepest node of the prompt that still is (one table probe a node newly found).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..core.prompt import Prompt, encode_prompt, unpack_prompt
from ..errors import RequestError, check_count, checked_ids
from ..extra_keys import ExtraKeys
from . import lookahead
from .prefixes import Prefix

if TYPE_CHECKING:
    from .manager import HybridKVCacheManager


def cached_block_ids(self: HybridKVCacheManager, prompt_token_ids: Sequence[int] | Prompt, num_tokens: int,
                     *, extra: ExtraKeys | None = None) -> tuple[int | None, ...]:
    """Per group, the block holding the prefix of the prompt's first ``num_tokens``
    tokens (a multiple of the hash block size, from one hash block to all the prompt's
    full ones, its last included): the group's block whose content ends there (its
    primary: the first made of those holding it), or, where ``num_tokens`` falls inside
    a block of the group, the block holding a partial tail entry there (tails.py: kept
    only while events are on; with partial hits, a Mamba group's partial entry:
    groups/partial.py, or full attention's: groups/fine.py);
    None where the group holds neither now (a window's
    block never recorded, evicted, or past what ``BlockSizes.caches`` keeps). Changes
    nothing. Takes a ``Prompt``. Raises RequestError for a bad ``num_tokens``, and as
    ``add_request`` for bad input. (One prompt asked again and again: ``prefix_probe``.)"""
    return prefix_probe(self, prompt_token_ids, extra=extra).ids(num_tokens)


def prefix_probe(self: HybridKVCacheManager, prompt_token_ids: Sequence[int] | Prompt, *,
                 extra: ExtraKeys | None = None) -> PrefixProbe:
    """The prompt encoded once, to ask ``cached_block_ids`` of its prefixes again and
    again (``PrefixProbe.ids``). Changes nothing; holds no reference. Takes a
    ``Prompt``. Raises as ``add_request`` for bad input."""
    h = self._hash_size
    chunks: Sequence[bytes]
    if isinstance(prompt_token_ids, Prompt):
        p = unpack_prompt(prompt_token_ids, extra, self._config)
        n, keys, chunks = len(p.tokens), p.keys, p.chunks
        if self._lookahead:
            lookahead.check_prompt(self, keys)
    else:
        tokens, keys, chunks = encode_prompt(prompt_token_ids, extra, h, self.vocab_size)
        n = len(tokens)
        if self._lookahead:
            keys = lookahead.prompt_keys(self, tokens, keys)
    return PrefixProbe(self, chunks, keys.of_blocks(0, n // h))


class PrefixProbe:
    """Per prefix of one encoded prompt (``chunks``: its hash blocks' token bytes;
    ``extras``: each full one's extra bytes), the block of each group holding it now
    (``ids``). Holds the nodes found last (no reference: nothing is kept)."""

    __slots__ = ("_m", "_chunks", "_extras", "_nodes")

    def __init__(self, m: HybridKVCacheManager, chunks: Sequence[bytes], extras: Sequence[bytes]) -> None:
        self._m, self._chunks, self._extras = m, chunks, extras
        self._nodes: list[Prefix] = []

    def ids(self, num_tokens: int) -> tuple[int | None, ...]:
        """``cached_block_ids`` of the prompt's first ``num_tokens`` tokens. Raises
        RequestError for a bad ``num_tokens``."""
        m = self._m
        node = self._node(num_tokens)
        if node is None:
            return (None,) * len(m.groups)
        out: list[int | None] = []
        for g in range(len(m.groups)):
            holders = self._holders(node, num_tokens, g)
            out.append(holders[0] if holders else None)
        return tuple(out)

    def copies(self, num_tokens: int, g: int) -> tuple[int, ...]:
        """Every block of group ``g`` holding the prompt's first ``num_tokens`` tokens:
        the one ``ids`` gives, then its held spares, the oldest first (a group past the
        groups: none). Raises as ``ids``."""
        node = self._node(num_tokens)
        return () if node is None or g >= len(self._m.groups) else self._holders(node, num_tokens, g)

    def _holders(self, node: Prefix, num_tokens: int, g: int) -> tuple[int, ...]:
        m = self._m
        index = m._index
        # (a Mamba group's partial entry is found by its prefix: partial.py)
        if not num_tokens % m._group_sizes[g] or (m.sizes.partial and m.groups[g].sparse):
            block = index.find(g, node)
            if block is None:
                return ()
            return (block.block_id, *(s.block_id for s in index.twins[g].get(node.pid, ())))
        if g in m._fine:  # (full attention's partial entries, in vLLM's order: fine.py)
            return tuple(b.block_id for b in index.fine.holders.get((g, node.pid), ()))
        return tuple(i for i, tail in index.tails.items()
                     if tail.group_idx == g and node.hash is not None and tail.block_hashes[0] == node.hash)

    def _node(self, num_tokens: int) -> Prefix | None:
        h = self._m._hash_size
        check_count("num_tokens", num_tokens, h, len(self._extras) * h)
        if num_tokens % h:
            raise RequestError(f"num_tokens must be a multiple of the hash block size {h}, got {num_tokens}")
        k = num_tokens // h
        nodes = self._nodes
        return nodes[k - 1] if k <= len(nodes) and self._m._table.holds(nodes[k - 1]) else self._walk(k)

    def _walk(self, k: int) -> Prefix | None:
        nodes = self._nodes
        i = min(k - 1, len(nodes))  # the deepest node of the prompt still in the table
        held = self._m._table.holds
        while i and not held(nodes[i - 1]):
            i -= 1
        del nodes[i:]
        chunks, extras, child = self._chunks, self._extras, self._m._table.child
        node = nodes[-1] if nodes else None
        while i < k:
            node = child(node, chunks[i], extras[i])
            if node is None:
                return None
            nodes.append(node)
            i += 1
        return node


def held_content(self: HybridKVCacheManager, block_id: int) -> tuple[int, int] | None:
    """What block ``block_id`` holds findable: (its group, its prefix's id), an id naming
    one prefix for the process's life (never reused), None when it holds none (empty,
    partial, evicted or uncached; a partial tail entry alone is not listed). Changes
    nothing. Raises RequestError for an id that is not one of this pool's."""
    index = self._index
    node = index.nodes[check_count("block id", block_id, 0, self.num_blocks - 1)]
    return None if node is None else (index.owner[block_id], node.pid)


def held_contents(self: HybridKVCacheManager, block_ids: Sequence[int]) -> list[int]:
    """``held_content``'s prefix id of each block of ``block_ids`` (0 where it holds
    none), in one pass. Changes nothing. Raises RequestError for an id that is not one
    of this pool's."""
    nodes = self._index.nodes
    return [0 if (node := nodes[i]) is None else node.pid for i in checked_ids(block_ids, self.num_blocks)]


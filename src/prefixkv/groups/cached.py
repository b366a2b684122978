"""Which block of each group holds a prefix now: a read of the hybrid manager's index by
content, for an engine that asks its pool about one prefix at a time (vLLM's
``BlockPool.get_cached_block``). ``HybridKVCacheManager``'s body lists it; it changes
nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..core.prompt import Prompt, encode_prompt, unpack_prompt
from ..errors import RequestError, check_count
from ..extra_keys import ExtraKeys

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
    groups/partial.py); None where the group holds neither now (a window's
    block never recorded, evicted, or past what ``BlockSizes.caches`` keeps). Changes
    nothing. Takes a ``Prompt``. Raises RequestError for a bad ``num_tokens``, and as
    ``add_request`` for bad input."""
    h = self._hash_size
    chunks: Sequence[bytes]
    if isinstance(prompt_token_ids, Prompt):
        p = unpack_prompt(prompt_token_ids, extra, self._config)
        n, keys, chunks = len(p.tokens), p.keys, p.chunks
    else:
        tokens, keys, chunks = encode_prompt(prompt_token_ids, extra, h, self.vocab_size)
        n = len(tokens)
    check_count("num_tokens", num_tokens, h, n // h * h)
    if num_tokens % h:
        raise RequestError(f"num_tokens must be a multiple of the hash block size {h}, got {num_tokens}")
    k = num_tokens // h
    nodes = self._table.walk(chunks, keys.of_blocks(0, k), k)
    if len(nodes) < k:
        return (None,) * len(self.groups)
    node, index = nodes[-1], self._index
    out: list[int | None] = []
    partial = self.sizes.partial  # (a Mamba group's partial entry is found by its prefix: partial.py)
    for g, b in enumerate(self._group_sizes):
        if not num_tokens % b or (partial and self.groups[g].sparse):
            block = index.find(g, node)
            out.append(None if block is None else block.block_id)
            continue
        out.append(next((i for i, tail in index.tails.items()
                         if tail.group_idx == g and node.hash is not None
                         and tail.block_hashes[0] == node.hash), None))
    return tuple(out)

"""A reference of vLLM 0.33's lookahead hashing (``num_hash_lookahead_tokens`` = L) and
multi-module MTP's re-prefillable tokens (``num_prefill_lookahead`` = P) on one
full-attention group, written from vLLM's rules as plain Python (docs/lookahead.md).

- A block's key: the tokens of the whole prefix up to its end *and the L tokens after
  it*, ``tuple(tokens[:(i + 1) * b + L])`` (vLLM's hash of block i chains over the block's
  tokens with ``(extra keys, *tokens[end:end + L])`` as its extra keys). The key exists
  once the request holds ``(i + 1) * b + L`` tokens (known, computed or not); before, the
  block has no hash.
- Caching (``allocate``: vLLM's ``cache_blocks`` at the end of ``allocate_slots``): the
  whole blocks below ``min(computed - (P - 1), tokens known - L)``, where ``computed`` is
  the tokens computed once the scheduled step has run (``num_computed_tokens +
  num_new_tokens``); a block cached stays cached (nothing is evicted here: the pool is
  taken large enough).
- Hit (``hit``): the most whole blocks ``k`` with ``k * b <= len(tokens) - 1`` whose keys
  all exist for the request and are cached: so a hit of ``k`` blocks needs the request's
  first ``k * b + L`` tokens to equal the ones a cached run was keyed with.

``KVModel`` is the trust side: what the KV of a position depends on (target: the tokens
up to it; drafter: also the L after it), written when a step computes it (the drafter's
KV of the last ``P - 1`` computed positions is provisional: MTP prefills it again); a hit
must serve only KV whose dependencies are the reader's own tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

Key = tuple[int, ...]


@dataclass
class LookaheadModel:
    """The cached keys of one full-attention group of block size ``block_size``."""

    block_size: int
    hash_lookahead: int = 0  # L: vLLM's num_hash_lookahead_tokens
    prefill_lookahead: int = 0  # P: vLLM's num_prefill_lookahead (P - 1 cached late)
    cached: set[Key] = field(default_factory=set)

    def key(self, tokens: Sequence[int], i: int) -> Key | None:
        """Block ``i``'s key for a request of ``tokens`` (known so far), None while the
        tokens it covers are not all known (vLLM: no hash yet)."""
        end = (i + 1) * self.block_size + self.hash_lookahead
        return tuple(tokens[:end]) if end <= len(tokens) else None

    def num_hashes(self, tokens: Sequence[int]) -> int:
        """How many block hashes a request of ``tokens`` has (vLLM's ``block_hashes``)."""
        return max(0, len(tokens) - self.hash_lookahead) // self.block_size

    def cacheable_blocks(self, num_tokens: int, computed: int) -> int:
        """The whole blocks a request of ``num_tokens`` known tokens, ``computed`` of them
        computed, has cached."""
        finalized = max(0, computed - max(0, self.prefill_lookahead - 1))
        return min(finalized, max(0, num_tokens - self.hash_lookahead)) // self.block_size

    def allocate(self, tokens: Sequence[int], computed: int) -> list[tuple[int, Key]]:
        """Cache what a request of ``tokens`` with ``computed`` tokens computed holds;
        the blocks it caches, (index, key), those already cached included."""
        new = []
        for i in range(self.cacheable_blocks(len(tokens), computed)):
            k = self.key(tokens, i)
            assert k is not None
            self.cached.add(k)
            new.append((i, k))
        return new

    def hit(self, tokens: Sequence[int]) -> int:
        """The tokens a request of ``tokens`` finds cached (a multiple of the block size)."""
        b, k = self.block_size, 0
        while (k + 1) * b <= len(tokens) - 1:
            key = self.key(tokens, k)
            if key is None or key not in self.cached:
                break
            k += 1
        return k * b


@dataclass
class KVModel:
    """What the KV held for each cached key was computed from: per key, the tokens the
    drafter's KV at the block's positions read (None: provisional, to be prefilled again)."""

    block_size: int
    reads_ahead: int  # the tokens after a position the drafter's KV there depends on
    prefill_lookahead: int = 0
    written: dict[Key, tuple[int, ...] | None] = field(default_factory=dict)

    def write(self, key: Key, tokens: Sequence[int], i: int, computed: int) -> None:
        """Block ``i`` of a request of ``tokens``, ``computed`` of them computed, becomes
        the KV held under ``key`` (the first holder's KV is the one served)."""
        end = (i + 1) * self.block_size
        provisional = end > computed - max(0, self.prefill_lookahead - 1)
        self.written.setdefault(key, None if provisional else tuple(tokens[:end + self.reads_ahead]))

    def served_rightly(self, key: Key, tokens: Sequence[int], i: int) -> bool:
        """Whether the KV under ``key`` is the KV block ``i`` of ``tokens`` would compute."""
        got = self.written[key]
        end = (i + 1) * self.block_size + self.reads_ahead
        return got is not None and end <= len(tokens) and got == tuple(tokens[:end])

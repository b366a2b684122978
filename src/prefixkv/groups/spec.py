"""What a group of attention layers reads: its spec, and the policy that follows from it.

A query at position ``p`` of a group reads the keys ``first_needed(p) .. p``:

    full attention        first_needed(p) = 0
    sliding window of W   first_needed(p) = max(0, p - W + 1)     (W keys, p included)
    chunked local of C    first_needed(p) = (p // C) * C          (p's chunk so far)

``first_needed`` never decreases as ``p`` grows, so once a request's next query sits at
``s``, the keys below ``first_needed(s)`` are read by no future query of it. Two policies
follow, both in whole blocks of ``block_size`` positions (block j holds positions
``j*bs .. (j+1)*bs - 1``):

- release: ``num_unread(s, bs)`` leading blocks of a request whose next query is at ``s``
  are read by no query any more and may go back to the pool;
- hits: a prefix of ``k`` blocks can be served iff every block in
  ``num_unread(k*bs, bs) .. k-1`` is cached in the group (``prefixkv.groups.hits``).

The sliding window is the kernels' ``window_size=(W - 1, 0)`` (``window_size``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from ..core.block import blocks_for
from ..errors import ConfigError

FULL = "full_attention"
"""The kind of a full-attention group."""
SLIDING = "sliding_window"
"""The kind of a sliding-window group."""
CHUNKED = "chunked_local_attention"
"""The kind of a chunked local attention group."""
KINDS = (FULL, SLIDING, CHUNKED)


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One attention group. ``kind``: one of ``KINDS``; ``tokens``: the window W
    (sliding) or the chunk C (chunked local), 0 for full attention.
    Raises ConfigError for an unknown kind or a size that does not fit the kind."""

    kind: str
    tokens: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"group kind must be one of {KINDS}, got {self.kind!r}")
        ok = type(self.tokens) is int and (self.tokens == 0 if self.kind == FULL else self.tokens > 0)
        if not ok:
            want = "0" if self.kind == FULL else "a positive int"
            raise ConfigError(f"a {self.kind} group takes tokens={want}, got {self.tokens!r}")

    @property
    def releases(self) -> bool:
        """Whether blocks of this group leave every future query's reach."""
        return self.kind != FULL

    def first_needed(self, pos: int) -> int:
        """The lowest key position that a query at ``pos`` or later reads."""
        if self.kind == SLIDING:
            return max(0, pos - self.tokens + 1)
        if self.kind == CHUNKED:
            return pos - pos % self.tokens
        return 0

    def num_unread(self, pos: int, block_size: int) -> int:
        """Leading blocks that no query at ``pos`` or later reads."""
        return self.first_needed(pos) // block_size

    def release_at(self, cut: int, block_size: int) -> int:
        """The first position from which no query reads block ``cut`` (the smallest ``p``
        with ``num_unread(p, block_size) > cut``); ``sys.maxsize`` for full attention."""
        edge = (cut + 1) * block_size  # first_needed(p) must reach it
        if self.kind == SLIDING:
            return edge + self.tokens - 1
        if self.kind == CHUNKED:
            return blocks_for(edge, self.tokens) * self.tokens  # (rounded up to a whole chunk)
        return sys.maxsize

    @property
    def window_size(self) -> tuple[int, int] | None:
        """The kernels' ``window_size`` for this group: None (full attention) or
        ``(W - 1, 0)``. Raises ConfigError for chunked local attention, which a
        ``(left, right)`` window cannot express."""
        if self.kind == CHUNKED:
            raise ConfigError("chunked local attention has no (left, right) window_size")
        return (self.tokens - 1, 0) if self.kind == SLIDING else None


def full_attention() -> GroupSpec:
    """A group of full-attention layers."""
    return GroupSpec(FULL)


def sliding_window(window: int) -> GroupSpec:
    """A group of sliding-window layers: a query sees ``window`` keys, itself included
    (Mistral's and vLLM's ``sliding_window``). Raises ConfigError unless window > 0."""
    return GroupSpec(SLIDING, window)


def chunked_local(chunk: int) -> GroupSpec:
    """A group of chunked local attention layers (Llama 4): a query sees the keys of its
    own ``chunk``-token chunk up to itself. Raises ConfigError unless chunk > 0."""
    return GroupSpec(CHUNKED, chunk)

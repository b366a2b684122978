"""What a group of attention layers reads: its spec, and the policy that follows from it.

A query at position ``p`` of a group reads the keys ``first_needed(p) .. p``:

    full attention        first_needed(p) = 0
    sliding window of W   first_needed(p) = max(0, p - W + 1)     (W keys, p included)
    chunked local of C    first_needed(p) = (p // C) * C          (p's chunk so far)
    Mamba (state space)   first_needed(p) = max(0, p - 1)         (the state after p - 1)

``first_needed`` never decreases as ``p`` grows, so once a request's next query sits at
``s``, the keys below ``first_needed(s)`` are read by no future query of it. Two policies
follow, both in whole blocks of ``block_size`` positions (block j holds positions
``j*bs .. (j+1)*bs - 1``):

- release: ``num_released(s, bs)`` leading blocks of a request whose next query is at
  ``s`` go back to the pool: the ``num_unread(s, bs)`` blocks no query reads any more,
  but those of the ``retained`` tokens below a sliding window (vLLM's
  ``extra_retained_tokens``: a drafter of multi-module speculative decoding re-prefills
  the last tokens and reads that many below the window; vLLM's
  ``get_num_skipped_tokens``). ``release_at`` is the release's step, ``unread_from`` the
  queries';
- hits: a prefix of ``k`` blocks can be served iff every block in
  ``num_unread(k*bs, bs) .. k-1`` is cached in the group (``prefixkv.groups.hits``): the
  window alone, as vLLM's hit (``_contiguous_blocks_for_hit``); a request admitted on
  that hit holds none of the blocks below (``admitted_cut``: vLLM's null entries).

The sliding window is the kernels' ``window_size=(W - 1, 0)`` (``window_size``).

A Mamba group holds recurrent states, not keys: block j holds the state after position
``(j+1)*bs - 1`` (once its positions are all computed), and a step that computes up to
``e`` writes only the block of its last position, ``blocks_for(e) - 1``. Its table is
``sparse``: the entries a step jumps over stay empty (vLLM's null block, vLLM's
``mamba_cache_mode="align"``), and it reads the state of the block before the step,
which the next step releases. For hits and release it is the window of 2 above: a
prefix of ``k`` blocks is served by block ``k-1`` alone.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

from ..core.block import blocks_for
from ..errors import ConfigError

FULL = "full_attention"
"""The kind of a full-attention group."""
SLIDING = "sliding_window"
"""The kind of a sliding-window group."""
CHUNKED = "chunked_local_attention"
"""The kind of a chunked local attention group."""
MAMBA = "mamba"
"""The kind of a Mamba (state-space) group: block-aligned state checkpoints."""
KINDS = (FULL, SLIDING, CHUNKED, MAMBA)


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One attention group. ``kind``: one of ``KINDS``; ``tokens``: the window W
    (sliding) or the chunk C (chunked local), 0 for full attention and Mamba;
    ``retained``: tokens below a sliding window whose blocks a request keeps although
    no query reads them (vLLM's ``extra_retained_tokens``), 0 for the other kinds;
    ``cached``: False for a sliding window whose blocks are never cached nor looked up
    (vLLM's ``prefix_cacheable`` False: SWA bounded replay, whose engine recomputes the
    window below a hit): hits are the other groups' alone, and a request admitted on
    one takes fresh blocks for the window's part of it (docs/design.md, "Layer
    groups"). ``retention``: None (every block a hit can read is cached), or a sliding
    window's sparse caching (vLLM's ``prefix_cache_retention_interval``): the blocks a
    hit reads at each multiple of ``retention`` tokens (none for 0) and at a request's
    marks (``BlockSizes.caches``; served with groups of different block sizes); a Mamba
    group's: the states at each multiple of ``retention`` tokens (none for 0) and at a
    request's marks (vLLM's ``MambaManager.reachable_block_mask``). ``ahead``: blocks
    a request of a sliding window holds past the end of the positions its table
    covers, taken at admission and kept that many ahead as the table grows (vLLM's
    ``num_speculative_blocks`` of a Mamba group in ``mamba_cache_mode="none"``, served
    as a 2-token window: the scratch states a speculative step writes; groups/spec_blocks.py),
    or of a Mamba group past its state block (vLLM's ``num_speculative_blocks`` in
    ``mamba_cache_mode="align"``: groups/spec_states.py).
    Raises ConfigError for an unknown kind, a size that does not fit the kind, a
    ``retained`` that is not an int >= 0 (0 unless sliding), a ``cached`` that is not
    a bool (True unless sliding), or a ``retention`` that is not None nor an int >= 0
    (None unless a cached sliding window or Mamba), or an ``ahead`` that is not an
    int >= 0 (0 unless sliding or Mamba)."""

    kind: str
    tokens: int = 0
    retained: int = 0
    cached: bool = True
    retention: int | None = None
    ahead: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"group kind must be one of {KINDS}, got {self.kind!r}")
        sizeless = self.kind in (FULL, MAMBA)
        ok = type(self.tokens) is int and (self.tokens == 0 if sizeless else self.tokens > 0)
        if not ok:
            want = "0" if sizeless else "a positive int"
            raise ConfigError(f"a {self.kind} group takes tokens={want}, got {self.tokens!r}")
        if type(self.retained) is not int or self.retained < 0 or (self.retained and self.kind != SLIDING):
            want = "an int >= 0" if self.kind == SLIDING else "0 (sliding windows only retain)"
            raise ConfigError(f"a {self.kind} group takes retained={want}, got {self.retained!r}")
        if self.cached is not True and (self.cached is not False or self.kind != SLIDING):
            want = "a bool" if self.kind == SLIDING else "True (only sliding windows go uncached)"
            raise ConfigError(f"a {self.kind} group takes cached={want}, got {self.cached!r}")
        r = self.retention
        keeps = self.kind == MAMBA or self.kind == SLIDING and self.cached  # (those vLLM's retention reaches)
        if r is not None and (type(r) is not int or r < 0 or not keeps):
            want = "None or an int >= 0" if keeps else "None"
            raise ConfigError(f"a {'cached ' * self.cached}{self.kind} group takes retention={want}, "
                              f"got {r!r}"[:200])
        holds = self.kind in (SLIDING, MAMBA)  # (those vLLM's num_speculative_blocks reaches)
        if type(self.ahead) is not int or self.ahead < 0 or (self.ahead and not holds):
            want = "an int >= 0" if holds else "0 (sliding windows and Mamba only hold blocks ahead)"
            raise ConfigError(f"a {self.kind} group takes ahead={want}, got {self.ahead!r}"[:200])

    @property
    def releases(self) -> bool:
        """Whether blocks of this group leave every future query's reach."""
        return self.kind != FULL

    @property
    def sparse(self) -> bool:
        """Whether a step takes a block only for its last position (Mamba): the entries
        before it, up to the table's old end, stay empty (module docstring)."""
        return self.kind == MAMBA

    def first_needed(self, pos: int) -> int:
        """The lowest key position that a query at ``pos`` or later reads."""
        if self.kind == SLIDING:
            return max(0, pos - self.tokens + 1)
        if self.kind == CHUNKED:
            return pos - pos % self.tokens
        if self.kind == MAMBA:
            return max(0, pos - 1)
        return 0

    def num_unread(self, pos: int, block_size: int) -> int:
        """Leading blocks that no query at ``pos`` or later reads."""
        return self.first_needed(pos) // block_size

    def unread_from(self, cut: int, block_size: int) -> int:
        """The first position from which no query reads block ``cut`` (the smallest ``p``
        with ``num_unread(p, block_size) > cut``); ``sys.maxsize`` for full attention."""
        return self.release_at(cut, block_size) - self.retained

    def num_released(self, pos: int, block_size: int) -> int:
        """Leading blocks a request releases once its next query sits at ``pos``: those
        no query at ``pos`` or later reads but the ``retained`` tokens' (vLLM's
        ``get_num_skipped_tokens(pos) // block_size``)."""
        if self.retained:
            return max(0, self.first_needed(pos) - self.retained) // block_size
        return self.first_needed(pos) // block_size

    def release_at(self, cut: int, block_size: int) -> int:
        """The first position from which a request releases block ``cut`` (the smallest
        ``p`` with ``num_released(p, block_size) > cut``: ``unread_from`` and the
        ``retained`` tokens); ``sys.maxsize`` for full attention."""
        edge = (cut + 1) * block_size  # first_needed(p) - retained must reach it
        if self.kind == SLIDING:
            return edge + self.tokens - 1 + self.retained
        if self.kind == MAMBA:
            return edge + 1
        if self.kind == CHUNKED:
            return blocks_for(edge, self.tokens) * self.tokens  # (rounded up to a whole chunk)
        return sys.maxsize

    def admitted_cut(self, hit: int, first: int, block_size: int) -> int:
        """Leading blocks a request admitted on a hit of ``hit`` tokens, whose first query
        sits at ``first >= hit``, holds none of: those its hit leaves out (no query at
        ``hit`` reads them: ``num_unread``) and those it releases at ``first``. Below the
        hit's blocks, a window's retained tokens are not asked cached (vLLM's null
        entries there)."""
        if not self.retained:  # (then num_released(first) >= num_unread(hit))
            return self.num_unread(first, block_size)
        return max(self.num_unread(hit, block_size), self.num_released(first, block_size))

    @property
    def window_size(self) -> tuple[int, int] | None:
        """The kernels' ``window_size`` for this group: None (full attention) or
        ``(W - 1, 0)``. Raises ConfigError for chunked local attention, which a
        ``(left, right)`` window cannot express, and for Mamba (no attention)."""
        if self.kind in (CHUNKED, MAMBA):
            raise ConfigError(f"a {self.kind} group has no (left, right) window_size")
        return (self.tokens - 1, 0) if self.kind == SLIDING else None


def full_attention() -> GroupSpec:
    """A group of full-attention layers."""
    return GroupSpec(FULL)


def sliding_window(window: int, retained: int = 0, *, cached: bool = True,
                   retention: int | None = None, ahead: int = 0) -> GroupSpec:
    """A group of sliding-window layers: a query sees ``window`` keys, itself included
    (Mistral's and vLLM's ``sliding_window``); a request keeps the blocks of
    ``retained`` more tokens below them (vLLM's ``extra_retained_tokens``: module
    docstring); ``cached=False``: its blocks are never cached nor looked up
    (``GroupSpec.cached``); ``retention``: its sparse caching; ``ahead``: blocks held
    past the table's end (``GroupSpec``). Raises ConfigError unless window > 0,
    retained >= 0, cached a bool, retention None or an int >= 0 (None when not cached)
    and ahead an int >= 0."""
    return GroupSpec(SLIDING, window, retained, cached, retention, ahead)


def chunked_local(chunk: int) -> GroupSpec:
    """A group of chunked local attention layers (Llama 4): a query sees the keys of its
    own ``chunk``-token chunk up to itself. Raises ConfigError unless chunk > 0."""
    return GroupSpec(CHUNKED, chunk)


def mamba(*, retention: int | None = None, ahead: int = 0) -> GroupSpec:
    """A group of Mamba (state-space) layers whose states are cached at block
    boundaries (vLLM's ``mamba_cache_mode="align"``): see the module docstring.
    ``retention``: its sparse caching (``GroupSpec``); ``ahead``: the speculative state
    blocks a request holds past its state's (vLLM's ``num_speculative_blocks`` there:
    groups/spec_states.py). Raises ConfigError unless retention is None or an int >= 0
    and ahead an int >= 0."""
    return GroupSpec(MAMBA, retention=retention, ahead=ahead)


def group_specs(groups: Sequence[GroupSpec]) -> tuple[GroupSpec, ...]:
    """``groups`` as a tuple, checked: a non-empty sequence of GroupSpecs. Raises
    ConfigError for anything else."""
    made = ("(made by full_attention(), sliding_window(window), chunked_local(chunk) or "
            "mamba(): HybridKVCacheManager(groups, num_blocks, block_size))")
    try:
        specs = tuple(groups)
    except TypeError:
        raise ConfigError(f"groups must be a sequence of GroupSpec {made}, got {groups!r}") from None
    if not specs or not all(isinstance(s, GroupSpec) for s in specs):
        raise ConfigError(f"groups must be a non-empty sequence of GroupSpec {made}, got {groups!r}")
    return specs

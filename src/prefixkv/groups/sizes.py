"""Layer groups of different block sizes (vLLM's hybrid layouts, docs/groups.md): how
their blocks are keyed, found and cached, as pure functions of the sizes.

Hashes are computed at ``hash_size`` (a divisor of every group's size; vLLM's
``hash_block_size``, by default their gcd): fine hash ``i`` chains over positions
``0 .. (i + 1) * hash_size - 1``. Group ``g``, of block size ``b = k * hash_size``, keys
its block ``j`` by the fine hash at the block's last boundary::

    positions   | block j of group g: j*b .. (j+1)*b - 1                      |
    fine hashes | (j*k) ... ((j+1)*k - 1)  <- the key of block j in group g   |

A hit, and what is cached, are whole multiples of ``align`` (vLLM's
``scheduler_block_size``, by default the lcm of the sizes), so every group holds a
whole number of blocks there. ``HybridKVCacheManager`` takes a ``BlockSizes`` as its
``block_size`` (``manager_sizes`` checks it) and serves sizes that are not
``one_size`` in ``SizedHybridKVCacheManager`` (groups/sized.py) by these rules, each
checked against vLLM's manager
(tests/engines/test_vllm_block_sizes_reference.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import reduce

from ..core.block import blocks_for
from ..errors import ConfigError, check_positive
from .eagle_retention import eagle_marks, peek_retains, window_marks
from .hits import longest_sized_hit
from .partial import check_partial
from .spec import FULL, MAMBA, SLIDING, GroupSpec


@dataclass(frozen=True, slots=True)
class BlockSizes:
    """The block size of each group, the hash block size and the alignment of hits and
    caching. Made by ``BlockSizes.of``, which checks them."""

    sizes: tuple[int, ...]
    hash_size: int
    align: int
    peek: tuple[bool, ...] = ()  # per group: it caches for peeking hits (vLLM's EAGLE); (): none
    partial: bool = False  # vLLM's fine-grained partial hits (groups/partial.py)
    checkpoints: bool = False  # vLLM's chunk-end checkpoint blocks (groups/checkpoints.py)
    checkpoint_alignment: int = 0  # their alignment in tokens (vLLM's prefill_checkpoint_alignment)
    eagle: bool = False  # vLLM's EAGLE beside partial hits: Mamba's entries at its replay boundary
    shared_prefix: bool = False  # with eagle: Mamba's entries at a step ending at the junction too

    @classmethod
    def of(cls, sizes: Sequence[int], hash_size: int | None = None, align: int | None = None,
           peek: Sequence[bool] = (), partial: bool = False, checkpoints: bool = False,
           checkpoint_alignment: int | None = None, eagle: bool = False,
           shared_prefix: bool = False) -> BlockSizes:
        """The sizes of groups of block sizes ``sizes``; ``hash_size`` defaults to their
        gcd, ``align`` to their lcm. ``peek``: one bool per group (or none): the groups
        whose blocks are cached for hits that peek (vLLM's EAGLE groups: ``caches``).
        ``partial``: vLLM's fine-grained partial hits (hits and caching at the hash
        block, Mamba states found inside their blocks: groups/partial.py, which the
        manager checks the groups against; and full attention's partial entries where
        its blocks are larger than the hash block: groups/partial_full.py).
        ``checkpoints``: vLLM's chunk-end checkpoint blocks, one per Mamba group
        (groups/checkpoints.py; with ``partial``, or at one size without ``peek``: a
        checkpoint then ends its entry), at ``checkpoint_alignment`` tokens
        from a step's start (vLLM's ``prefill_checkpoint_alignment``; None: the hash
        block). ``eagle``: vLLM's EAGLE beside partial hits (``partial``, or with
        ``checkpoints`` at one size: the one-size hit, checkpoints at EAGLE's replay
        boundary; docs/groups.md "EAGLE beside Mamba"): a peeking hit drops
        one hash block (``peek`` then names full-attention groups, all of one size, the
        hash block's or larger: groups/partial_eagle.py), and a Mamba group's partial
        entry, and a checkpoint, sit at EAGLE's replay boundary (``replay_at``). ``shared_prefix``
        (with ``eagle`` only): vLLM's ``enable_mamba_shared_prefix_checkpoint``, a Mamba
        group's partial entry also where a prompt step ends at the request's junction
        (``add_request(junction=)``; ``partial.tail``). Raises ConfigError: no
        sizes, a size (or ``hash_size``, ``align``, ``checkpoint_alignment``) not a
        positive int, a size not a multiple of
        ``hash_size``, ``align`` not a multiple of every size, ``peek`` not one bool per
        group, ``partial`` not a bool or with ``peek`` (but with ``eagle``), ``checkpoints``
        not a bool or without ``partial`` (but at one size, without ``peek`` but with
        ``eagle``), ``checkpoint_alignment`` without ``checkpoints``, ``eagle`` not a bool
        or without ``partial`` (but with ``checkpoints`` at one size), ``shared_prefix``
        not a bool or without ``eagle``."""
        try:
            got = tuple(sizes)
        except TypeError:
            raise ConfigError(f"sizes must be a sequence of block sizes, got {sizes!r}") from None
        if not got:
            raise ConfigError("sizes must name one block size per group, got none")
        for b in got:
            check_positive("a group's block size", b)
        h = reduce(math.gcd, got) if hash_size is None else check_positive("hash_size", hash_size)
        a = reduce(math.lcm, got) if align is None else check_positive("align", align)
        if any(b % h for b in got):
            raise ConfigError(f"every group's block size must be a multiple of hash_size {h}, got {got}")
        if any(a % b for b in got):
            raise ConfigError(f"align must be a multiple of every group's block size, got {a} for {got}")
        flags = tuple(peek) if isinstance(peek, Sequence) else None
        if flags is None or (flags and len(flags) != len(got)) or any(type(p) is not bool for p in flags):
            raise ConfigError(f"peek must be one bool per group ({len(got)}) or none, got {peek!r}"[:200])
        one_ck = checkpoints is True and h == a  # (at one size: eagle beside checkpoints)
        if type(eagle) is not bool or (eagle and partial is not True and not one_ck):
            raise ConfigError(f"eagle must be a bool, and False without partial (but with checkpoints "
                              f"at one size), got {eagle!r}")
        if type(shared_prefix) is not bool or (shared_prefix and eagle is not True):
            raise ConfigError(f"shared_prefix must be a bool, and False without eagle, got {shared_prefix!r}")
        if type(partial) is not bool or (partial and any(flags) and not eagle):
            raise ConfigError(f"partial must be a bool, and False with peek (but with eagle), "
                              f"got {partial!r}")
        if type(checkpoints) is not bool or (checkpoints and not partial and (h != a or flags and not eagle)):
            raise ConfigError(f"checkpoints must be a bool, and False without partial (but at one size, "
                              f"without peek but with eagle), got {checkpoints!r}")
        if checkpoint_alignment is not None and not checkpoints:
            raise ConfigError(f"checkpoint_alignment needs checkpoints, got {checkpoint_alignment!r}")
        ck = 0 if not checkpoints else h if checkpoint_alignment is None else \
            check_positive("checkpoint_alignment", checkpoint_alignment)
        return cls(got, h, a, flags if any(flags) else (), partial, checkpoints, ck, eagle, shared_prefix)

    def replay_at(self, n: int, gap: int = 1) -> int:
        """Where a Mamba state of ``n`` tokens (a prompt's, a step's end) is kept for a
        hit to resume at (vLLM's ``get_mamba_prefill_checkpoint_position`` at the hash
        block): the last hash boundary at least ``gap`` tokens before its end (1: before
        its last token; lookahead hashing's ``max(1, L)``: groups/lookahead.py); with
        ``eagle``, one hash block below its last hash boundary (EAGLE's hit drops one; 0
        at least)."""
        h = self.hash_size
        return max(n // h * h - h, 0) if self.eagle else max(n - gap, 0) // h * h

    @property
    def unit(self) -> int:
        """The alignment of hits and caching: ``hash_size`` with ``partial`` hits (vLLM's
        ``_cache_hit_alignment_tokens``), else ``align``."""
        return self.hash_size if self.partial else self.align

    @property
    def one_size(self) -> bool:
        """Every group's size is the hash block and the alignment (the one-size manager)."""
        return self.hash_size == self.align

    def key_index(self, g: int, j: int) -> int:
        """The index of the fine hash that keys block ``j`` of group ``g``."""
        return (j + 1) * (self.sizes[g] // self.hash_size) - 1

    def num_keyed(self, g: int, num_hashes: int) -> int:
        """Blocks of group ``g`` that ``num_hashes`` fine hashes key (whole blocks only)."""
        return num_hashes // (self.sizes[g] // self.hash_size)

    def longest_hit(self, specs: Sequence[GroupSpec], limit: int, cached: Callable[[int, int], bool]) -> int:
        """The hit in tokens, at most ``limit``: ``hits.longest_sized_hit`` at these sizes."""
        return longest_sized_hit(specs, self.sizes, self.align, limit, cached)

    def caches(self, spec: GroupSpec, g: int, num_tokens: int, j: int, marks: Sequence[int] = ()) -> bool:
        """Whether group ``g`` (of spec ``spec``) caches its block ``j`` once ``num_tokens``
        tokens are computed: a whole block below ``num_tokens`` rounded down to ``align``
        that a hit can read, one at the first multiple of ``align`` it ends at or
        before reading it (full attention reads every block; a sliding window of W
        only the ``cdiv(W - 1, b)`` blocks before each boundary: vLLM's
        ``reachable_block_mask``). A group ``peek`` names (vLLM's EAGLE: a hit
        matches one block past itself) caches up to ``num_tokens`` rounded down to
        ``align`` plus one block (at most ``num_tokens``; nothing before the first
        boundary: vLLM's ``get_num_cacheable_tokens``), and a window the block after
        each boundary too (``cdiv(W - 1, b) + 1`` blocks ending there; every block
        when those runs cover an aligned span, block 0 included, as vLLM's mask).
        A Mamba group caches every block (vLLM's dense retention: the manager records
        only those holding the state at their end); with a ``retention``, those
        ``_keeps_state`` names. A window with a ``retention``
        (vLLM's sparse retention, never with ``peek``) caches the blocks a hit reads at
        each multiple of ``retention`` tokens (none for 0) instead of ``align``'s, and
        at each of the request's ``marks`` rounded down to ``align`` (its prompt's replay
        boundary, its shared-prefix junction: ``GroupRequest.marks``). Checked against
        vLLM (tests/engines/test_vllm_sized_model.py, through tests/sized_model.py)."""
        b, peek = self.sizes[g], bool(self.peek) and self.peek[g]
        u = self.hash_size if self.partial else self.align  # (``unit``, without its call)
        end = num_tokens // u * u
        if peek and end:
            end = min(num_tokens, end + b)
        if j < 0 or (j + 1) * b > end:
            return False
        if spec.kind == FULL or spec.kind == MAMBA:  # (full attention reads every block; Mamba: sparse)
            if spec.retention is None:
                return True
            return _keeps_state(spec.retention, b, u, j,
                                eagle_marks(marks, self.align, self.hash_size, b) if self.eagle else marks)
        if spec.retention is not None:  # (beside EAGLE, its replay boundaries: eagle_retention.py)
            if not self.peek:
                return _retains(spec, b, self.align, j, marks)
            return peek_retains(spec, b, self.align, j, window_marks(marks, self.align, b, peek), peek)
        if peek:
            need, per = blocks_for(spec.tokens - 1, b) + 1, self.align // b
            return need >= per or (j >= 1 and (j - 1) % per >= per - need)
        boundary = blocks_for((j + 1) * b, self.align) * self.align  # (the next lcm boundary)
        return spec.first_needed(boundary) // b <= j

    def stored(self, specs: Sequence[GroupSpec], num_tokens: int) -> list[tuple[int, int, int]]:
        """What is announced (vLLM's ``BlockStored``) once a prompt of ``num_tokens``
        tokens is computed whole, as ``(group, fine hash index, block size)``, group by
        group in block order: each block ``caches`` names, under its key and its
        group's size (a Mamba group's only where the prompt ends: the one block whose
        state it computed at its end); and in a full-attention group larger than the hash block, the
        partial entry of the block that holds the prompt's last hash boundary before
        its last token, when that block lies below the aligned end (so only for a
        prompt of a multiple of ``align``), announced as one hash block (vLLM's
        ``cache_partial_block``; not stated for a full-attention group ``peek`` names
        larger than the hash block, which the manager refuses)."""
        h, end = self.hash_size, num_tokens // self.align * self.align
        boundary = (num_tokens - 1) // h * h
        marks = (num_tokens - 1,)  # (a window's retention: the prompt's replay boundary)
        out = []
        for g, spec in enumerate(specs):
            b = self.sizes[g]
            out += [(g, self.key_index(g, j), b) for j in range(num_tokens // b)
                    if self.caches(spec, g, num_tokens, j, marks)
                    and not (spec.sparse and (j + 1) * b < num_tokens)]
            if spec.kind == FULL and b > h and 0 < boundary <= end and boundary % b:
                out.append((g, boundary // h - 1, h))
        return out


def _retains(spec: GroupSpec, b: int, align: int, j: int, marks: Sequence[int]) -> bool:
    """``BlockSizes.caches`` for block ``j`` (a whole one, recorded by then) of a window
    of blocks of ``b`` with a ``retention``: the blocks a hit reads at each segment's end
    (every ``retention`` tokens; none for 0) and at each of ``marks`` rounded down to
    ``align`` (vLLM's ``reachable_block_mask`` without EAGLE)."""
    seg = spec.retention
    if seg and spec.first_needed(blocks_for((j + 1) * b, seg) * seg) // b <= j:  # (the segment's end)
        return True
    return any(spec.first_needed(t // align * align) // b <= j < t // align * align // b for t in marks)


def _keeps_state(seg: int, b: int, unit: int, j: int, marks: Sequence[int]) -> bool:
    """``BlockSizes.caches`` for block ``j`` (a whole one) of a Mamba group of blocks of
    ``b`` with a retention of ``seg`` tokens (vLLM's ``MambaManager.reachable_block_mask``):
    every block when ``seg`` is positive and at most ``b``; else the block ending each
    ``seg``-token segment (none for 0) and the one ending at or below each of ``marks``
    rounded down to ``unit`` (``BlockSizes.unit``)."""
    if seg:
        per = seg // b
        if per <= 1 or (j + 1) % per == 0:
            return True
    return any(t // unit * unit // b - 1 == j for t in marks)


def manager_sizes(specs: Sequence[GroupSpec], block_size: object) -> BlockSizes:
    """The sizes of a hybrid manager of groups ``specs`` given ``block_size``: one
    positive int for every group, or a ``BlockSizes`` of one size per group (checked
    again by ``BlockSizes.of``, since a dataclass can be built around its checks).
    Raises ConfigError: not a positive int nor a ``BlockSizes``, sizes for another
    number of groups, a ``peek`` that ``_peeking`` refuses, or with ``partial`` a peek
    on a group not full attention or ``eagle`` beside full-attention groups of several
    sizes. With sizes that are not
    ``one_size``, ``peek`` reaches every group of a peeking group's spec and size."""
    if not isinstance(block_size, BlockSizes):
        b = check_positive("block_size", block_size)
        return BlockSizes((b,) * len(specs), b, b)
    got = BlockSizes.of(block_size.sizes, block_size.hash_size, block_size.align, block_size.peek,
                        block_size.partial, block_size.checkpoints, block_size.checkpoint_alignment or None,
                        block_size.eagle, block_size.shared_prefix)
    if len(got.sizes) != len(specs):
        raise ConfigError(f"block_size must name one block size per group ({len(specs)}), "
                          f"got {len(got.sizes)}: {got.sizes}")
    if got.partial:
        check_partial(specs, got)
        full = {b for s, b in zip(specs, got.sizes, strict=True) if not s.sparse}
        if any(p and s.kind != FULL for p, s in zip(got.peek, specs, strict=False)) or (
                got.eagle and len(full) > 1):
            raise ConfigError(f"eagle and peek (vLLM's EAGLE) beside partial hits are served with peek on "
                              f"full-attention groups only, all of one size, got {got}")
        return got
    if got.peek and not got.one_size:
        return _peeking(specs, got)
    return got


def _peeking(specs: Sequence[GroupSpec], sizes: BlockSizes) -> BlockSizes:
    """``sizes`` with ``peek`` widened to every group of a peeking group's spec and size
    (vLLM's EAGLE flag reaches the groups looked up with it). Raises ConfigError for a
    peeking group that is not full attention nor a sliding window (vLLM's EAGLE refuses
    chunked local attention), or full attention larger than the hash block (vLLM would
    register the whole prompt's last hash boundary as a partial entry of a block not
    full yet, promoted when it fills: not served), and any peek beside a Mamba group."""
    if any(s.sparse for s in specs):
        raise ConfigError("peek (vLLM's EAGLE) beside a Mamba group with different block sizes is "
                          "not served (vLLM moves Mamba's checkpoints to EAGLE's replay boundary; "
                          "docs/groups.md)")
    keys = list(zip(specs, sizes.sizes, strict=True))
    peeks = {key for key, p in zip(keys, sizes.peek, strict=True) if p}
    for spec, b in peeks:
        if spec.kind not in (FULL, SLIDING) or (spec.kind == FULL and b > sizes.hash_size):
            raise ConfigError(f"peek (vLLM's EAGLE) with groups of different block sizes is served on "
                              f"sliding windows and on full attention of the hash block's size "
                              f"({sizes.hash_size}), got a {spec.kind} group of {b} (docs/groups.md)")
    return BlockSizes(sizes.sizes, sizes.hash_size, sizes.align, tuple(key in peeks for key in keys))

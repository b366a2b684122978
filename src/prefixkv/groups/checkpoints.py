"""vLLM's chunk-end checkpoint blocks in the sized manager (``BlockSizes.checkpoints``,
with ``partial``, or under lookahead keys at one size; docs/groups.md "Chunk-end
checkpoints"): one checkpoint block per Mamba group; beside the Mamba groups'
``retention`` (vLLM's sparse retention) only a step reaching ``prefill_end`` checkpoints
when it is 0, and a checkpoint ending its entry is recorded only where
``BlockSizes.caches`` says. With ``eagle`` at one size (``c = e // b * b - b``), or under
lookahead keys at one size (a step ending fewer than L tokens into its last block), a
step ending inside a block puts the state ending entry ``j - 1`` in block ``j``, recorded
under that entry (``_kept``); with ``eagle``, one ending on a block whose checkpoint a
retention drops keeps none there (``evicted``: vLLM's eviction).

    tokens        | 0 .. b-1      | b .. 2b-1       | 2b .. 3b-1            |
    Mamba (b)     | null          | checkpoint (j)  | the step's end block  |
                                    ^ the state at c = (e - 1) // h * h (here inside 2b .. 3b-1)

A step from ``s`` to ``e`` checkpoints at ``c = (e - 1) // h * h`` when ``s`` is a
multiple of ``h``, ``s + h <= c`` and entry ``j = cdiv(e, b) - 2`` lies past the one
holding the step's initial state (``(s - 1) // b``) and is empty, and ``c - s`` is a
multiple of ``BlockSizes.checkpoint_alignment`` (vLLM's
``is_mamba_prefill_checkpoint_valid`` and ``_needs_internal_checkpoint``): the step takes
one more block per Mamba group (after a copy on write's, before its end block) and puts
it at ``j``; the worker writes the state at ``c`` there. The block is recorded under
its own key when ``c`` ends entry ``j`` (``GroupRequest.states``), else as an entry of
the prefix up to ``c`` when ``c`` is the prompt's last hash boundary or the request's
junction (vLLM's ``shared_prefix_boundary``, ``add_request(junction=)``; nobody owns
it: no copy on write when the producer goes on), else never (a transient checkpoint). A step
that checkpoints records no partial tail entry (``partial.tail``). The blocks go back
with the step's others below the next step's start. Checked against vLLM's manager
through tests/sized_model.py (``checkpoint``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from ..core.block import Block, blocks_for
from .sizes import _keeps_state

if TYPE_CHECKING:
    from .manager import HybridKVCacheManager
    from .request import GroupRequest
    from .sizes import BlockSizes

    # request id -> (the step's end, [(group, position c, entry j)]): its last step's checkpoints
    Steps = dict[Hashable, tuple[int, list[tuple[int, int, int]]]]


def position(sizes: BlockSizes, b: int, start: int, end: int, last: int = 0,
             gap: int = 1) -> tuple[int, int] | None:
    """Where a step from ``start`` to ``end`` checkpoints in a Mamba group of block size
    ``b`` at ``sizes`` (module docstring), its table aside: ``(c, j)``, or None (none,
    checkpoints off, or ``end`` below ``last``: ``prefill_end``). ``gap``: the tokens
    ``c`` leaves before ``end`` (1; under lookahead keys L: the manager's ``_tail_gap``)."""
    h = sizes.hash_size
    c, j = sizes.replay_at(end, gap), blocks_for(end, b) - 2
    if not sizes.checkpoints or start % h or start + h > c or j <= (start - 1) // b \
            or (c - start) % sizes.checkpoint_alignment or end < last:
        return None
    return c, j


def prefill_end(self: HybridKVCacheManager, req: GroupRequest, num_tokens: int) -> int:
    """vLLM's ``prefill_end`` for a step of ``req`` once it has ``num_tokens`` tokens: with
    the Mamba groups' ``retention`` 0 (vLLM's coordinator passes it then only), the end
    a step must reach to checkpoint, ``max(num_prompt, num_tokens - 1)`` (its prompt's
    last chunk; a resumed request's replay of its output); else 0 (any step)."""
    return max(req.num_prompt, num_tokens - 1) if self.groups[self._sparse[0]].retention == 0 else 0


def at(self: HybridKVCacheManager, g: int, table: Sequence[Block | None], start: int,
       end: int, last: int = 0) -> tuple[int, int] | None:
    """The checkpoint ``(c, j)`` of a step from ``start`` to ``end`` in Mamba group ``g``
    whose table is ``table`` (before the step), or None (none, checkpoints off, or
    ``end`` below ``last``: ``prefill_end``). The entry of a block ahead (spec_states.py)
    counts as empty, as vLLM's ``_needs_internal_checkpoint`` takes it: the block stays
    there and holds the checkpoint (an admission's rows hold none: its hit's)."""
    ck = position(self.sizes, self._group_sizes[g], start, end, last, self._tail_gap)
    if ck is None or ck[1] < len(table) - self.groups[g].ahead and table[ck[1]] is not None:
        return None
    return ck


def count(self: HybridKVCacheManager, tables: Sequence[Sequence[Block | None]], start: int,
          end: int, last: int = 0) -> list[int]:
    """The Mamba groups whose step from ``start`` to ``end`` (their tables ``tables``;
    ``last``: ``prefill_end``) takes a checkpoint block."""
    if not self.sizes.checkpoints:
        return []
    return [g for g in self._sparse if at(self, g, tables[g], start, end, last) is not None]


def note(self: HybridKVCacheManager, req: GroupRequest, start: int, end: int,
         tables: Sequence[Sequence[Block | None]], last: int = 0) -> list[tuple[int, int, int]]:
    """The step from ``start`` to ``end`` (the tables as they were before it; ``last``:
    ``prefill_end``), which checkpoints: its checkpoints, noted for ``record`` (a step
    that does not leaves the note of an earlier one, which ``record`` and ``entries``
    know by its end); a checkpoint ending its entry holds the state at its end
    (``GroupRequest.states``)."""
    steps = self._checkpoints
    got = []
    for g in self._sparse:
        ck = at(self, g, tables[g], start, end, last)
        if ck is not None:
            got.append((g, *ck))
            if ck[0] == (ck[1] + 1) * self._group_sizes[g] and not evicted(
                    self.sizes, self.groups[g].retention, self._group_sizes[g], *ck,
                    self.sizes.replay_at(req.num_prompt, self._tail_gap), req.marks[1:]):
                if req.states is None:
                    req.states = set()
                req.states.add((g, ck[1]))
    if got:
        if steps is None:
            steps = self._checkpoints = {}
        steps[req.request_id] = (end, got)
    elif steps:
        steps.pop(req.request_id, None)
    return got


def evicted(sizes: BlockSizes, seg: int | None, b: int, c: int, j: int, tail: int,
            junction: Sequence[int]) -> bool:
    """Whether vLLM drops the checkpoint ``(c, j)`` ending its entry in a Mamba group of
    blocks of ``b`` with a retention of ``seg`` tokens: with ``eagle`` at one size, one
    at neither the prompt's checkpoint ``tail``, the ``junction`` nor a segment's end
    (vLLM's ``_cache_partial_tail_block`` asks its retention without the replay
    boundaries, and evicts the state the step's caching kept there)."""
    return sizes.eagle and not sizes.partial and c == (j + 1) * b and c != tail \
        and c not in junction and not retained(seg, b, c)


def retained(seg: int | None, b: int, c: int) -> bool:
    """Whether vLLM's retention of ``seg`` tokens (None: dense) keeps the Mamba state at
    ``c``, a multiple of the block size ``b``, as a checkpoint (a segment's end only)."""
    return seg is None or _keeps_state(seg, b, b, c // b - 1, ())


def record(self: HybridKVCacheManager, req: GroupRequest) -> bool:
    """After the step ending at ``req.num_scheduled`` recorded its blocks: a checkpoint
    at the prompt's last hash boundary or at the request's junction (vLLM's
    ``shared_prefix_boundary``: ``GroupRequest.marks``) inside its entry's successor is
    recorded as an entry of the prefix up to it. Whether the step checkpointed (then no
    partial tail)."""
    steps = self._checkpoints
    got = steps.get(req.request_id) if steps else None
    if got is None or got[0] != req.num_scheduled:
        return False
    h, tail = self._hash_size, self.sizes.replay_at(req.num_prompt, self._tail_gap)
    for g, c, j in got[1]:
        x = req.tables[g][j]
        if x is None or not _kept(self, req, g, c, j, tail):
            continue
        node = req.nodes[c // h - 1]
        if node.lost or self._index.nodes[x.block_id] is node:
            continue
        # (announced as vLLM's ``cache_partial_block`` does: one hash block, the last)
        i = c // h - 1
        self._index.store(g, [x], [node], i, req.tokens, [req.keys.for_event(i, h)], h)
    return True


def entries(self: HybridKVCacheManager, req: GroupRequest) -> set[tuple[int, int]]:
    """The (group, entry) of the request's last step's checkpoints that ``record``
    records inside a block (held until its next step releases them)."""
    steps = self._checkpoints
    got = steps.get(req.request_id) if steps else None
    if got is None or got[0] != req.num_scheduled:
        return set()
    tail = self.sizes.replay_at(req.num_prompt, self._tail_gap)
    return {(g, j) for g, c, j in got[1] if _kept(self, req, g, c, j, tail)}


def _kept(self: HybridKVCacheManager, req: GroupRequest, g: int, c: int, j: int, tail: int) -> bool:
    """Whether the checkpoint ``(c, j)`` of group ``g`` is recorded as an entry of the
    prefix up to ``c`` (``tail``: the prompt's last replay boundary): one inside its
    block at ``tail`` or the junction (``marks[1:]``); one ending its own block never
    (``GroupRequest.states`` records it); ``c == j * b``, the state ending entry ``j - 1``
    in block ``j`` (vLLM's ``cache_partial_block`` with ``replace_existing_hashes``): with
    ``eagle`` at one size at ``tail``, the junction or a retention's segment end
    (``retained``); under lookahead keys at one size (partial hits not followed:
    lookahead.md) at ``tail``, the junction or a boundary the group keeps
    (``BlockSizes.caches``)."""
    b = self._group_sizes[g]
    if c % b:
        return c == tail or c in req.marks[1:]
    if c != j * b:
        return False
    if self._lookahead:
        return not self.sizes.partial and (
            c == tail or c in req.marks[1:] or self.sizes.caches(self.groups[g], g, c, j - 1, req.marks))
    return c == tail or c in req.marks[1:] or retained(self.groups[g].retention, b, c)


def forget(self: HybridKVCacheManager, request_id: Hashable) -> None:
    """The request leaves."""
    if self._checkpoints:
        self._checkpoints.pop(request_id, None)

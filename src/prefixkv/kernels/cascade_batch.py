"""The metadata of cascade attention (``cascade.py``): built once per step on the host from
the scheduler's groups and counts, so that a call reads no tensor value on the host and
builds no index tensor of its own.

Per request i of a group sharing ``n`` whole blocks (``P = n * block_size`` tokens)::

    batch's block table row i | shared: n blocks | own: the rest, from column n on |
    own_cols[i, j] = n + j, clamped to the last block the request's keys need

Besides the device tensors it keeps the host counts it was built from (each request's
new tokens and keys, the groups' packed rows and prefix): what a call checks the batch
against and what :mod:`~prefixkv.kernels.cascade_cost` counts the keys of.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..core.block import blocks_for
from ..results import SharedPrefix
from .batch import _counts, _is_int, _sequence, build_block_table, build_cu_seqlens_q, check_tokens_fit
from .errors import BatchError

__all__ = ["CascadeBatch", "build_cascade_batch"]


@dataclass(frozen=True, slots=True)
class CascadeBatch:
    """The prefix pass's metadata and each request's shift, built by :func:`build_cascade_batch`."""

    shift_blocks: torch.Tensor  # [batch] int64: shared blocks of each request (0: in no group)
    rows: torch.Tensor  # [num_rows] int64: q rows of the groups' members, group after group
    block_table: torch.Tensor  # [num_groups, max_shared_blocks] int32: each group's shared blocks
    cu_seqlens_q: torch.Tensor  # [num_groups + 1] int32 over the packed rows
    seqused_k: torch.Tensor  # [num_groups] int32: shared tokens of each group
    max_seqlen_q: int
    max_seqlen_k: int
    prefix_tokens_read: int  # host count: shared tokens x groups (what pass 1 reads once per tile)
    own_cols: torch.Tensor  # [batch, own_width] int64: the batch table's column of each own block
    shift_tokens: torch.Tensor  # [batch] int32: shift_blocks x block_size
    block_size: int
    total_q: int  # host: q rows of the batch (all new tokens)
    table_width: int  # host: columns the batch's block table needs (the most blocks a request fills)
    num_new: tuple[int, ...]  # host: each request's new tokens (its q rows, in order)
    seq_lens: tuple[int, ...]  # host: each request's keys (cached + new)
    by_q_len: tuple[tuple[int, int, int, int], ...]  # host: (q_len, requests, their keys, own keys)
    prefix_groups: tuple[tuple[int, int], ...]  # host: (packed q rows, shared tokens) of each group
    rows_span: tuple[int, int] | None  # rows as one range [start, stop) of q (a view), else None

    @property
    def num_groups(self) -> int:
        """Groups kept (each reads its shared prefix in pass 1)."""
        return self.seqused_k.shape[0]


def build_cascade_batch(
    groups: Sequence[SharedPrefix],
    block_ids: Sequence[Sequence[int]],
    num_computed: Sequence[int],
    num_new: Sequence[int],
    block_size: int,
    *,
    device: torch.device | str | None = None,
) -> CascadeBatch:
    """Metadata of the prefix pass from the manager's groups and the step's counts.

    ``groups``: ``SharedPrefix`` (members: positions in the batch). Each group keeps the
    blocks that all members hold *and* that lie wholly before every member's first new
    token (``num_computed[i] // block_size``): a block being computed in this step holds
    keys some member's queries must see causally, so it stays in the own part. A group
    left with no block, or with fewer than two members, is dropped (its requests run
    whole in pass 2). The result is for this step's counts only: a call with another
    batch is refused (:func:`~prefixkv.kernels.cascade_attention`).

    Raises:
        BatchError: mismatched lengths, a count that is not an int >= 0 (``block_size``:
            >= 1; a group's ``num_blocks``), a member that is not an int, outside the batch
            or in two groups, or members whose block ids differ inside the claimed prefix
            (wrong groups would serve one request another's KV), ``block_ids`` or a row of
            it not a sequence, or a request whose tokens need more blocks than it lists (as
            :func:`~prefixkv.kernels.build_slot_mapping`); before any tensor is built.
    """
    block_ids = [_sequence(f"block_ids[{i}]", ids) for i, ids in enumerate(_sequence("block_ids", block_ids))]
    batch = len(block_ids)
    if len(num_computed) != batch or len(num_new) != batch:
        raise BatchError(f"block_ids, num_computed, num_new have {batch}, {len(num_computed)}, "
                         f"{len(num_new)} entries; one per request")
    num_computed, num_new = _counts("num_computed", num_computed), _counts("num_new", num_new)
    if not _is_int(block_size) or block_size < 1:
        raise BatchError(f"block_size must be an int >= 1, got {block_size!r}")
    # A group's table is its first member's blocks: counts past them padded it with a
    # block id no member holds, read as the shared prefix.
    check_tokens_fit(block_ids, num_computed, num_new, block_size)
    kept = _kept_groups(groups, block_ids, num_computed, batch, block_size)
    starts = [0]
    for n in num_new:
        starts.append(starts[-1] + n)
    shift = [0] * batch
    for n, members in kept:
        for i in members:
            shift[i] = n
    rows = [r for _, members in kept for i in members for r in range(starts[i], starts[i + 1])]
    packed = [sum(num_new[i] for i in members) for _, members in kept]
    seq_lens = [a + b for a, b in zip(num_computed, num_new, strict=True)]
    # Own part of row i: columns shift..need-1 of the batch's table, the last repeated as
    # padding (never read: the own keys end inside it). need >= 1 keeps the index in range.
    need = [max(1, blocks_for(n, block_size)) for n in seq_lens]
    width = max([1] + [b - s for b, s in zip(need, shift, strict=True)])
    cols = torch.minimum(torch.tensor(shift, dtype=torch.int64)[:, None] + torch.arange(width)[None, :],
                         torch.tensor(need, dtype=torch.int64)[:, None] - 1)  # [batch, width]
    by_q_len: dict[int, list[int]] = {}
    for q_len, keys, s in zip(num_new, seq_lens, shift, strict=True):
        sums = by_q_len.setdefault(q_len, [0, 0, 0])
        sums[0], sums[1], sums[2] = sums[0] + 1, sums[1] + keys, sums[2] + keys - s * block_size
    span = (rows[0], rows[-1] + 1) if rows and rows == list(range(rows[0], rows[-1] + 1)) else None
    return CascadeBatch(
        shift_blocks=torch.tensor(shift, dtype=torch.int64, device=device),
        rows=torch.tensor(rows, dtype=torch.int64, device=device),
        block_table=build_block_table([block_ids[members[0]][:n] for n, members in kept], device=device),
        cu_seqlens_q=build_cu_seqlens_q(packed, device=device),
        seqused_k=torch.tensor([n * block_size for n, _ in kept], dtype=torch.int32, device=device),
        max_seqlen_q=max(packed, default=0),
        max_seqlen_k=max((n * block_size for n, _ in kept), default=0),
        prefix_tokens_read=sum(n * block_size for n, _ in kept),
        own_cols=cols.to(device) if device is not None else cols,
        shift_tokens=torch.tensor([s * block_size for s in shift], dtype=torch.int32, device=device),
        block_size=block_size, total_q=starts[-1], table_width=max(need, default=1),
        num_new=tuple(num_new), seq_lens=tuple(seq_lens),
        by_q_len=tuple((q, n, keys, own) for q, (n, keys, own) in sorted(by_q_len.items())),
        prefix_groups=tuple((p, n * block_size) for p, (n, _) in zip(packed, kept, strict=True)),
        rows_span=span,
    )


def _kept_groups(groups: Sequence[SharedPrefix], block_ids: Sequence[Sequence[int]], num_computed: list[int],
                 batch: int, block_size: int) -> list[tuple[int, list[int]]]:
    """``(shared blocks, members)`` of each group kept (see :func:`build_cascade_batch`).

    Raises:
        BatchError: as :func:`build_cascade_batch` for the groups.
    """
    seen: set[int] = set()
    kept: list[tuple[int, list[int]]] = []
    for g in groups:
        if not isinstance(g, SharedPrefix):
            raise BatchError(f"groups must hold SharedPrefix, got {g!r}")
        if not _is_int(g.num_blocks) or g.num_blocks < 0 or not isinstance(g.members, (tuple, list)):
            raise BatchError(f"a group needs num_blocks an int >= 0 and members a tuple of ints, got {g!r}")
        for i in g.members:
            if not _is_int(i):
                raise BatchError(f"group members must be ints (positions in the batch), got {i!r} in {g!r}")
            if not 0 <= i < batch or i in seen:
                raise BatchError(f"group member {i} is outside the batch of {batch} or in two groups")
            seen.add(i)
        if len(g.members) < 2:
            continue  # nothing to share: the member (if any) runs whole in pass 2
        n = min([g.num_blocks] + [num_computed[i] // block_size for i in g.members])
        lead = list(block_ids[g.members[0]][:n])
        for i in g.members:
            if list(block_ids[i][:n]) != lead:
                raise BatchError(f"request {i} does not hold the group's first {n} blocks {lead}")
        if n > 0:
            kept.append((n, list(g.members)))
    return kept

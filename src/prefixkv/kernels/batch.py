"""Build the attention metadata tensors from the scheduler's plain block ids and lengths.

The scheduler side of prefixkv hands out plain Python ints: per request, its block ids
(in order) and how many of its tokens are already in the cache. Per request::

    | cached: num_computed tokens | new: num_new tokens | unused slots of the last block |
    block i holds token positions i*block_size .. (i+1)*block_size - 1

Everything is built on the CPU and copied to ``device`` once per tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..core.block import blocks_for
from .errors import BatchError

__all__ = [
    "PagedBatch",
    "build_block_table",
    "build_slot_mapping",
    "build_cu_seqlens_q",
    "build_seqused_k",
    "build_paged_batch",
]

_INT32_MAX = 2**31 - 1


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _sequence(name: str, values: object) -> list[Any]:
    """``values`` as a list; a sequence is required (a one-shot iterator would be read
    once by one builder and found empty by the next)."""
    if not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
        raise BatchError(f"{name} must be a sequence (list, tuple, range), got {type(values).__name__}")
    return list(values)


def _counts(name: str, values: Sequence[int], batch: int | None = None) -> list[int]:
    values = _sequence(name, values)
    if batch is not None and len(values) != batch:
        raise BatchError(f"{name} has {len(values)} entries, expected one per request ({batch})")
    for v in values:
        if not _is_int(v) or not 0 <= v <= _INT32_MAX:
            raise BatchError(f"{name} entries must be ints in [0, {_INT32_MAX}], got {v!r}")
    return values


def check_tokens_fit(block_ids: Sequence[Sequence[int]], num_computed: list[int], num_new: list[int],
                     block_size: int) -> None:
    """Each request's cached and new tokens fit in the blocks it lists (checked counts, one
    per request).

    Raises:
        BatchError: naming the first request whose tokens need more blocks than it has.
    """
    for i, (ids, a, b) in enumerate(zip(block_ids, num_computed, num_new, strict=True)):
        if a + b > len(ids) * block_size:
            raise BatchError(
                f"request {i}: {a} cached + {b} new tokens need {blocks_for(a + b, block_size)} blocks "
                f"of {block_size}, it has {len(ids)}"
            )


def build_block_table(
    block_ids: Sequence[Sequence[int]],
    *,
    max_blocks: int | None = None,
    pad_id: int = 0,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``[batch, max_blocks]`` int32: row i is request i's block ids, then ``pad_id``.

    ``max_blocks`` defaults to the longest row (at least 1); pass a fixed value to keep
    the shape stable across steps (CUDA graphs). Kernels never read padding entries, so
    ``pad_id`` only has to be a valid int32.

    Raises:
        BatchError: ``block_ids`` or a row of it not a sequence, a block id or ``pad_id``
            outside [0, 2^31 - 1], ``max_blocks`` not an int >= 1, or a row longer than
            ``max_blocks``.
    """
    rows = [_counts(f"block_ids[{i}]", ids) for i, ids in enumerate(_sequence("block_ids", block_ids))]
    _counts("pad_id", [pad_id])
    if max_blocks is not None and (not _is_int(max_blocks) or max_blocks < 1):
        raise BatchError(f"max_blocks must be None or an int >= 1, got {max_blocks!r}")
    longest = max((len(r) for r in rows), default=0)
    width = max(longest, 1) if max_blocks is None else max_blocks
    if longest > width:
        raise BatchError(f"a request has {longest} blocks but max_blocks is {width}")
    table = torch.full((len(rows), width), pad_id, dtype=torch.int32)
    for i, r in enumerate(rows):
        table[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
    return table.to(device) if device is not None else table


def build_cu_seqlens_q(num_new: Sequence[int], *, device: torch.device | str | None = None) -> torch.Tensor:
    """``[batch + 1]`` int32 prefix sums of the new-token counts, from 0.

    Raises:
        BatchError: ``num_new`` not a sequence, a negative or non-int count, or a total
            above 2^31 - 1.
    """
    counts = _counts("num_new", num_new)
    cu = torch.zeros(len(counts) + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(counts, dtype=torch.int64).cumsum(0)
    if cu[-1] > _INT32_MAX:
        raise BatchError(f"total new tokens {int(cu[-1])} exceed {_INT32_MAX}")
    return cu.to(torch.int32).to(device) if device is not None else cu.to(torch.int32)


def build_seqused_k(
    num_computed: Sequence[int], num_new: Sequence[int], *, device: torch.device | str | None = None
) -> torch.Tensor:
    """``[batch]`` int32 keys per request: cached prefix plus new tokens.

    Raises:
        BatchError: an argument not a sequence, mismatched lengths, negative or non-int
            counts, or a sum above 2^31 - 1.
    """
    new = _counts("num_new", num_new)
    done = _counts("num_computed", num_computed, len(new))
    lens = [a + b for a, b in zip(done, new, strict=True)]
    _counts("seqused_k", lens)
    t = torch.tensor(lens, dtype=torch.int32)
    return t.to(device) if device is not None else t


def build_slot_mapping(
    block_ids: Sequence[Sequence[int]],
    num_computed: Sequence[int],
    num_new: Sequence[int],
    block_size: int,
    *,
    pad_to: int | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``[total_new]`` (or ``[pad_to]``) int64 cache slots of the new tokens, in batch order.

    New token t of request i sits at position ``p = num_computed[i] + t`` and goes to slot
    ``block_ids[i][p // block_size] * block_size + p % block_size``. Entries past the
    real tokens (``pad_to``) are ``-1``, which :func:`write_kv_cache` skips.

    Raises:
        BatchError: an argument not a sequence (rows included), mismatched lengths,
            ``block_size`` not an int >= 1, a request whose tokens do not fit in its
            blocks, two new tokens in one slot (a block two requests hold, or one
            request lists twice, written again), or ``pad_to`` not an int at least the
            number of new tokens.
    """
    table = build_block_table(block_ids)
    new = _counts("num_new", num_new, table.shape[0])
    done = _counts("num_computed", num_computed, table.shape[0])
    if not _is_int(block_size) or block_size < 1:
        raise BatchError(f"block_size must be an int >= 1, got {block_size!r}")
    check_tokens_fit(block_ids, done, new, block_size)
    total = sum(new)
    size = total if pad_to is None else pad_to
    if not _is_int(size) or size < total:
        raise BatchError(f"pad_to must be None or an int >= {total} (the new tokens), got {pad_to!r}")
    slots = torch.full((size,), -1, dtype=torch.int64)
    if total:
        new_t = torch.tensor(new, dtype=torch.int64)
        req = torch.repeat_interleave(torch.arange(len(new)), new_t)  # [total] request of each token
        first = torch.cumsum(new_t, 0) - new_t  # [batch] first token of each request
        pos = torch.arange(total) - first[req] + torch.tensor(done, dtype=torch.int64)[req]
        slots[:total] = table.to(torch.int64)[req, pos // block_size] * block_size + pos % block_size
        taken, first_token = torch.unique(slots[:total], return_inverse=True)
        if taken.numel() < total:  # two new tokens in one slot: which one the cache keeps is a race
            seen: dict[int, int] = {}
            for t, k in enumerate(first_token.tolist()):
                if seen.setdefault(k, t) != t:
                    raise BatchError(f"new tokens {seen[k]} (request {int(req[seen[k]])}) and {t} (request "
                                     f"{int(req[t])}) both go to slot {int(slots[t])}, of block "
                                     f"{int(slots[t]) // block_size}: a block that is shared, or listed "
                                     "twice, would be written again")
    return slots.to(device) if device is not None else slots


@dataclass(frozen=True, slots=True)
class PagedBatch:
    """The tensors and bounds one ``write_kv_cache`` + ``paged_prefill_attention`` step
    needs: ``block_table`` ``[batch, max_blocks]`` int32 (each request's block ids, then
    padding); ``slot_mapping`` ``[total_new]`` int64 (each new token's cache slot, -1:
    padding); ``cu_seqlens_q`` ``[batch + 1]`` int32 (where each request's new tokens
    start in the batch); ``seqused_k`` ``[batch]`` int32 (each request's tokens with KV
    after this step: cached + new); ``max_seqlen_q``, ``max_seqlen_k``: their maxima."""

    block_table: torch.Tensor  # [batch, max_blocks] int32
    slot_mapping: torch.Tensor  # [total_new] int64, -1 = padding
    cu_seqlens_q: torch.Tensor  # [batch + 1] int32
    seqused_k: torch.Tensor  # [batch] int32
    max_seqlen_q: int
    max_seqlen_k: int


def build_paged_batch(
    block_ids: Sequence[Sequence[int]],
    num_computed: Sequence[int],
    num_new: Sequence[int],
    block_size: int,
    *,
    max_blocks: int | None = None,
    device: torch.device | str | None = None,
) -> PagedBatch:
    """All metadata of one step from per-request block ids, cached and new token counts.

    ``block_ids[i]``: request i's blocks in token order (the manager's ``block_ids``);
    ``num_computed[i]``: its tokens whose KV is in the cache already; ``num_new[i]``: its
    tokens computed now. ``block_size`` must be the manager's and the caches' (their
    dimension 1): nothing downstream can tell another one (a block table carries no block
    size), the kernels would read and write other slots. ``max_blocks``: the table's
    width, as :func:`build_block_table`. Returns a ``PagedBatch`` on ``device`` (default:
    the CPU).

    Raises:
        BatchError: as :func:`build_slot_mapping` and :func:`build_block_table`.
    """
    slots = build_slot_mapping(block_ids, num_computed, num_new, block_size, device=device)
    seqused = build_seqused_k(num_computed, num_new)
    return PagedBatch(
        block_table=build_block_table(block_ids, max_blocks=max_blocks, device=device),
        slot_mapping=slots,
        cu_seqlens_q=build_cu_seqlens_q(num_new, device=device),
        seqused_k=seqused.to(device) if device is not None else seqused,
        max_seqlen_q=max(num_new, default=0),
        max_seqlen_k=int(seqused.max()) if len(seqused) else 0,
    )

"""The split-KV workspace a launch writes partial outputs into (``split_kv.py`` merges them),
and the check that one fits a call (both backends run it).

Torch only (no Triton), so that an engine can make one at start-up, before any launch,
and pass the same one to every step: a launch with it has a fixed grid and allocates
nothing for its splits, which is what a CUDA graph needs to capture it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .arguments import _same_device
from .errors import ArgumentTypeError, DtypeError, ShapeError, UnsupportedError
from .overlap import check_apart

if TYPE_CHECKING:
    from .validation import AttentionShape

__all__ = ["MIN_KEYS_PER_SPLIT", "SplitWorkspace", "alloc_split_workspace", "check_split_workspace"]

_SPLITS_LIMIT = 1024  # a workspace's split count at most (as TileConfig.num_splits)

MIN_KEYS_PER_SPLIT = 256
"""Keys a split gets at least (by default): below this a split spends more on its partial
than it saves."""


@dataclass(frozen=True, slots=True)
class SplitWorkspace:
    """Where split-KV partials go: ``part`` ``[num_splits, rows, num_heads, head_dim]`` and
    ``part_lse`` ``[num_splits, num_heads, rows]`` fp32, and ``row_tok`` ``[rows]`` int32,
    contiguous, the token each row belongs to in this launch (-1: none). Row ``i * split_q + t`` is
    query t of request i, for requests of at most ``split_q`` new tokens (the ones that
    split); ``rows >= batch * split_q``. Made by :func:`alloc_split_workspace`."""

    part: torch.Tensor
    part_lse: torch.Tensor
    row_tok: torch.Tensor
    split_q: int
    min_keys: int

    @property
    def num_splits(self) -> int:
        """The grid's split axis: every launch with this workspace has this many."""
        return self.part.shape[0]

    @property
    def rows(self) -> int:
        """Workspace rows: enough for ``rows // split_q`` requests."""
        return self.part.shape[1]


def alloc_split_workspace(num_splits: int, max_batch: int, num_heads: int, head_dim: int,
                          device: torch.device | str, *, split_q: int = 1,
                          min_keys: int = MIN_KEYS_PER_SPLIT) -> SplitWorkspace:
    """A split-KV workspace made once, for launches that CUDA graphs capture: passed as
    ``split_workspace=``, it fixes the grid's split axis at ``num_splits`` (whatever
    ``max_seqlen_k``) and the launch allocates nothing for the splits. Per request, in
    any batch (prefills included): a request of at most ``split_q`` new tokens cuts its
    keys into ``min(num_splits, keys // min_keys)`` slices (at least 1); every other
    request runs whole. Memory: ``num_splits * max_batch * split_q * num_heads *
    head_dim * 4`` bytes.

    Raises:
        UnsupportedError: a count that is not an int >= 1 (``num_splits`` at most 1024).
    """
    _check_counts(("num_splits", num_splits, _SPLITS_LIMIT), ("max_batch", max_batch, None),
                  ("num_heads", num_heads, None), ("head_dim", head_dim, None), ("split_q", split_q, None),
                  ("min_keys", min_keys, None))
    rows = max_batch * split_q
    return SplitWorkspace(
        part=torch.empty((num_splits, rows, num_heads, head_dim), dtype=torch.float32, device=device),
        part_lse=torch.empty((num_splits, num_heads, rows), dtype=torch.float32, device=device),
        row_tok=torch.full((rows,), -1, dtype=torch.int32, device=device),
        split_q=split_q, min_keys=min_keys)


def _check_counts(*counts: tuple[str, object, int | None]) -> None:
    for name, n, top in counts:
        if type(n) is not int or n < 1 or (top is not None and n > top):
            raise UnsupportedError(f"{name} must be an int in [1, {top or 'inf'}], got {n!r}")


def check_split_workspace(ws: object, shape: AttentionShape, device: torch.device,
                          tensors: dict[str, torch.Tensor | None]) -> None:
    """A ``split_workspace`` fits this call: a ``SplitWorkspace`` on q's device with fp32
    partials of q's heads and head_dim, rows for ``batch * split_q``, and a contiguous
    int32 row map (the kernels read it at stride 1; the partials at their strides), sharing
    no memory with each other or with the call's other ``tensors`` (by name).

    Raises:
        ArgumentTypeError: not a ``SplitWorkspace``.
        UnsupportedError: its ``num_splits`` (``part``'s first dim), ``split_q`` or
            ``min_keys`` is not an int >= 1 (``num_splits`` at most 1024), as
            :func:`alloc_split_workspace` refuses them: a workspace of 0 splits launched
            no program and left ``out`` unwritten.
        ShapeError, DtypeError, DeviceError: it does not fit, or shares memory.
    """
    if not isinstance(ws, SplitWorkspace):
        raise ArgumentTypeError(f"split_workspace must be a SplitWorkspace (alloc_split_workspace), got "
                                f"{type(ws).__name__}")
    _check_counts(("split_workspace.num_splits", ws.num_splits, _SPLITS_LIMIT),
                  ("split_workspace.split_q", ws.split_q, None),
                  ("split_workspace.min_keys", ws.min_keys, None))
    want = (shape.num_heads, shape.head_dim)
    if ws.part.dim() != 4 or tuple(ws.part.shape[2:]) != want or ws.part_lse.shape != (
            ws.num_splits, shape.num_heads, ws.rows) or ws.row_tok.shape != (ws.rows,):
        raise ShapeError(f"split_workspace is [{ws.num_splits}, {ws.rows}, ...] for heads x head_dim "
                         f"{tuple(ws.part.shape[2:])}; this call has {want}")
    if not ws.row_tok.is_contiguous():  # the kernels index it by row, at stride 1
        raise ShapeError(f"split_workspace.row_tok must be contiguous, got stride {ws.row_tok.stride()}: "
                         "the rows it does not cover would keep an earlier launch's tokens")
    if ws.rows < shape.batch * ws.split_q:
        raise ShapeError(f"split_workspace has {ws.rows} rows; {shape.batch} requests x split_q {ws.split_q} "
                         f"need {shape.batch * ws.split_q}")
    dtypes = (ws.part.dtype, ws.part_lse.dtype, ws.row_tok.dtype)
    if dtypes != (torch.float32, torch.float32, torch.int32):
        raise DtypeError("split_workspace must hold float32 partials and an int32 row map")
    for t in (ws.part, ws.part_lse, ws.row_tok):
        _same_device("split_workspace", t, device)
    check_apart("paged_prefill_attention", {"split_workspace.part": ws.part,
                                            "split_workspace.part_lse": ws.part_lse,
                                            "split_workspace.row_tok": ws.row_tok}, tensors)

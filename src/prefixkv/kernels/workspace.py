"""The split-KV workspace a launch writes partial outputs into (``split_kv.py`` merges them).

Torch only (no Triton), so that an engine can make one at start-up, before any launch,
and pass the same one to every step: a launch with it has a fixed grid and allocates
nothing for its splits, which is what a CUDA graph needs to capture it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import UnsupportedError

__all__ = ["MIN_KEYS_PER_SPLIT", "SplitWorkspace", "alloc_split_workspace"]

MIN_KEYS_PER_SPLIT = 256
"""Keys a split gets at least (by default): below this a split spends more on its partial
than it saves."""


@dataclass(frozen=True, slots=True)
class SplitWorkspace:
    """Where split-KV partials go: ``part`` ``[num_splits, rows, num_heads, head_dim]`` and
    ``part_lse`` ``[num_splits, num_heads, rows]`` fp32, and ``row_tok`` ``[rows]`` int32,
    the token each row belongs to in this launch (-1: none). Row ``i * split_q + t`` is
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
    counts = (("num_splits", num_splits, 1024), ("max_batch", max_batch, None),
              ("num_heads", num_heads, None), ("head_dim", head_dim, None), ("split_q", split_q, None),
              ("min_keys", min_keys, None))
    for name, n, top in counts:
        if type(n) is not int or n < 1 or (top is not None and n > top):
            raise UnsupportedError(f"{name} must be an int in [1, {top or 'inf'}], got {n!r}")
    rows = max_batch * split_q
    return SplitWorkspace(
        part=torch.empty((num_splits, rows, num_heads, head_dim), dtype=torch.float32, device=device),
        part_lse=torch.empty((num_splits, num_heads, rows), dtype=torch.float32, device=device),
        row_tok=torch.full((rows,), -1, dtype=torch.int32, device=device),
        split_q=split_q, min_keys=min_keys)

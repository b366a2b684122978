"""How one attention launch splits its keys (``split_kv.py``): the split count, the
requests that split, the least keys per slice and the workspace the slices write.

Two ways: a :class:`~prefixkv.kernels.workspace.SplitWorkspace` the caller made once
fixes all of it (CUDA graphs), else the tile config forces a count or the heuristic
(:func:`~prefixkv.kernels.tiling.choose_num_splits`) picks one and a workspace is
allocated for this launch. Reads no tensor value (no synchronisation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tiling import MIN_KEYS_PER_SPLIT, TileConfig, choose_num_splits, sm_count
from .validation import AttentionShape
from .workspace import SplitWorkspace, alloc_split_workspace

__all__ = ["SplitPlan", "plan_splits"]


@dataclass(frozen=True, slots=True)
class SplitPlan:
    """``num_splits`` key slices per splitting tile (1: the split axis is off, ``ws`` is
    None), for requests of at most ``split_q`` new tokens, each slice of at least
    ``split_keys`` keys; ``ws``: where the slices' partials go."""

    num_splits: int
    split_q: int
    split_keys: int
    ws: SplitWorkspace | None
    fresh: bool = False  # ws was allocated for this launch: its row map is clear already

    def kernel_args(self, out: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
        """The kernel's workspace pointers (partials, their LSE, the row map) and their 7
        strides. Splitting, the row map of a reused workspace is cleared first: rows this
        launch does not split stay out of the merge. Not splitting, ``out`` three times and
        zero strides (pointers the kernel never reads: its SPLIT switch is off)."""
        if self.num_splits <= 1:
            return (out, out, out), (0,) * 7
        ws = self.ws
        assert ws is not None, "a split launch without its workspace"
        if not self.fresh:  # (a fresh one was made full of -1: a second fill is a launch more)
            ws.row_tok.fill_(-1)
        return (ws.part, ws.part_lse, ws.row_tok), (*ws.part.stride(), *ws.part_lse.stride())


def plan_splits(shape: AttentionShape, config: TileConfig, split_workspace: SplitWorkspace | None, *,
                max_seqlen_q: int, max_seqlen_k: int, block_q: int, causal: bool, device: torch.device
                ) -> SplitPlan:
    """The split plan of a launch of ``shape`` on ``device`` with query tiles of ``block_q``
    positions. With ``split_workspace`` (checked already, with the call's other
    arguments: ``validation.check_attention``): its count, ``split_q`` and ``min_keys``.
    Without: ``config.num_splits`` when set (every request splits, slices of any size:
    tests reach each slice that way), else the heuristic's count (slices of at least
    ``MIN_KEYS_PER_SPLIT``); a workspace is allocated when that count is over 1.
    """
    ws = split_workspace
    if ws is not None:  # fixed grid and workspace (CUDA graphs): per-request splits in any batch
        return SplitPlan(ws.num_splits, ws.split_q, ws.min_keys, ws)
    forced = config.num_splits is not None
    num_splits = config.num_splits or choose_num_splits(  # None: the heuristic's count
        batch=shape.batch, num_kv_heads=shape.num_kv_heads, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, num_sms=sm_count(device), block_q=block_q,
        ctas_per_sm=config.ctas_per_sm, causal=causal)
    # Every request splits (the heuristic splits only batches of short queries); a forced
    # count splits every tile into all its slices (tests reach each slice that way).
    split_q, split_keys = max(1, max_seqlen_q), 1 if forced else MIN_KEYS_PER_SPLIT
    if num_splits > 1:
        ws = alloc_split_workspace(num_splits, shape.batch, shape.num_heads, shape.head_dim, device,
                                   split_q=split_q, min_keys=split_keys)
    return SplitPlan(num_splits, split_q, split_keys, ws, fresh=ws is not None)

"""vLLM's sparse prefix-cache retention beside EAGLE (``BlockSizes.caches``; vLLM's
``replay_boundaries`` with EAGLE and ``reachable_block_mask``): the positions a Mamba
group keeps its state at beside ``eagle`` (``eagle_marks``), and the blocks a window keeps
beside ``peek`` (``window_marks``, ``peek_retains``: a peeking window's tails one block up
and one block longer). Checked against vLLM's manager through the plug-in
(tests/engines/test_vllm_eagle_retention.py, test_vllm_eagle_window_retention.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..core.block import blocks_for

if TYPE_CHECKING:
    from .spec import GroupSpec

__all__ = ["eagle_marks", "peek_retains", "window_marks"]


def eagle_marks(marks: Sequence[int], align: int, h: int, b: int) -> Sequence[int]:
    """``marks`` (``GroupRequest.marks``: the prompt's last token, the junction) as the
    positions whose Mamba state (blocks of ``b``) vLLM keeps under sparse retention
    beside EAGLE: its replay boundaries (``replay_boundaries`` with EAGLE: the last
    ``align`` boundary below the prompt's last token, and below its end, each less one
    ``align`` block), its prompt checkpoint (one hash block below the prompt's last hash
    boundary: ``_cache_partial_tail_block``) when it ends a block, and the junction and
    one Mamba block below it (the Mamba manager an EAGLE group's:
    integrations/vllm/retention.py)."""
    if not marks:
        return marks
    p = marks[0] + 1
    ck = max(p // h * h - h, 0)  # (inside a block: the partial entry, groups/partial.py)
    return (max((p - 1) // align * align - align, 0), max(p // align * align - align, 0),
            ck if ck % b == 0 else 0, *marks[1:], *(t - b for t in marks[1:]))


def window_marks(marks: Sequence[int], align: int, b: int, peek: bool) -> Sequence[int]:
    """``marks`` (``GroupRequest.marks``) as the boundaries whose window tails vLLM keeps
    under sparse retention beside EAGLE (some group ``peek``): its replay boundaries (as
    ``eagle_marks``), the junction, and one block of ``b`` below it in a peeking window
    (vLLM's ``SingleTypeKVCacheManager.cache_blocks``)."""
    if not marks:
        return marks
    p = marks[0] + 1
    return (max((p - 1) // align * align - align, 0), max(p // align * align - align, 0), *marks[1:],
            *(t - b for t in marks[1:] if peek))


def peek_retains(spec: GroupSpec, b: int, align: int, j: int, marks: Sequence[int], peek: bool) -> bool:
    """``BlockSizes.caches`` for block ``j`` of a window of blocks of ``b`` with a
    ``retention`` beside EAGLE (vLLM's ``SlidingWindowManager.reachable_block_mask``): the
    ``need`` blocks a hit reads ending at each segment's end and at each of ``marks``
    rounded down to ``align``, shifted one block up, one more block, in a window
    ``peek`` names (its hit matches the block past it); every block when a segment
    holds no more than ``need``."""
    need, seg, shift = blocks_for(spec.tokens - 1, b) + peek, spec.retention, int(peek)
    if seg:
        per = seg // b
        if need >= per or j >= shift and (j - shift) % per >= per - need:
            return True
    for t in marks:
        end = t // align * align // b + shift
        if end - need <= j < end:
            return True
    return False

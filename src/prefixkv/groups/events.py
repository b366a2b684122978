"""Events of a hybrid manager: the core's events, told apart by group.

The same tokens hold different KV in different groups, so a consumer keys what it mirrors
by ``(group_idx, block_hash)``: a chain hash is announced (and withdrawn) once per group
that caches it. These are subclasses of ``BlockStored`` / ``BlockRemoved``: code that
handles the core's events handles them, and sees the group in the extra fields, which
follow vLLM's hybrid-cache event fields (``group_idx``; the spec kind and its window).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..events import BlockRemoved, BlockStored
from .spec import FULL


@dataclass(frozen=True, slots=True)
class GroupBlockStored(BlockStored):
    """``BlockStored`` in group ``group_idx``, whose spec is ``spec_kind`` with window
    or chunk ``spec_tokens`` (0 for full attention)."""

    group_idx: int = 0
    spec_kind: str = FULL
    spec_tokens: int = 0


@dataclass(frozen=True, slots=True)
class GroupBlockRemoved(BlockRemoved):
    """``BlockRemoved`` from group ``group_idx`` (fields as ``GroupBlockStored``)."""

    group_idx: int = 0
    spec_kind: str = FULL
    spec_tokens: int = 0

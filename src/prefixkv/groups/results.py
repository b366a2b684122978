"""Results of a hybrid manager: block ids per group."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from ..results import Admission, BlockCopy


class GroupAdmission(Admission):
    """An ``Admission`` whose ``group_block_ids`` has one tuple per group (released or
    never-needed positions of a windowed group hold the manager's ``null_block_id``);
    ``block_ids`` is group 0's."""

    __slots__ = ("_groups",)

    def __init__(self, request_id: Hashable, group_block_ids: Sequence[Sequence[int]],
                 num_cached_tokens: int, num_new_tokens: int) -> None:
        groups = tuple(tuple(ids) for ids in group_block_ids)
        super().__init__(request_id, groups[0], num_cached_tokens, num_new_tokens)
        self._groups = groups

    @property
    def group_block_ids(self) -> tuple[tuple[int, ...], ...]:
        """Block ids per group, in group order, each in token order."""
        return self._groups

    def _astuple(self) -> tuple[object, ...]:
        return (self.request_id, self._groups, self.num_cached_tokens, self.num_new_tokens)

    def __repr__(self) -> str:
        return (f"GroupAdmission(request_id={self.request_id!r}, group_block_ids={self._groups}, "
                f"num_cached_tokens={self.num_cached_tokens}, num_new_tokens={self.num_new_tokens})")


@dataclass(frozen=True, slots=True)
class GroupBlockCopy(BlockCopy):
    """A ``BlockCopy`` of group ``group_idx``'s layers."""

    group_idx: int = 0


@dataclass(frozen=True, slots=True)
class GroupFork:
    """A child created by ``fork``: its block ids per group, and the copies (one per
    group whose parent's last block is partial)."""

    request_id: Hashable
    group_block_ids: tuple[tuple[int, ...], ...]
    copies: tuple[GroupBlockCopy, ...]


@dataclass(frozen=True, slots=True)
class GroupDecodeStep:
    """What ``append_step`` did. ``grown``: ``(request_id, new block ids per group)``
    for each request that took new blocks. ``short``: requests that needed blocks and
    could not get them; they are unchanged (their token was not appended, their windows
    did not move)."""

    grown: tuple[tuple[Hashable, tuple[tuple[int, ...], ...]], ...]
    short: tuple[Hashable, ...]


@dataclass(frozen=True, slots=True)
class GroupStats:
    """One group's counts: ``blocks_held`` by live requests now, ``blocks_cached``
    (findable contents now), and since creation ``blocks_released`` (left every window
    of their request before it finished) and ``hit_blocks`` (cached blocks admissions
    took: a windowed group takes only those its window needs)."""

    group_idx: int
    spec_kind: str
    spec_tokens: int
    blocks_held: int
    blocks_cached: int
    blocks_released: int
    hit_blocks: int

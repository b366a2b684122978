"""What ``ContentIndex`` asks of the tier below it (``tiers.HostTier`` is one): the index
finds content there once the device misses, sends evicted content down, and tells it
when a slot's content came up. A protocol, so that the index names no tier."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from ..core.block import Block, ContentKey
from ..core.keyless import Keyless


class LowerTier(Protocol):
    slots: list[Block]
    """Every slot (a Block each), with or without content."""
    by_key: dict[ContentKey, Block]
    """The slots keyed by their content triple (token bytes another slot's key)."""
    num_chained: int
    """Slots found only as their parent slot's chained child."""
    load_dst: list[int] | tuple[int, ...]
    """The device blocks the step's loads write (empty: no load in the step)."""
    device: Callable[[int, bytes, bytes], Block | None]
    """The device block keyed for a content (parent content id, token bytes, extra
    bytes), if any: the index sets it to its own ``keyed``."""

    def find(self, parent_cid: int, chunk: bytes, extra: bytes) -> Block | None:
        """The slot holding this content (parent content id, token bytes, extra bytes)."""

    def walk(self, hits: list[Block], chunks: Sequence[bytes], cid: int, extra: bytes,
             device: Callable[[bytes], Block | None] | None, prev: Block) -> list[Block]:
        """``ContentIndex.match`` past the device's first miss (see ``SlotIndex.walk``)."""

    def demote(self, blocks: Sequence[Block], step: int, keyless: Keyless | None = None) -> None:
        """Keep the content of evicted ``blocks`` recorded before ``step`` in slots (those
        at ``keyless``'s positions: pending runs' blocks, their content read there)."""

    def unload(self, blocks: Sequence[Block]) -> None:
        """Device ``blocks`` lose their content: the step's loads into them leave the plan."""

    def on_device(self, s: Block, device: Block | None = None) -> None:
        """Slot ``s``'s content is on the device now (in block ``device``, when given)."""

    def forget_under(self, lost: set[int]) -> list[Block]:
        """Drop, announced gone, every slot holding a content recorded under one of the
        content ids ``lost`` (the device forgot them); returns those slots."""

    def stop_chaining(self) -> None:
        """Key every chained slot and chain no more (the device cut a chain)."""

"""The index of a HiSparse pool's cached blocks, keyed by the caller's block hashes (vLLM's
``BlockHashToBlockMap``): a hash may name several blocks (two requests computed the same
page), found first-recorded first; a block holds at most one hash (``Block.key``) until
the pool evicts it (``drop``) or resets (``clear``). It satisfies ``core.pool.PoolIndex``.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...core.block import Block
from ...core.keyless import Keyless

__all__ = ["HashIndex"]


class HashIndex:
    """Hash -> the blocks holding it, in the order recorded (module doc)."""

    __slots__ = ("_blocks", "_pages")

    def __init__(self) -> None:
        self._blocks: dict[bytes, dict[int, Block]] = {}
        self._pages: dict[int, int] = {}  # block id -> the page its hash ends

    def __len__(self) -> int:
        return len(self._blocks)

    def find(self, key: bytes) -> Block | None:
        """The first block recorded with ``key`` that still holds it; None when none does."""
        found = self._blocks.get(key)
        return None if found is None else next(iter(found.values()))

    def page_of(self, block: Block) -> int | None:
        """The page (0: the first) whose hash ``block`` holds, None when it holds none."""
        return None if block.key is None else self._pages[block.block_id]

    def record(self, block: Block, key: bytes, page: int) -> None:
        """``block`` (held, holding no hash) holds ``key``, page ``page``'s, from now on."""
        assert block.key is None and block.refs, block
        block.key = key
        self._pages[block.block_id] = page
        self._blocks.setdefault(key, {})[block.block_id] = block

    def drop(self, blocks: Sequence[Block], skip: Sequence[tuple[int, int]] = (),
             keyless: Keyless | None = None) -> None:
        """Each of ``blocks`` holds no hash from now on (no runs: ``skip`` is empty)."""
        for b in blocks:
            self.drop_one(b)

    def drop_one(self, block: Block) -> None:
        """``drop((block,))``."""
        key = block.key
        if key is None:
            return
        assert isinstance(key, bytes)
        found = self._blocks[key]
        del found[block.block_id]
        if not found:
            del self._blocks[key]
        del self._pages[block.block_id]
        block.clear_content()

    def release_spare(self, block: Block) -> Block | None:
        """None: no block is a spare (a hash names all its blocks)."""
        return None

    def clear(self) -> None:
        """Forget every hash (the pool cleared its blocks' keys)."""
        self._blocks.clear()
        self._pages.clear()

    def check(self, blocks: Sequence[Block]) -> str | None:
        """The first block whose hash the index does not name it under (or the reverse),
        None when sound."""
        named = {b.block_id: k for k, found in self._blocks.items() for b in found.values()}
        for b in blocks:
            if b.key != named.get(b.block_id) or b.twin:
                return f"block {b.block_id} holds {b.key!r}, the index names it {named.get(b.block_id)!r}"
        return None

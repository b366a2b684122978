"""An index that never finds anything: plain paged allocation, no hashing, no reuse."""

from __future__ import annotations

from collections.abc import Sequence

from ..core.block import Block
from ..core.keyless import Keyless
from ..events import Event


class NoIndex:
    """Satisfies ``Index``; every block stays without content and goes back empty."""

    hashing = False
    hash_may_fail = False
    step = 0

    def __len__(self) -> int:
        return 0

    def match(self, chunks: Sequence[bytes], base: bytes, mm: Sequence[bytes] | None, *,
              start: list[Block] | None = None) -> list[Block]:
        return []

    def claim(self, chunks: Sequence[bytes], base: bytes, mm: Sequence[bytes] | None,
              data: bytes) -> tuple[list[Block], int]:
        return [], 0

    def prepare(self, req: object, first: int, last: int, parent: object) -> None:
        return None

    def prepare_next(self, req: object, token: int) -> None:
        return None

    def store(self, req: object, first: int, prepared: object, data: bytes | None = None) -> None:
        pass

    def store_filled(self, req: object, j: int) -> None:
        pass

    def drop(self, blocks: Sequence[Block], skip: Sequence[tuple[int, int]] = (),
             keyless: Keyless | None = None) -> None:
        pass

    def drop_one(self, block: Block) -> None:
        pass

    def uncache(self, blocks: Sequence[Block], cut: bool = False) -> list[Block]:
        return []

    def release_spare(self, block: Block) -> Block | None:
        return None

    def snapshot(self, blocks: Sequence[Block]) -> list[Event]:
        return []

    def clear(self) -> None:
        pass

    def check(self, blocks: Sequence[Block]) -> str | None:
        held = next((b for b in blocks if b.key is not None), None)
        return None if held is None else f"block {held.block_id} has content without an index"

    def check_request(self, req: object, block_size: int) -> str | None:
        return None

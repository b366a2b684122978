"""The physical block: created once per pool slot, mutated in place, never copied."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class Block:
    """One physical KV block.

    ``ref_cnt``: how many live requests hold it. ``cid``: content id, 0 while the block is
    not full; blocks with equal content (parent content, tokens, extra keys) share a cid.
    ``parent_cid``, ``tokens``, ``extra``: that content; meaningless while ``cid`` is 0
    (not cleared on reuse: the next fill overwrites them).
    ``hash``: the chain hash under which the block is in the pool's index, or None.
    ``prev``/``next``: links of the free queue's cached tier (intrusive list).
    """

    block_id: int
    ref_cnt: int = 0
    hash: bytes | None = None
    cid: int = 0
    parent_cid: int = 0
    tokens: bytes = b""
    extra: bytes = b""
    prev: Block | None = None
    next: Block | None = None

    def clear_content(self) -> None:
        self.hash = None
        self.cid = 0

    def __repr__(self) -> str:
        h = self.hash.hex()[:8] if self.hash else None
        return f"Block(id={self.block_id}, ref={self.ref_cnt}, cid={self.cid}, hash={h})"

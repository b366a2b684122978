"""The physical block: created once per pool slot, mutated in place, never copied."""

from __future__ import annotations

from dataclasses import dataclass

Key = tuple  # (parent content id, token bytes, extra-key bytes): a block's content


def blocks_for(num_tokens: int, block_size: int) -> int:
    """How many blocks ``num_tokens`` token slots take (ceiling division)."""
    return -(-num_tokens // block_size)


@dataclass(slots=True, eq=False)
class Block:
    """One physical KV block.

    ``ref_cnt``: how many live requests hold it.
    ``key``: its content ``(parent content id, token bytes, extra-key bytes)`` once full
    and recorded, None while it holds no reusable content (partial, never computed, or
    reused). ``content_id``: a per-process id of that content, shared by every block that
    holds equal content (its children's keys name it); 0 without content.
    ``twin``: another block held the same content first; this one is a spare copy that is
    findable only if that one goes (see ``ContentIndex``).
    ``hash``: the chain hash (the identity outside the process), computed only when a
    consumer needs it (events, tiers), else None.
    ``event``: the BlockStored that announced this content, when events are recorded.
    ``prev``/``next``: links of the free queue's cached tier (intrusive list).
    """

    block_id: int
    ref_cnt: int = 0
    key: Key | None = None
    content_id: int = 0
    twin: bool = False
    hash: bytes | None = None
    event: object = None
    prev: Block | None = None
    next: Block | None = None

    def clear_content(self) -> None:
        self.key = None
        self.content_id = 0
        self.twin = False
        self.hash = None
        self.event = None

    def __repr__(self) -> str:
        return (f"Block(id={self.block_id}, ref={self.ref_cnt}, content={self.content_id}"
                f"{', twin' if self.twin else ''})")

"""The physical block: created once per pool slot, mutated in place, never copied."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from ..events import BlockStored
    from .run import Run

ContentKey = tuple[int, bytes, bytes]  # (parent content id, token bytes, extra-key bytes)
Key = bytes | ContentKey  # the index key: token bytes alone, or the whole content


def key_chunk(key: Key | None) -> bytes:
    """The token bytes of an index key (the key, or its middle); ``key`` is not None."""
    assert key is not None, "a block without content has no token bytes"
    return key if isinstance(key, bytes) else key[1]


def blocks_for(num_tokens: int, block_size: int) -> int:
    """How many blocks ``num_tokens`` token slots take: the one ceiling division of the
    package (also where the units are not blocks: chunks of a chunked-attention group)."""
    return -(-num_tokens // block_size)


def hit_limit(num_tokens: int, block_size: int, max_hit_tokens: int | None = None) -> int:
    """The most blocks a cache hit of a ``num_tokens``-token prompt may have: all but the
    one holding its last token (computed anew: its logits are needed), and at most
    ``max_hit_tokens // block_size`` when a cap is given."""
    limit = (num_tokens - 1) // block_size
    return limit if max_hit_tokens is None else min(limit, max_hit_tokens // block_size)


class _Unlinked:
    """The ``prev``/``next`` of a block outside the free queue's cached tier."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "UNLINKED"


# Typed as a Block so that the links of a linked block need no None checks on the hot
# paths; it is only ever compared by identity, never read through.
UNLINKED: Block = cast("Block", _Unlinked())

@dataclass(slots=True, eq=False)
class Block:
    """One physical KV block.

    ``ref_cnt``: how many live requests hold it (a property: ``refs``, the block's own
    count, unless the block is one of a shared ``Run``'s, ``counted``, whose ``n`` it is).
    ``key``: the index key of its content once full and recorded (see ``ContentIndex``),
    None while it holds no reusable content (partial, never computed, or reused); while
    it is None, the content fields are stale and meaningless (not cleared: the next fill
    overwrites them). The content: ``parent_cid`` (the parent's content id, 0 for a first
    block), the token bytes (in the key) and ``extra`` (extra-key bytes). ``content_id``:
    a per-process id of that content, shared by every block that holds equal content (its
    children's keys name it); 0 without content.
    ``twin``: another block held the same content first; this one is a spare copy that is
    findable only if that one goes (see ``ContentIndex``).
    ``hash``: the chain hash (the identity outside the process), computed only when a
    consumer needs it (events, tiers), else None.
    ``event``: the BlockStored (a run of blocks) that announced this content, when events
    are recorded (``event.block_of(hash, ...)`` is this block's part of it).
    ``step``: the manager's step in which the content was recorded (its KV is computed by
    that step's forward pass, so it may be copied elsewhere only in a later step).
    ``child``: the block last recorded with this block's content as its parent: a
    guess the index tries before a dict probe, verified like any hit (may be stale);
    ``NO_CHILD`` (which fails every check) until one is.
    ``chained``: the index finds this block only as its parent's ``child``, not in its
    dicts (see ``ContentIndex``).
    ``prev``/``next``: links of the free queue's cached tier (intrusive list).
    ``starts``: the run whose head it is, if any (may be stale: see ``Run``).
    ``counted``: the shared run whose count is this block's, if any.
    """

    block_id: int
    refs: int = 0
    key: Key | None = None
    parent_cid: int = 0
    extra: bytes = b""
    content_id: int = 0
    twin: bool = False
    hash: bytes | None = None
    event: BlockStored | None = None
    step: int = 0
    child: Block = field(default_factory=lambda: NO_CHILD)  # (made once a block)
    chained: bool = False
    prev: Block = UNLINKED
    next: Block = UNLINKED
    starts: Run | None = None
    counted: Run | None = None

    @property
    def ref_cnt(self) -> int:
        """How many live requests hold the block (its run's one count, if shared)."""
        r = self.counted
        return self.refs if r is None else r.n

    @ref_cnt.setter
    def ref_cnt(self, n: int) -> None:  # one block's count alone: its run's is dissolved
        r = self.counted
        if r is not None:
            r.dissolve()
        self.refs = n

    def clear_content(self) -> None:
        """Mark the block as holding no reusable content (``key`` None, not a twin, not
        chained). Only that: the caller has already taken it out of the index; the content
        fields go stale, as ``key`` None says."""
        self.key = None
        self.twin = False
        self.chained = False

    def __repr__(self) -> str:
        return (f"Block(id={self.block_id}, ref={self.ref_cnt}, content={self.content_id}"
                f"{', twin' if self.twin else ''})")


NO_CHILD: Block = Block(-1, key=b"", parent_cid=-1, content_id=-1, child=cast("Block", None))
"""The ``child`` of a block without one: a ``Block`` holding no content (parent and content
ids -1, not chained, not a twin), whose key ``b""`` no chunk equals (a chunk has ``4 *
block_size`` bytes), so it fails every check a guess must pass. A ``Block``, not an object
of its own type, and a ``bytes`` key, not None: the guess's reads stay specialized to the
block's slots (3.11 specializes an attribute read per type; another type's goes through
the generic lookup, ``_PyType_Lookup`` and the type's dicts), and its compare with a chunk
is bytes with bytes (None with bytes runs ``object_richcompare``, ``PyType_IsSubtype`` and
the reflected fallback): C paths cold after the forward pass, which a step met at the first
block's guess, the miss's and the store's held check (benchmarks/results/events-r24.md).
Never written to (``ContentIndex.check`` verifies it)."""
NO_CHILD.child = NO_CHILD

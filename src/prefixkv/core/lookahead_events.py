"""The events of lookahead keys (``core/lookahead.py``): each ``BlockStored`` carries,
per block, the ``L`` tokens after it, which its chain hash covers (vLLM 0.33's
``BlockStored.lookahead_token_ids``), so that a consumer rebuilds the hashes it mirrors.

Block ``j``'s hash is ``H(parent || tokens[j*bs:(j+1)*bs] || extra_j || b"A" || L:u32
|| tokens[(j+1)*bs:(j+1)*bs+L])`` (uint32 little-endian each; ``extra_j``: the block's
extra-key bytes, as without lookahead): ``hashing.block_hashes(tokens, bs, ...,
hash_lookahead_tokens=L)`` names a prompt's blocks so. An event gives a consumer the run's
tokens, its parent's hash and, here, each block's lookahead tokens: the hash of block
``i`` of a run follows from these alone.

How they are built: with lookahead keys every store is announced when the log is taken
(deferred: a built-in hash, no tier, no shared store), so the manager's log
(``LookaheadEventLog``) wraps each ``StoredRun`` it is handed in a ``LookaheadRun``.
When taken, that builds the run's ``BlockStored`` events as before, then gives each its
blocks' lookahead tokens: the last ``4 * L`` bytes of each block's extra-key bytes, as
recorded (``lookahead.lookahead_keys``), and the extra keys over the run and the ``L``
tokens after it (a multimodal input that starts there entered the last block's hash),
and makes the blocks' ``event`` the new event (a snapshot or a copy restates it,
``BlockStored.block``). The plain manager's log and events are not touched.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..event_log import Deferred, EventLog
from ..events import BlockStored, Event
from ..extra_keys import ExtraKeys
from ..index.announce import StoredRun

__all__ = ["LookaheadBlockStored", "LookaheadEventLog", "LookaheadRun"]


@dataclass(frozen=True, slots=True)
class LookaheadBlockStored(BlockStored):
    """``BlockStored`` of blocks keyed with the ``L`` tokens after them:
    ``lookahead_token_bytes`` are block i's ``L`` tokens at ``[4*L*i, 4*L*(i+1))``,
    uint32 little-endian (``lookahead_token_ids`` decodes them)."""

    lookahead_token_bytes: bytes = b""

    @property
    def lookahead(self) -> int:
        """``L``: the tokens after each block that its hash covers."""
        return len(self.lookahead_token_bytes) // (4 * len(self.block_hashes))

    @property
    def lookahead_token_ids(self) -> list[list[int]]:
        """Per block, the ``L`` tokens after it (vLLM's ``lookahead_token_ids``)."""
        la = self.lookahead
        ids = struct.unpack(f"<{len(self.lookahead_token_bytes) // 4}I", self.lookahead_token_bytes)
        return [list(ids[i * la:(i + 1) * la]) for i in range(len(self.block_hashes))]

    def block_extra(self, i: int) -> ExtraKeys | None:
        """The extra keys over block i and the ``L`` tokens after it (what entered its
        hash: ``hashing.lookahead_bytes``; vLLM's extra keys of the block cover the same)."""
        if self.extra is None:
            return None
        bs = self.block_size
        start = (self.first_block + i) * bs
        return self.extra.for_range(start, start + bs + self.lookahead)

    def block(self, i: int, block_id: int, medium: str) -> BlockStored:
        """``BlockStored.block``, with block i's lookahead tokens alone."""
        one = BlockStored.block(self, i, block_id, medium)
        if one is self:
            return self
        assert isinstance(one, LookaheadBlockStored), "``replace`` keeps the class"
        width = 4 * self.lookahead
        return replace(one, lookahead_token_bytes=self.lookahead_token_bytes[i * width:(i + 1) * width])


class LookaheadRun(Deferred):
    """A ``StoredRun`` of lookahead-keyed blocks whose events are ``LookaheadBlockStored``
    (module docstring)."""

    __slots__ = ("run", "lookahead")

    def __init__(self, run: StoredRun, lookahead: int) -> None:
        self.count = run.count
        self.run, self.lookahead = run, lookahead

    def events(self) -> list[Event]:
        run = self.run
        width = 4 * self.lookahead
        tails: Sequence[bytes] = [extra[len(extra) - width:] for extra in run.extras]
        out: list[Event] = []
        for ev in run.events():
            assert isinstance(ev, BlockStored), "a StoredRun announces stores only"
            i, n = ev.first_block - run.first, len(ev.block_hashes)
            extra = run.extra  # (over the run and the L tokens after its last block)
            if extra is not None:
                start = ev.first_block * run.bs
                extra = extra.for_range(start, start + n * run.bs + self.lookahead)
            la = LookaheadBlockStored(ev.block_hashes, ev.parent_block_hash, ev.token_bytes,
                                      ev.block_ids, extra, ev.first_block, ev.medium,
                                      b"".join(tails[i:i + n]))
            for b in run.blocks[i:i + n]:
                if b.event is ev:  # (a spare keeps the event of the block it copies)
                    b.event = la
            out.append(la)
        return out


class LookaheadEventLog(EventLog):
    """``EventLog`` whose deferred ``StoredRun`` items are ``LookaheadRun``s."""

    __slots__ = ("lookahead",)

    def __init__(self, max_events: int, lookahead: int) -> None:
        super().__init__(max_events)
        self.lookahead = lookahead

    def defer(self, item: Deferred) -> None:
        """``EventLog.defer``, a ``StoredRun`` wrapped (module docstring)."""
        if isinstance(item, StoredRun):
            item = LookaheadRun(item, self.lookahead)
        super().defer(item)

"""What the manager and the pool ask of an index."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from ..core.block import Block
from ..core.keyless import Keyless
from ..core.request import Request
from ..events import Event
from .announce import Prepared


class Index(Protocol):
    """What the pool and the manager ask of an index of full blocks: find a run of blocks
    by their content (``match``, ``claim``), record and forget blocks' identities
    (``prepare``/``store``, ``drop``, ``uncache``, ``clear``), and check itself against
    the pool (``check``). ``ContentIndex`` is the prefix cache, ``NoIndex`` never finds
    anything; the manager picks one by ``enable_caching``."""

    hashing: bool
    """Whether ``prepare`` computes chain hashes (someone needs them: events, tiers)."""

    def __len__(self) -> int:
        """Distinct contents findable."""

    def match(self, chunks: Sequence[bytes], base: bytes, mm: Sequence[bytes] | None, *,
              start: list[Block] | None = None) -> list[Block]:
        """The blocks holding the longest findable run of the full blocks whose token
        bytes are ``chunks``, from the first, stopping at the first miss. ``base``:
        extra-key bytes of every block; ``mm``: per-block extra-key bytes that replace
        ``base`` where given. ``start``: the device's run as ``claim`` found it (then
        undone), from which a tier below continues the walk. Changes nothing."""

    def claim(self, chunks: Sequence[bytes], base: bytes, mm: Sequence[bytes] | None,
              data: bytes) -> tuple[list[Block], int] | None:
        """``match`` that takes a reference on each hit in the same pass (a hit with no
        reference leaves the pool's cached tier, unlinked in place): the hits and how
        many left the cached tier, which the caller hands to ``BlockPool.claimed``, or
        to ``BlockPool.unclaim`` to undo it exactly. None, with nothing done, when this
        index cannot do it in one pass for these keys (then ``match``). With a tier below,
        the hits are the device's only; the caller checks whether the tier continues them.
        ``data``: ``chunks`` in one piece, ``b"".join(chunks)`` or a longer bytes that
        starts with it (a prompt's token bytes: ``Prompt.data``): many blocks recorded
        together are compared with it at once."""

    def prepare(self, req: Request, first: int, last: int, parent: Block | None) -> Prepared | None:
        """Everything needed to record full blocks ``first..last-1`` of ``req``, the
        first one's parent being ``parent`` (None for block 0) (token
        chunks, extra keys and, when ``hashing``, chain hashes). Changes nothing; raises
        ConfigError if a hash_mode callable fails, so nothing is half done."""

    hash_may_fail: bool
    """Whether ``prepare`` may raise (a caller's hash callable): batch calls then prepare
    every block before changing anything."""

    def prepare_next(self, req: Request, token: int) -> Prepared | None:
        """``prepare`` for the one block that ``token``, appended next, fills."""

    def store(self, req: Request, first: int, prepared: Prepared | None,
              data: bytes | None = None) -> None:
        """Record the content of ``req.blocks[first:...]`` from ``prepare`` and make it
        findable; a content already held by another block makes this block a spare.
        ``data``: the chunks' bytes in one piece, when the caller has them."""

    def store_filled(self, req: Request, j: int) -> None:
        """``prepare`` and ``store`` of block ``j``, which the token just appended to
        ``req`` filled (decode). Only when ``hash_may_fail`` is False."""

    def drop(self, blocks: Sequence[Block], skip: Sequence[tuple[int, int]] = (),
             keyless: Keyless | None = None) -> None:
        """Remove each block's identity (the eviction step, or KV never computed).
        ``skip``: the spans ``(lo, hi)`` of ``blocks`` that are pending runs' (no key),
        evicted; ``keyless``: their content, the spans' records (``core.keyless``), when
        a tier below keeps it (``RunCounts.spans``)."""

    def drop_one(self, block: Block) -> None:
        """``drop((block,))``."""

    def uncache(self, blocks: Sequence[Block], cut: bool = False) -> list[Block]:
        """Make held ``blocks`` unfindable: their KV was never computed. ``cut``: blocks
        after them in their requests may stay findable. A content that leaves the index
        takes its cached descendants with it; returns those that were free (now empty),
        for ``BlockPool.emptied``."""

    def release_spare(self, block: Block) -> Block | None:
        """Forget a spare whose last reference went; returns the block now holding that
        content if it sits free (its recency is refreshed by the caller)."""

    def snapshot(self, blocks: Sequence[Block]) -> list[Event]:
        """One BlockStored per content that a block of ``blocks`` (the pool's) holds, spares
        aside, parents before children."""

    def clear(self) -> None:
        """Forget every content (the caller ensures no block is held)."""

    def check(self, blocks: Sequence[Block]) -> str | None:
        """The first inconsistency between the index and ``blocks``, None when sound."""

    def check_request(self, req: Request, block_size: int) -> str | None:
        """The first full scheduled block of ``req`` not holding the request's own
        content, None when sound."""

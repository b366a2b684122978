"""``Chains``: what the scheduler side of ``PrefixKVConnector`` names each request's full
blocks by (no vLLM import; vLLM's ``Request`` read by attribute).

A request's block ``i`` is named by prefixkv's chain hash over its tokens and extra keys
up to the block's end (``prefixkv.hashing.chain`` from the configured root), with the
token bytes and extra-key bytes a worker checks a value against. ``ConnectorScheduler``
asks three things of it::

    of(request, n)             the request's chain (made when it has none), named up
                               to n full blocks
    name(chain, n)             name more of a chain (a streaming session's new
                               multimodal inputs read again first)
    run(chain, a, b, ids, tag) blocks [a, b) in device blocks ids, as the workers get
                               them (``BlockRun``)

and keeps, on each ``Chain``, how far the request is in the store (``saved``, ``bad``,
``offered``, ``stale``: connector_scheduler.py says when each moves).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...extra_keys import ExtraKeys
from ...hashing import HashFn, chain, encode_tokens, token_bytes
from .connector_meta import BlockRun
from .requests import extra_keys_of


class Chain:
    """A request's full blocks as named so far, and how far they are in the store."""

    __slots__ = ("request", "extra", "num_mm", "hashes", "chunks", "extras", "saved", "bad",
                 "offered", "stale")

    def __init__(self, request: Any, extra: ExtraKeys | None) -> None:
        self.request, self.extra = request, extra
        self.num_mm = num_mm(request)  # the request's inputs when ``extra`` was read
        self.hashes: list[bytes] = []
        self.chunks: list[bytes] = []
        self.extras: list[bytes] = []
        self.saved = 0  # blocks [0, saved) are in the store or another request's to save
        # the first block a load of this request failed at, until the request saves it
        self.bad: int | None = None
        # a load answered to vLLM and not stated yet (``update_state_after_alloc`` not
        # called since): vLLM may count its tokens computed before any was loaded
        self.offered = False
        # known before a reset (``ConnectorScheduler.reset``): its KV is never saved
        self.stale = False


class Chains(dict[str, Chain]):
    """Request id -> its chain (a plain dict to read, pop and iterate); blocks of
    ``block_size`` tokens named by chain hash ``fn`` from ``root``."""

    __slots__ = ("_fn", "_root", "_bs")

    def __init__(self, fn: HashFn, root: bytes, block_size: int) -> None:
        super().__init__()
        self._fn, self._root, self._bs = fn, root, block_size

    def of(self, request: Any, num_blocks: int) -> Chain:
        """The request's chain (made and kept when it has none, or when it is another
        ``Request`` of the same id), named up to ``num_blocks`` full blocks."""
        c = self.get(request.request_id)
        if c is None or c.request is not request:
            c = self[request.request_id] = Chain(request, extra_keys_of(request, self._bs))
        return self.name(c, num_blocks)

    def name(self, c: Chain, num_blocks: int) -> Chain:
        """Name chain ``c``'s full blocks up to ``num_blocks`` (hashes, token bytes,
        extra-key bytes). A streaming session's update (one vLLM Request for every
        chunk) may have added multimodal inputs since the request's extra keys were
        read: they are read again, and the blocks named so far are kept up to the first
        whose extra-key bytes changed (none, as vLLM places the new inputs past them)."""
        if num_mm(c.request) != c.num_mm:
            c.extra, c.num_mm = extra_keys_of(c.request, self._bs), num_mm(c.request)
            named = len(c.hashes)
            now = (c.extra.block_bytes(named, self._bs) if c.extra is not None
                   else [b""] * named)
            same = next((i for i in range(named) if now[i] != c.extras[i]), named)
            del c.hashes[same:], c.chunks[same:], c.extras[same:]
            c.saved = min(c.saved, same)
        have = len(c.hashes)
        if num_blocks > have:
            bs = self._bs
            tokens = list(c.request.all_token_ids[have * bs:num_blocks * bs])
            extras = (c.extra.block_bytes(num_blocks, bs)[have:] if c.extra is not None
                      else [b""] * (num_blocks - have))
            parent = c.hashes[-1] if have else self._root
            hashes, chunks = chain(self._fn, parent, token_bytes(encode_tokens(tokens)), extras)
            c.hashes += hashes
            c.chunks += chunks
            c.extras += extras
        return c

    def run(self, c: Chain, start: int, end: int, block_ids: Sequence[int], tag: bytes) -> BlockRun:
        """Blocks ``[start, end)`` of chain ``c`` (named that far) in device blocks
        ``block_ids``, their keys carrying ``tag`` (``BlockRun.tag``)."""
        return BlockRun(c.request.request_id, c.extra.cache_salt if c.extra else None,
                        c.hashes[start - 1] if start else self._root,
                        tuple(c.hashes[start:end]), tuple(c.chunks[start:end]),
                        tuple(c.extras[start:end]), tuple(block_ids), tag)


def num_mm(request: Any) -> int:
    """How many multimodal inputs ``request`` has now (a streaming session adds some)."""
    return len(getattr(request, "mm_features", None) or ())

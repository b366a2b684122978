"""Per-request state kept by the manager (never the engine's own object)."""

from __future__ import annotations

from array import array
from collections.abc import Hashable

from .block import Block
from .errors import InvariantError
from .events import BlockStored
from .extra_keys import ExtraKeys
from .hashing import HashFn, chain, encode_tokens, token_bytes


_ROOM = encode_tokens([0] * 64)  # the canonical token array type, 64 slots


class Request:
    """``tokens``: every known token id (prompt, then generated), uint32.
    ``blocks``: blocks covering ``[0, num_scheduled)``. ``hashes``/``chunks``: chain hash
    and token bytes of full blocks, at least those full within ``num_scheduled`` (the
    prompt's are computed at admission). ``extras``: each prompt block's extra-key
    encoding; blocks past the prompt use ``base``."""

    __slots__ = ("request_id", "tokens", "extra", "block_size", "base", "extras", "blocks",
                 "hashes", "chunks", "num_cached", "num_scheduled")

    def __init__(self, request_id: Hashable, tokens: array, extra: ExtraKeys | None,
                 block_size: int) -> None:
        self.request_id = request_id
        # Grow the array once now, while admission is paying for the prompt anyway: array
        # over-allocates on growth and keeps the room when shrunk, so the first decoded
        # tokens do not copy a long prompt (~50 µs for 32k tokens here).
        n = len(tokens)
        tokens.extend(_ROOM)
        del tokens[n:]
        self.tokens = tokens
        self.extra = extra
        self.block_size = block_size
        num_prompt_blocks = -(-len(tokens) // block_size)
        if extra is None:
            self.base = b""
            self.extras = [b""] * num_prompt_blocks
        else:
            self.base = extra.base_bytes()
            self.extras = extra.block_bytes(num_prompt_blocks, block_size)
        self.blocks: list[Block] = []
        self.hashes: list[bytes] = []
        self.chunks: list[bytes] = []
        self.num_cached = 0  # tokens of the prefix computed by others (hits, fork parent)
        self.num_scheduled = 0

    def hash_through(self, fn: HashFn, root: bytes, last: int) -> None:
        """Extend ``hashes`` and ``chunks`` to cover full blocks ``0..last-1``."""
        first = len(self.hashes)
        if first >= last:
            return
        bs = self.block_size
        hashes, chunks = chain(fn, self.hashes[-1] if first else root,
                               token_bytes(self.tokens[first * bs:last * bs]),
                               self.extras_for(first, last))
        self.hashes += hashes
        self.chunks += chunks

    def extra_of(self, j: int) -> bytes:
        return self.extras[j] if j < len(self.extras) else self.base

    def extras_for(self, first: int, last: int) -> list[bytes]:
        """Extra-key encodings of blocks ``first..last-1``."""
        out = self.extras[first:last]
        return out + [self.base] * (last - first - len(out))

    def block_stored(self, j: int) -> BlockStored:
        """The event for full block ``j`` becoming findable."""
        start, end = j * self.block_size, (j + 1) * self.block_size
        return BlockStored(self.hashes[j], self.hashes[j - 1] if j else None,
                           tuple(self.tokens[start:end]), self.blocks[j].block_id,
                           self.extra.for_range(start, end) if self.extra else None)

    def copy(self, request_id: Hashable) -> Request:
        """A child with the same tokens, keys and hashes; blocks are set by the caller."""
        child = Request.__new__(Request)
        child.request_id = request_id
        child.tokens = array(self.tokens.typecode, self.tokens)
        child.extra, child.base, child.extras = self.extra, self.base, self.extras
        child.block_size = self.block_size
        child.blocks = []
        child.hashes = list(self.hashes)
        child.chunks = list(self.chunks)
        child.num_scheduled = self.num_scheduled
        child.num_cached = self.num_scheduled - self.num_scheduled % self.block_size
        return child

    def check(self, block_size: int, caching: bool) -> None:
        """Raise InvariantError unless the blocks match this request's tokens."""
        want = -(-self.num_scheduled // block_size)
        if len(self.blocks) != want or self.num_scheduled > len(self.tokens):
            raise InvariantError(
                f"request {self.request_id!r}: {len(self.blocks)} blocks for "
                f"{self.num_scheduled} scheduled tokens (want {want}), {len(self.tokens)} known")
        if not caching:
            return
        for j in range(self.num_scheduled // block_size):
            b = self.blocks[j]
            chunk = token_bytes(self.tokens[j * block_size:(j + 1) * block_size])
            if b.tokens != chunk or b.extra != self.extra_of(j) or b.cid == 0:
                raise InvariantError(
                    f"request {self.request_id!r} block {j} (id {b.block_id}) does not hold "
                    f"the request's tokens")
            parent_cid = self.blocks[j - 1].cid if j else 0
            if b.parent_cid != parent_cid:
                raise InvariantError(
                    f"request {self.request_id!r} block {j}: parent content {b.parent_cid} "
                    f"!= {parent_cid}")

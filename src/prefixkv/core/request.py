"""Per-request state kept by the manager (never the engine's own object).

A request is its content (token ids and the keys that, with them, determine its KV:
``RequestKeys``, shared with its forks) and its block table (blocks and counters)::

    | cached prefix (hits) | scheduled, computed by the engine | known, not scheduled |
    0                num_cached                       num_scheduled          len(tokens)

    blocks cover [0, max(num_scheduled, num_reserved)): reserved slots are positions
    scheduled before their token is known (lookahead, asynchronous scheduling).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Hashable, Mapping, Sequence
from operator import attrgetter
from typing import Protocol, TypeVar

from ..errors import RequestError
from ..extra_keys import ExtraKeys
from ..hashing import encode_tokens
from .block import Block, blocks_for

_ROOM = encode_tokens([0] * 64)  # the canonical token array type, 64 slots
GROW_AT = 4096
"""Token arrays at least this long are grown at admission (``grow_room``); below it the
copy that growing avoids costs about what growing does."""


def grow_room(tokens: array[int]) -> None:
    """Grow a long token array once (a request's, at admission or in ``prepare``), so
    that the first tokens appended to it do not copy it: array over-allocates on growth
    and keeps the room when shrunk (~50 µs for 32k tokens here)."""
    n = len(tokens)
    tokens.extend(_ROOM)
    del tokens[n:]


class RequestKeys:
    """What besides the tokens enters a block's content, per block: ``base`` (the tagged
    LoRA and salt bytes, on every block) and, when the prompt has multimodal inputs,
    ``mm[j]``: base plus the inputs overlapping prompt block j. Immutable; forks share it."""

    __slots__ = ("extra", "base", "mm")

    def __init__(self, extra: ExtraKeys | None, num_prompt_blocks: int, block_size: int) -> None:
        self.extra = extra
        self.base = extra.base_bytes() if extra is not None else b""
        self.mm = (extra.block_bytes(num_prompt_blocks, block_size)
                   if extra is not None and extra.mm else None)

    @classmethod
    def of(cls, extra: ExtraKeys | None, num_prompt_blocks: int, block_size: int) -> RequestKeys:
        """``RequestKeys(...)``, shared by every request without extra keys (it is
        immutable and then depends on nothing)."""
        if extra is None:
            return PLAIN_KEYS
        return cls(extra, num_prompt_blocks, block_size)

    def of_blocks(self, first: int, last: int) -> list[bytes]:
        """Extra-key bytes of blocks ``first..last-1``."""
        mm = self.mm
        if mm is None:
            return [self.base] * (last - first)
        out = mm[first:last]
        return out + [self.base] * (last - first - len(out))

    def for_event(self, j: int, block_size: int) -> ExtraKeys | None:
        """The ExtraKeys that entered block j's hash (only its own multimodal inputs)."""
        return None if self.extra is None else self.extra.for_range(j * block_size,
                                                                    (j + 1) * block_size)


PLAIN_KEYS = RequestKeys(None, 0, 1)


class Request:
    """``tokens``: every known token id (prompt, then generated), uint32; ``keys``: its
    RequestKeys; ``blocks``: its block table. ``prompt_chunks``: the token bytes of each
    full prompt block while admission runs (then None); while it runs too, when the
    prompt was prepared: ``prompt``, the ``Prompt`` (compared by identity only), and
    ``prompt_hashes``, the chain hashes of the full blocks if it holds them; a prepared
    prompt's chunks and hashes are kept until its prefill is fully scheduled (its
    ``extend`` calls read them). No ``__init__``: ``new_request`` makes one (``add_request``'s
    common case sets the fields itself), as ``Run``."""

    __slots__ = ("request_id", "tokens", "keys", "blocks", "num_cached", "num_scheduled",
                 "num_reserved", "prompt_chunks", "prompt", "prompt_hashes")

    request_id: Hashable
    tokens: array[int]
    keys: RequestKeys
    blocks: list[Block]
    num_cached: int  # tokens of the prefix computed by others (hits, fork parent)
    num_scheduled: int
    num_reserved: int  # slots covered by blocks; >= num_scheduled when reserved
    prompt_chunks: Sequence[bytes] | None
    prompt: object
    prompt_hashes: list[bytes] | None

    def fork(self, request_id: Hashable, block_size: int) -> Request:
        """A child with a copy of the tokens, the same keys and counters; no blocks.
        Its cached prefix is the parent's full blocks (computed by the parent)."""
        child = new_request(request_id, array(self.tokens.typecode, self.tokens), self.keys)
        child.num_scheduled = self.num_scheduled
        child.num_reserved = self.num_reserved
        child.num_cached = self.num_scheduled - self.num_scheduled % block_size
        return child

    def check(self, block_size: int) -> str | None:
        """The first way the block table disagrees with the tokens, None when sound."""
        covered = max(self.num_scheduled, self.num_reserved)
        want = blocks_for(covered, block_size)
        if len(self.blocks) != want or self.num_scheduled > len(self.tokens):
            return (f"request {self.request_id!r}: {len(self.blocks)} blocks for {covered} "
                    f"slots (want {want}), {self.num_scheduled} scheduled, "
                    f"{len(self.tokens)} known")
        return None


def new_request(request_id: Hashable, tokens: array[int], keys: RequestKeys) -> Request:
    """A ``Request`` with no blocks yet, nothing cached or scheduled."""
    req = Request()
    req.request_id, req.tokens, req.keys = request_id, tokens, keys
    req.blocks = []
    req.num_cached = req.num_scheduled = req.num_reserved = 0
    req.prompt_chunks = req.prompt = req.prompt_hashes = None
    return req


class _Live(Protocol):
    """What ``step_requests`` reads of a request (``Request``, ``GroupRequest``)."""

    @property
    def request_id(self) -> Hashable: ...
    @property
    def tokens(self) -> array[int]: ...
    @property
    def num_scheduled(self) -> int: ...


_R = TypeVar("_R", bound=_Live)
_SCHEDULED = attrgetter("num_scheduled")
_TOKENS = attrgetter("tokens")


def step_requests(live: Mapping[Hashable, _R], get: Callable[[Hashable], _R], prefilling: int,
                  request_ids: Sequence[Hashable], token_ids: Sequence[int]) -> list[_R]:
    """The requests of a decode step (``live[id]`` each; ``get``: the lookup that raises
    RequestError for an unknown id), checked: as many ids as tokens, each known, once,
    and with its prefill fully scheduled (checked while ``prefilling`` is nonzero)."""
    try:
        k = len(request_ids)
        same = k == len(token_ids) and not isinstance(request_ids, (str, bytes))
    except TypeError:
        raise RequestError("request_ids and token_ids must be sequences") from None
    if not same:
        raise RequestError(f"{k} request ids for {len(token_ids)} tokens (ids must be a "
                           f"sequence, not a str)")
    try:
        reqs = list(map(live.__getitem__, request_ids))
        # num_scheduled <= len(tokens) always: equal sums mean every prefill is done
        # (checked only while some live request is still prefilling)
        if prefilling and (sum(map(_SCHEDULED, reqs)) != sum(map(len, map(_TOKENS, reqs)))):
            raise KeyError(None)
    except Exception:  # an unknown or unhashable id, or a prefill not fully scheduled
        reqs = [get(r) for r in request_ids]
        r = next(r for r in reqs if r.num_scheduled != len(r.tokens))
        raise RequestError(f"request {r.request_id!r} has prompt tokens not yet "
                           f"scheduled: call extend() first") from None
    if k > 1 and len(set(reqs)) != k:  # requests hash by identity: cheaper than ids
        raise RequestError("a request id appears twice in one step")
    return reqs

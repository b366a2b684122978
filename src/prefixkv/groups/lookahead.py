"""Lookahead keys on the hybrid manager (``hash_lookahead_tokens`` = L > 0: vLLM 0.33's
``num_hash_lookahead_tokens`` beside a Mamba group; docs/lookahead.md).

As the plain manager's (``core.lookahead``), hash block ``j``'s extra-key bytes are
followed by ``hashing.lookahead_bytes`` of the L tokens after it, so its prefix id (and
every group's block under it, a Mamba state or a partial entry at its end included)
names the prefix ``[0, (j+1)*h + L)``: a state at a boundary is found only by a reader
whose L tokens after the boundary are those of the request that computed it. The bytes
travel in the per-block keys (``core.lookahead.LookaheadKeys``, at the hash block), which
every path reads, so the paths of a manager without lookahead are not touched:

    prompt  | block 0 | block 1 | ... | block k-1 | L tokens | ...
    keys      mm[0]     mm[1]           mm[k-1]     (k = (known - L) // h)

A request's keys cover the hash blocks whose L following tokens are known: its prompt's
at admission, more as ``know_tokens`` hands it the tokens known since (a sampled token).
A request is scheduled as without lookahead (a Mamba state is where its step ends), but
its blocks get their prefix ids (and become findable, in every group) only once their
keys are known: a growth records up to them (``span``), ``know_tokens`` records the
scheduled blocks whose keys it completes (a Mamba group's block whose state is at its end,
``GroupRequest.states``, while the request still holds it; a state its step left before
then is never found, as vLLM's block freed before its hash exists). So
``len(req.nodes)`` is ``min(num_scheduled // h, len(keys.mm))``. No block past the keys
is ever keyed: recording one raises RequestError, nothing changed (``check_keyed``, a
path that does not wait for the keys: the one-size manager's); a walk past them uses the
base bytes, which no block has, so finds nothing. Served by the sized manager (groups of
different block sizes).

Functions of the manager ``self`` (``HybridKVCacheManager`` calls them where it encodes
a prompt, takes a prepared one or records blocks).
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from ..core.lookahead import LookaheadKeys, lookahead_keys
from ..core.request import RequestKeys
from ..errors import PromptError, RequestError
from ..hashing import encode_tokens
from .request import GroupRequest

if TYPE_CHECKING:
    from .manager import HybridKVCacheManager

__all__ = ["check_keyed", "check_prompt", "know_tokens", "prompt_keys", "span"]


def prompt_keys(self: HybridKVCacheManager, tokens: array[int], own: RequestKeys) -> LookaheadKeys:
    """The lookahead keys of a prompt of ``tokens`` whose plain keys are ``own``."""
    return lookahead_keys(own, tokens, self._hash_size, self._lookahead)


def check_prompt(self: HybridKVCacheManager, keys: RequestKeys) -> None:
    """PromptError unless a prepared prompt's ``keys`` are this manager's lookahead keys."""
    if not isinstance(keys, LookaheadKeys) or keys.lookahead != self._lookahead:
        raise PromptError(f"this Prompt was not prepared with this manager's lookahead keys "
                          f"(hash_lookahead_tokens={self._lookahead}): prepare it with this manager")


def check_keyed(self: HybridKVCacheManager, req: GroupRequest, last: int) -> None:
    """RequestError unless hash blocks up to ``last`` of ``req`` have their lookahead
    keys (their L following tokens known); called before a block is recorded."""
    known = len(req.keys.mm)  # type: ignore[arg-type]
    if last > known:
        raise RequestError(
            f"request {req.request_id!r}: recording hash block {known} before its "
            f"{self._lookahead} lookahead tokens are known (know_tokens first, then "
            f"schedule up to the tokens known less {self._lookahead})")


def know_tokens(self: HybridKVCacheManager, request_id: Hashable, token_ids: Sequence[int]) -> None:
    """The request's known tokens: its own (scheduled or not) followed by those known
    since (a sampled token); those past its own are not scheduled. Under lookahead keys
    the hash blocks whose L following tokens are now known get their keys, and those
    scheduled their prefix ids (module docstring); without, it does nothing but find the
    request. Raises RequestError (unknown id; ``token_ids`` differing from the request's
    own tokens where they key its blocks: from its first block without keys on),
    TokenError (bad ids or container there); nothing changed then."""
    req = self._get(request_id)
    keys = req.keys
    if not self._lookahead:
        return
    assert isinstance(keys, LookaheadKeys), "a lookahead manager's request has lookahead keys"
    h, la, have = self._hash_size, self._lookahead, len(keys.mm)  # type: ignore[arg-type]
    start = have * h  # (the tokens from here key the new blocks: checked against the request's)
    window = encode_tokens(token_ids[start:], self.vocab_size)
    own = req.tokens[start:]
    if window[:len(own)] != own[:len(window)]:
        raise RequestError(f"request {request_id!r}: the known tokens differ from its own "
                           f"(from token {start} on)")
    if (len(token_ids) - la) // h <= have:
        return
    req.keys = lookahead_keys(keys.own, window, h, la, keys, start)
    first, last = span(self, req, req.num_scheduled // h)
    if last > first:  # (scheduled blocks whose keys were not known: recorded now)
        self._record(req, first, self._prepare(req, first, last, req.nodes[-1] if req.nodes else None,
                                               req.prompt))


def span(self: HybridKVCacheManager, req: GroupRequest, last: int) -> tuple[int, int]:
    """The hash blocks a growth of ``req`` to ``last`` hash blocks records: from its
    first without a prefix id, up to ``last`` within those whose keys are known."""
    return len(req.nodes), min(last, len(req.keys.mm))  # type: ignore[arg-type]

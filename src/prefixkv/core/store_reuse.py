"""A re-admission that reuses what its store fetch's start found and what the fetch
landed (``StoreWaits.reuse``) instead of walking the index again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..extra_keys import ExtraKeys
from ..hashing import encode_tokens
from ..store.fetch import Fetch
from ..tiers import HostTier
from .block import Block
from .prompt import Prompt
from .request import Request

__all__ = ["reuse", "taken_up", "unmoved"]


def reuse(f: Fetch, prompt: Sequence[int] | Prompt, extra: ExtraKeys | None, index: Any,
          host: HostTier, block_size: int) -> tuple[Request, list[Any], int] | None:
    """At the re-admission of ``f``'s request with ``prompt`` and ``extra``: the
    request as the start made it, what ``index.match`` would find now and how many
    of those are device blocks (they come first: the rest are host slots), without
    walking the index, when the prompt and keys are those the fetch started from (the
    same ``Prompt`` object; the list of ids the start was given, compared with a copy
    taken then, not encoded again: an id the caller replaced in its list by an equal
    value counts as unchanged; else one comparison of the token arrays) and nothing
    the start found or the fetch landed has moved: the start's hits and the landed
    run, each still holding the content it held, together reaching the request's last
    full block but one (nothing left to find past them), and the device not holding
    the content that follows its own hits (else its walk would go on there, and the
    hits would be its blocks). None when any of that fails (then
    ``match`` decides: the answer is the same, only slower). Changes nothing. Raises
    TokenError for a prompt the walk's encoding refuses (``vocab_size`` was checked at
    the start: a prompt equal to that one passes it). ``index``, ``host``, ``block_size``:
    the manager's content index, host tier and block size."""
    req: Request = f.req
    keys, hits, cids = req.keys, f.hits, f.cids
    if index.cut or len(hits) + len(cids) != (len(req.tokens) - 1) // block_size:
        return None  # (``cut``: the walk may find device blocks again after slots; a run
        # that lost its head, or found nothing, is shorter: the prompt is not encoded)
    if isinstance(prompt, Prompt):  # (its manager checked its configuration and ``extra``)
        if prompt is not req.prompt and (prompt.tokens != req.tokens or (
                prompt.keys is not keys and prompt.keys.extra != keys.extra)):
            return None  # (the same Prompt object: nothing to encode or compare)
    elif ((prompt != f.ids if f.ids is not None and prompt is f.ids_given
           else encode_tokens(prompt) != req.tokens)  # (``ids``: None without a list)
          or (extra is not keys.extra and (type(extra) is not ExtraKeys or extra != keys.extra))):
        return None
    devices = f.devices
    if f.on_device and devices is not None:  # the hits and the run on the device, held
        hits = f.held  # by the fetch (the host's hits went up at the landing)
    # each still holds its content (a device hit that does is still the index's entry
    # for it: only ``uncache`` makes one a spare, and then ``index.cut`` is set)
    for b, c in zip(hits, f.hit_cids, strict=True):
        if b.key is None or b.content_id != c:
            return None
    if f.on_device and devices is not None:  # (held since they landed: they hold it)
        if f.on_device == len(devices) and f.blocks is not None:  # the start's list,
            return req, f.blocks, len(f.blocks)  # held and run: no per-block work
        landed = devices if f.on_device == len(devices) else devices[:f.on_device]
        return req, hits + landed, len(hits) + len(landed)  # (the walk's limit: no
        # block after them is looked for)
    if f.on_device:  # the run landed on the device, which gave it back: its slots went
        return None  # keyless (in transit), and may be the tier's empty stack by now
    landed = f.slots if len(cids) == len(f.slots) else f.slots[:len(cids)]
    if f.landed_at != host.num_unpins:  # (else pinned since they landed: they do)
        c = cids.start  # (one loop, no pair or int objects: measured faster than maps)
        for s in landed:
            if s.key is None or s.content_id != c:
                return None
            c += 1
    d = list(map(type, hits)).count(Block)  # the device's hits come first
    chunks = req.prompt_chunks
    assert chunks is not None, "a fetch of a request without its chunks"
    mm = keys.mm
    if index.holds(hits[d - 1] if d else None, chunks[d],
                   keys.base if mm is None or d >= len(mm) else mm[d]):
        return None
    return req, hits + landed, d


def taken_up(f: Fetch, hits: Sequence[Any]) -> int:
    """How many of a re-admission's ``hits`` (in block order) are the device blocks the
    start of ``f`` took its host hits up into (``store_landing.promote``: the last
    ``f.promoted`` of ``f.front``), each at its place and still holding the content it
    took up: loaded for this request, so host hits, also when the run did not land on
    the device (a lost race, a failed check: the fetch gave them back, cached)."""
    first, front, cids = f.first, f.front, f.hit_cids
    return sum(1 for i in range(first - f.promoted, min(first, len(hits)))
               if hits[i] is front[i] and hits[i].content_id == cids[i])


def unmoved(f: Fetch, n: int, index: Any, block_size: int) -> bool:
    """``reuse``'s checks for a fetch ``f`` whose run landed whole on the device, held
    (``Fetch.blocks``), at a re-admission with the start's Prompt object (``n`` tokens):
    whether ``reuse`` would answer ``Fetch.blocks`` (True) or None. Changes nothing."""
    blocks: list[Any] = f.blocks  # type: ignore[assignment]  # (the hits and the run, held:
    if index.cut or len(blocks) != (n - 1) // block_size:  # as many as ``reuse``'s ``hits``
        return False  # and ``cids``)
    held = f.held  # (the run's blocks: held since they landed) (no ``strict``: a keyword
    assert len(held) == len(f.hit_cids), (held, f.hit_cids)  # C parses on a cold path)
    for b, c in zip(held, f.hit_cids):  # noqa: B905
        if b.key is None or b.content_id != c:
            return False
    return True

"""A store fetch gives up its device holds on blocks whose KV was declared invalid.

A fetch that lands on the device holds device blocks (``StoreWaits.start``): its device
hits (``Fetch.held``, with the blocks its host hits went up to) from the start, and,
once it landed, the run's blocks (``Fetch.devices[:on_device]``), until its request is
admitted again. A live request may hold the same blocks: the one that computed the
hits, or one that hit the landed run before the fetch's request came back. When the
engine declares such a block's KV invalid (``uncache_blocks``) or takes that request
back to recompute it (``rewind``), the fetch's hold must not keep the block, nor refuse
the rewind (the engine cannot free a fetch): the fetch gives up that block and every
block after it in its chain (their KV was computed on top of it), and keeps the valid
prefix before it.

- In flight (not landed): the given-up hits go back at once, with the empty block the
  fetch took for the tokens after the run (``tail``: no thread writes it). Its run's
  blocks (``devices``) stay held until it lands: the fetcher's thread may be filling
  them (``fill_device``), and a block it no longer held could be another request's by
  then. The landing then finds that the fetch holds less than the prefix before its
  run (``len(held) < first``) and lands the run in its host slots alone, if its chain
  is there again by then, giving every device block back (``store_landing.land``, as
  after a lost race). When no hit is left (nothing valid remains), the request's wait
  ends: ``poll`` lists it at once (as past its deadline), and its admission computes
  what it does not find.
- Landed: the fetcher is done with the blocks; the given-up ones go back at once, with
  ``tail``. The run's landed part (``on_device``, and ``cids``: what the re-admission
  counts as fetched) shrinks to the kept blocks, so ``StoreWaits.reuse`` declines and
  the re-admission walks the index.

Nothing here writes a block's content: ``uncache`` does, in the index (``rewind`` gives
the holds up before it, so that the blocks are the request's alone and lose their
content rather than becoming spares; ``uncache_blocks`` after it, as when another
request holding a named block is freed).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..store.fetch import Fetch
from .block import Block
from .store_waits import StoreWaits

__all__ = ["give_up", "held_by_others"]


def held_by_others(waits: StoreWaits | None, blocks: Sequence[Block]) -> list[Block]:
    """Of a request's ``blocks``, those another live request holds too: a reference
    besides the request's own and the store fetches' (which ``give_up`` takes back)."""
    shared = [b for b in blocks if b.ref_cnt > 1]
    if not shared or waits is None or not waits.held.holders:
        return shared
    fetches: dict[int, int] = {}
    for b in waits.held.holds():
        fetches[id(b)] = fetches.get(id(b), 0) + 1
    return [b for b in shared if b.ref_cnt - fetches.get(id(b), 0) > 1]


def give_up(waits: StoreWaits, blocks: Iterable[Block], lost: bool) -> None:
    """Every fetch of ``waits`` that holds one of ``blocks`` (or, with ``lost``, a block
    that lost its findable content: no key, or made a spare by ``uncache``) gives it up,
    with every block after it in its chain (see the module's docstring). A block of a
    pending run has no key yet but holds its content: ``uncache`` writes every run it
    takes content from, so a run still pending lost none (a path that took a run's
    content and left it pending, its head's content taken, its head's child rewritten, the
    run broken or off the index's list, fails ``check_invariants``:
    tests/test_pending_loss_caught.py). Called on the scheduler's thread."""
    bad = {id(b) for b in blocks}
    for f in list(waits.held.holders):
        chain = f.held
        if f.ended and f.devices:
            chain = chain + f.devices[:f.on_device]
        for k, b in enumerate(chain):
            if id(b) in bad or lost and (b.twin or b.key is None and (
                    b.counted is None or not b.counted.pending)):
                _cut(waits, f, k)
                break


def _cut(waits: StoreWaits, f: Fetch, k: int) -> None:
    """``f`` keeps the first ``k`` blocks of its chain (hits, then the landed run) and
    gives the rest back to the pool, with ``tail``, tail of the chain first."""
    held, d = f.held, len(f.held)
    out: list[Block] = f.tail  # (a list of the fetch's own, no longer its ``tail``)
    f.tail, f.blocks = [], None  # (``blocks``: the request's list no longer)
    if k < d:  # (the host hits that went up at the start: the last of ``held``)
        f.promoted = max(0, f.promoted - (d - k))
    if not f.ended:  # (``devices``: the fetcher's until it lands)
        out += held[k:][::-1]
        f.held = held[:k]
        if not k and waits.waiting.get(f.request_id) is f and not f.expired:
            f.expired = True  # nothing valid remains: the request computes
            waits.given_up.append(f)
    else:
        kept = max(0, k - d)  # of the landed run
        run = f.devices[:f.on_device] if f.devices else []
        out += run[kept:][::-1]
        if k < d:
            out += held[k:][::-1]
            f.held = held[:k]
        f.on_device, f.cids = kept, f.cids[:kept]
        if not kept:
            f.devices = None
        if not f.held and not kept:
            waits.held.holders.discard(f)
    waits.pool.release(out)

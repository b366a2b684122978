"""The step's fork copies: copy-on-write of a forked parent's partial (and reserved)
blocks into its child's fresh blocks, pending until the plan is taken.

The engine runs a plan in order, after the step's scheduling calls: offloads, store ops,
loads, then these copies; the forward pass comes after. The copies are kept a *closed
set*, whatever is forked and freed in between (``check`` verifies each rule):

1. A copy's source is pinned (the plan holds a reference on it), so no allocation of the
   step takes it: it could be a load's target, and loads run before copies.
2. A copy's destination is held: by a request, or by the plan, because it is the source
   of a later copy (a fork of a fork: ``0 -> 1``, then ``1 -> 2``) or because its content
   is findable (a request may hit it in this step and read what the copy writes). So no
   allocation of the step takes it either. A destination held for its content is held
   as its request held it: with the blocks before it in the freed request's table, the
   prefix its content was computed on, released with it when the plan is taken, tail
   first. (Held alone, its prefix could be evicted before it: a block found with its
   parent's content gone, which no lookup reaches while the events still announce it,
   so a router that sees the parent stored again counts a hit that ``lookup`` denies.)
3. A copy reads its source after the copy into that source, if the source received
   one in this step (the destination of a copy is a fresh block, never the source of an
   earlier copy), and that copy is still pending; no copy touches a block a load of the
   same plan writes.

When a freed request's block is the destination of a pending copy and nothing else
holds it, the copy is dropped (the block goes back to the pool and may be handed out
again in the same step) and the pin on its source is released, which may in turn drop
the copy into that source: ``settle``. A source so released goes back before the freed
request's blocks: it may hold content computed on them (its request filled it), so it is
evicted first, a child before its parent, as a request's own blocks are.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from itertools import pairwise

from ..results import BlockCopy
from .block import Block


class CopyPlan:
    """The pending ``BlockCopy``s of the step, in order, and the blocks the plan holds:
    ``pins``, one reference per copy on its source; ``kept``, for each destination held
    for its findable content, that block and the blocks before it in its freed request's
    table, tail first (one reference each: the order to release them in). ``fresh``: the
    ids of the step's copy destinations, less those that went back to the pool with their
    copy dropped."""

    __slots__ = ("copies", "pins", "kept", "fresh")

    def __init__(self) -> None:
        self.copies: list[BlockCopy] = []
        self.pins: list[Block] = []
        self.kept: list[list[Block]] = []
        self.fresh: set[int] = set()

    def add(self, sources: Sequence[Block], dests: Sequence[Block]) -> tuple[BlockCopy, ...]:
        """State the copy of each of ``sources`` into the block beside it in ``dests``
        (fresh blocks the child holds), pinning each source. Returns the copies."""
        copies = tuple(BlockCopy(s.block_id, d.block_id) for s, d in zip(sources, dests, strict=True))
        self.copies += copies
        self.fresh.update(d.block_id for d in dests)
        for s in sources:  # held until the plan is taken, even if the parent goes first
            s.ref_cnt += 1
        self.pins += sources
        return copies

    def settle(self, blocks: Sequence[Block], pool_blocks: Sequence[Block]) -> list[Block]:
        """A request holding ``blocks`` (its table, in token order) is being freed; call
        this before the pool drops its references. A block losing its last reference here
        that a pending copy writes: if its content is findable, the plan holds it, with
        the blocks before it in ``blocks`` (its prefix), and the copy stays; else the copy
        is dropped and the pin on the copy's source is released, which repeats the test
        for that source (at the same place in ``blocks``: a fork's copies keep the
        parent's places, and the child shares the blocks before them). Returns the
        sources unpinned, for the caller to release before ``blocks``."""
        into = {op.dst: op for op in self.copies}  # destinations are distinct (rule 2)
        going = Counter(b.block_id for b in blocks)  # references about to be dropped
        work = [(b, j) for j, b in enumerate(blocks) if b.block_id in into]
        unpinned: list[Block] = []
        while work:
            d, j = work.pop()
            if d.ref_cnt > going[d.block_id] or d.block_id not in into:
                continue  # still held after this free (or settled already)
            if d.key is not None and not d.twin:  # findable: a hit would read the copy
                held = [d, *blocks[j - 1::-1]] if j else [d]
                for b in held:
                    b.ref_cnt += 1
                self.kept.append(held)
                continue
            s = pool_blocks[into.pop(d.block_id).src]
            self.fresh.discard(d.block_id)
            self.pins.remove(s)
            unpinned.append(s)
            going[s.block_id] += 1
            if s.block_id in into:
                work.append((s, j))
        if unpinned:
            self.copies = [op for op in self.copies if op.dst in into]
        return unpinned

    def take(self) -> tuple[list[BlockCopy], list[Block]]:
        """The copies, in order, and the blocks to release now that the plan is taken;
        the plan is empty after."""
        out, pins = self.copies, self.pins
        for held in self.kept:  # (each a child before its parent: evicted in that order)
            pins += held
        self.copies, self.pins, self.kept = [], [], []
        self.fresh.clear()
        return out, pins

    def check(self, pool_blocks: Sequence[Block], loaded: Iterable[int]) -> str | None:
        """The first copy that breaks a rule of the closed set (``loaded``: the device
        blocks the plan's loads write), or a pin no copy accounts for; None when sound."""
        pins = Counter(b.block_id for b in self.pins)
        sources = Counter(op.src for op in self.copies)
        targets = list(loaded)
        loads = set(targets)
        if len(loads) < len(targets):
            twice = sorted(b for b, n in Counter(targets).items() if n > 1)
            return f"the plan's loads write blocks {twice} twice"
        read: set[int] = set()
        written: set[int] = set()
        for op in self.copies:
            if pins[op.src] < sources[op.src]:
                return f"{op}: its source is not pinned by the plan ({pins[op.src]} pins)"
            if not pool_blocks[op.dst].ref_cnt:
                return f"{op}: its destination is free (the step may hand it out)"
            if op.dst in written or op.dst in read:
                return f"{op}: its destination is written twice or read before it is written"
            if op.src in self.fresh and op.src not in written:
                return f"{op}: its source got its KV by a copy of this step that is gone"
            if op.src in loads or op.dst in loads:
                return f"{op}: a load of the same plan writes one of its blocks"
            read.add(op.src)
            written.add(op.dst)
        if written != self.fresh:
            return f"copies into {sorted(written)}, but {sorted(self.fresh)} are awaiting one"
        if pins != sources:
            bid = next(b for b in pins | sources if pins[b] != sources[b])
            return f"block {bid}: pinned {pins[bid]} times by the plan for {sources[bid]} copies"
        kept: set[int] = set()
        for held in self.kept:
            d = held[0]
            if d.block_id not in written or d.block_id in kept:
                return f"block {d.block_id} is held for a copy into it that is not pending"
            kept.add(d.block_id)
            if d.key is not None and not d.twin and (held[-1].parent_cid or any(
                    a.content_id != b.parent_cid for b, a in pairwise(held))):
                return f"block {d.block_id} is held for its content without its prefix"
        return None

"""``HostTier.check``: what ``check_invariants()`` verifies of the host tier. Builds
messages only for what is wrong."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..core.block import Block, key_chunk

if TYPE_CHECKING:
    from .host import HostTier


def _holds(tier: HostTier, s: Block) -> bool:
    """Whether slot ``s`` is the entry of its key in the tier's maps or, chained, in
    none of them (its key: its token bytes)."""
    key = s.key
    if isinstance(key, bytes):
        return (tier.by_chunk.get(key) is s) != s.chained
    return (key is not None and not s.chained and key == (s.parent_cid, key[1], s.extra)
            and tier.by_key.get(key) is s)


def _check_chains(tier: HostTier, landing: set[int]) -> str | None:
    """Each chained slot is the child of the slot holding its parent's content; the
    chained count; no two slots hold one content (``landing``: the ids of the slots a
    fetch writes into, whose keys, when filled, hold no content yet)."""
    held = [s for s in tier.slots if s.key is not None and s.block_id not in landing]
    parents = {(s.child.block_id, s.content_id) for s in held  # (children may be stale:
               if s.child.key is not None}  # verified below)
    contents: set[tuple[int, bytes, bytes]] = set()
    chained = 0
    for s in held:
        content = (s.parent_cid, key_chunk(s.key), s.extra)
        if content in contents:
            return f"two host slots hold the content of {s!r}"
        contents.add(content)
        if s.chained:
            chained += 1
            if (s.block_id, s.parent_cid) not in parents:
                return f"chained host slot {s!r} is not its parent slot's child"
    if chained != tier.num_chained:
        return f"host chained count {tier.num_chained} != {chained}"
    return None


def check_tier(tier: HostTier) -> str | None:
    """The first inconsistency of ``tier``'s slots, maps, pins and LRU links, None when
    sound: every slot is empty (no content, no pin), cached (in the LRU, unpinned) or
    pinned (once: ``ref_cnt`` 1; by this step or only by a plan in flight), at most
    once, or else landing (reserved for a store fetch, in no map, no key or, filled, its
    token bytes, count 0: the slots in no list, as many as ``num_landing`` counts), or
    in transit (keyless, count 0, in ``_transit`` or ``_flight_transit``);
    the runs landed in this step are pinned; the maps hold exactly the cached and pinned
    slots that are not chained; a slot
    keyed by its triple is the one ``find`` returns; chains (above)."""
    seen: set[int] = set()
    for s in tier.slots:  # (the tier writes ``refs`` itself: no slot's count is a run's)
        if s.counted is not None:
            return f"host slot {s!r} is counted through a run"
    for s in tier._empty:
        if s.key is not None or s.ref_cnt or s.chained:
            return f"bad empty host slot {s!r}"
        seen.add(s.block_id)
    for s in tier._cached:
        if s.ref_cnt or not _holds(tier, s):
            return f"bad cached host slot {s!r}"
        seen.add(s.block_id)
    emptied = 0  # pinned slots whose content the device's uncache dropped (``forget_under``)
    for s in tier._pinned:
        if s.ref_cnt != 1 or not (s.key is None or _holds(tier, s)) or s.block_id in seen:
            return f"bad pinned host slot {s!r}"
        emptied += s.key is None
        seen.add(s.block_id)
    for s in tier._flight:  # (pinned for a plan whose copies run, not by this step)
        if s.block_id in tier._flight_ids:
            if s.ref_cnt != 1 or not (s.key is None or _holds(tier, s)) or s.block_id in seen:
                return f"bad host slot {s!r} of the plan in flight"
            emptied += s.key is None
            seen.add(s.block_id)
    if emptied != tier.num_emptied:
        return f"{emptied} pinned host slots hold no content, counted {tier.num_emptied}"
    for s in tier._transit + tier._flight_transit:  # (a device run's payload: no content)
        if s.refs or s.key is not None or s.chained or s.block_id in seen:
            return f"bad host slot in transit {s!r}"
        seen.add(s.block_id)
    pinned = {s.block_id for s in tier._pinned}
    for run, ids in tier._landed:  # (``hold`` does not pin them again: they are pinned)
        if ids != [s.block_id for s in run] or not pinned.issuperset(ids):
            return f"host slots {ids} landed in this step but are not all pinned, or not those"
    landing = [s for s in tier.slots if s.block_id not in seen]  # (nowhere else)
    for s in landing:
        key = s.key
        if (s.ref_cnt or s.chained or not (key is None or type(key) is bytes)
                or (key is not None and tier.by_chunk.get(key) is s)):
            return f"bad landing host slot {s!r}"
    if len(landing) != tier.num_landing:
        return f"{len(landing)} host slots are in no list, {tier.num_landing} are landing"
    held = (len(tier.slots) - len(tier._empty) - tier.num_landing - emptied
            - len(tier._transit) - len(tier._flight_transit))
    if len(tier) != held:
        return f"host maps hold {len(tier)} for {held} slots"
    for key, s in tier.by_key.items():
        if tier.find(s.parent_cid, key[1], s.extra) is not s:
            return f"host slot {s!r} is keyed by its triple but not found by it"
    return (_check_chains(tier, {s.block_id for s in landing}) or tier._cached.broken_link()
            or tier.kids.check(tier.by_chunk, tier.by_key))


def check_parents(tier: HostTier, devices: Sequence[Block]) -> str | None:
    """The first slot with content (found: keyed, or chained) whose parent's content is
    neither on the device (a block with content among ``devices``, or one of a pending
    run's) nor in a slot with content: no lookup reaches it, yet its ``BlockStored`` is
    not withdrawn (an orphan). None when every one is reachable."""
    held = {s.content_id for s in tier.slots if _found(tier, s)}
    held.update(b.content_id for b in devices if b.key is not None)
    runs = {id(r): r for b in devices if (r := b.counted) is not None and r.pending}
    for r in runs.values():  # (their blocks' contents are their records')
        held.update(range(r.cid0, r.cid0 + len(r.blocks)))
    for s in tier.slots:
        if s.parent_cid and s.parent_cid not in held and _found(tier, s):
            return f"host slot {s!r} is found under content {s.parent_cid}, held nowhere"
    return None


def _found(tier: HostTier, s: Block) -> bool:
    """Whether slot ``s`` holds content a lookup may reach through it: chained, or its
    key's entry in the maps (a landing slot's key is in none)."""
    key = s.key
    if key is None:
        return False
    return s.chained or (tier.by_chunk.get(key) if type(key) is bytes
                         else tier.by_key.get(key)) is s  # type: ignore[arg-type]

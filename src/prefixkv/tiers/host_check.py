"""``HostTier.check``: what ``check_invariants()`` verifies of the host tier. Builds
messages only for what is wrong."""

from __future__ import annotations


def _holds(tier, s) -> bool:
    """Whether slot ``s`` is the entry of its key in the tier's maps."""
    key = s.key
    if type(key) is bytes:
        return tier.by_chunk.get(key) is s
    return key is not None and key == (s.parent_cid, key[1], s.extra) and tier.by_key.get(key) is s


def check_tier(tier) -> str | None:
    """The first inconsistency of ``tier``'s slots, maps, pins and LRU links, None when
    sound: every slot is empty (no content, no pin), cached (in the LRU, unpinned) or
    pinned, exactly once; the maps hold exactly the cached and pinned slots; a slot
    keyed by its triple is the one ``find`` returns."""
    seen = set()
    for s in tier._empty:
        if s.key is not None or s.ref_cnt:
            return f"bad empty host slot {s!r}"
        seen.add(s.block_id)
    for s in tier._cached:
        if s.ref_cnt or not _holds(tier, s):
            return f"bad cached host slot {s!r}"
        seen.add(s.block_id)
    for s in tier._pinned:
        if not s.ref_cnt or not _holds(tier, s) or s.block_id in seen:
            return f"bad pinned host slot {s!r}"
        seen.add(s.block_id)
    if len(seen) != len(tier.slots):
        return f"host slots accounted {len(seen)} != {len(tier.slots)}"
    if len(tier) != len(tier.slots) - len(tier._empty):
        return f"host maps hold {len(tier)} for {len(tier.slots) - len(tier._empty)} slots"
    for key, s in tier.by_key.items():
        if tier.find(s.parent_cid, key[1], s.extra) is not s:
            return f"host slot {s!r} is keyed by its triple but not found by it"
    return tier._cached.broken_link()

"""``ParentNotes`` (core/parent_notes.py), the allowance both ``Kids`` (device index keys)
and ``SlotKids`` (host tier slots) sweep by, with exact numbers: a sweep when ``noted``
passes ``limit`` (``FLOOR`` = 1024 at first), then an allowance of twice the live notes,
at least ``FLOOR``; and each subclass's sweep leaving exactly the live notes, once each."""

from __future__ import annotations

import pytest

from prefixkv.core.block import Block, ContentKey
from prefixkv.core.parent_notes import FLOOR, ParentNotes
from prefixkv.index.kids import Kids
from prefixkv.tiers.host_kids import SlotKids

NO_KEYS: dict[ContentKey, Block] = {}


class Kept(ParentNotes[int]):
    """Notes whose sweep keeps the items in ``live`` (each once), counting its sweeps."""

    __slots__ = ("live", "sweeps")

    def __init__(self, live: set[int]) -> None:
        super().__init__()
        self.live = live
        self.sweeps = 0

    def sweep(self, by_chunk: dict[bytes, Block], by_key: dict[ContentKey, Block]) -> None:
        self.sweeps += 1
        kept = {cid: [i for i in dict.fromkeys(items) if i in self.live]
                for cid, items in self.by_parent.items()}
        self.by_parent.clear()
        self.by_parent.update({cid: items for cid, items in kept.items() if items})
        self.swept()


def test_the_floor_is_1024_and_a_sweep_comes_at_the_note_past_it():
    assert FLOOR == 1024
    n = Kept(set(range(600)))
    assert (n.noted, n.limit, n.by_parent) == (0, 1024, {})
    for i in range(1024):
        n.note(1 + i % 2, i, {}, NO_KEYS)
    assert (n.sweeps, n.noted, n.limit) == (0, 1024, 1024)  # (at the limit: no sweep)
    n.note(1, 1024, {}, NO_KEYS)
    assert n.sweeps == 1
    # 600 live left (300 under each parent), allowed twice as many
    assert (n.noted, n.limit) == (600, 1200)
    assert n.by_parent == {1: list(range(0, 600, 2)), 2: list(range(1, 600, 2))}
    for i in range(600):
        n.note(3, 2000 + i, {}, NO_KEYS)
    assert (n.sweeps, n.noted) == (1, 1200)
    n.note(3, 5000, {}, NO_KEYS)
    assert (n.sweeps, n.noted, n.limit) == (2, 600, 1200)
    assert 3 not in n.by_parent  # (a parent left with no live note goes)


def test_the_allowance_is_never_below_the_floor():
    n = Kept({7})
    for _ in range(1025):
        n.note(5, 7, {}, NO_KEYS)  # one live item noted 1025 times: one note kept
    assert (n.sweeps, n.noted, n.limit, n.by_parent) == (1, 1, 1024, {5: [7]})


def test_grown_sweeps_past_the_limit_alone():
    # callers that note inline (append, count) and check once a batch
    n = Kept(set())
    n.by_parent[9] = list(range(1024))
    n.noted = 1024
    n.grown({}, NO_KEYS)
    assert n.sweeps == 0
    n.by_parent[9].append(1024)
    n.noted += 1
    n.grown({}, NO_KEYS)
    assert (n.sweeps, n.noted, n.limit, n.by_parent) == (1, 0, 1024, {})


def test_clear_and_the_count_check():
    n = Kept({1, 2})
    for i in range(1500):
        n.note(4, i % 3, {}, NO_KEYS)
    assert n.limit == 1024 and n.miscounted("notes") is None
    n.noted -= 1
    assert n.miscounted("notes") == "476 notes counted, 477 held"  # (2 kept at the sweep, 475 since)
    n.clear()
    assert (n.noted, n.limit, n.by_parent, n.miscounted("notes")) == (0, 1024, {}, None)


def test_the_base_sweeps_nothing_itself():
    with pytest.raises(TypeError):
        ParentNotes()  # type: ignore[abstract]


def blocks_under(parent: int, count: int) -> list[Block]:
    """``count`` blocks recorded under content ``parent``, keyed by their token bytes."""
    out = []
    for i in range(count):
        b = Block(i, key=i.to_bytes(4, "little"), parent_cid=parent, content_id=100 + i)
        out.append(b)
    return out


def test_kids_sweep_keeps_the_live_keys_once_each():
    live = blocks_under(5, 700)
    by_chunk = {b.key: b for b in live}
    assert all(type(k) is bytes for k in by_chunk)
    kids = Kids()
    for b in live:  # each live key noted twice, then 400 stale ones
        kids.note(5, b.key, by_chunk, NO_KEYS)  # type: ignore[arg-type]
        kids.note(5, b.key, by_chunk, NO_KEYS)  # type: ignore[arg-type]
    # the 1025th note swept: 513 distinct keys noted then, all live; 375 notes since
    assert (kids.noted, kids.limit) == (513 + 375, 1026)
    for i in range(400):
        kids.note(6, b"gone%d" % i, by_chunk, NO_KEYS)
    # past 1026 at note 139 of these: 700 live (each once) kept, then 261 more
    assert (kids.noted, kids.limit) == (700 + 261, 1400)
    assert kids.by_parent[5] == [b.key for b in live]
    assert len(kids.by_parent[6]) == 261
    assert kids.check(by_chunk, NO_KEYS) is None


def test_slot_kids_sweep_notes_the_maps_anew():
    slots = blocks_under(5, 700)
    by_chunk = {s.key: s for s in slots}
    kids = SlotKids()
    for s in slots:  # inline notes (the offload's), checked once a batch
        kids.by_parent.setdefault(5, []).extend((s, s))
        kids.noted += 2
    kids.grown(by_chunk, NO_KEYS)  # 1400 > 1024: the 700 keyed slots, once each
    assert (kids.noted, kids.limit, kids.by_parent) == (700, 1400, {5: slots})
    run = [Block(1000 + i, key=b"run%d" % i, parent_cid=5 if i == 0 else 2000 + i - 1,
                 content_id=2000 + i) for i in range(3)]
    by_chunk.update((s.key, s) for s in run)  # type: ignore[misc]
    kids.note_run(run, by_chunk, NO_KEYS)  # (slot i under slot i - 1's content)
    assert (kids.noted, kids.limit) == (703, 1400)
    assert kids.by_parent == {5: [*slots, run[0]], 2000: [run[1]], 2001: [run[2]]}
    assert kids.check(by_chunk, NO_KEYS) is None

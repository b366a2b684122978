"""prefixkv's HiSparse resident row and copies in flight (``groups.hisparse``) checked
against the reference of vLLM 0.33's page life-cycle (hisparse_model.py, itself checked
against vLLM's coordinator by test_vllm_hisparse_reference.py). The row decides and the
model acts: after every call, the pages the row plans, unpins and frees must be the ones
the model did, and its page states must be the model's. Needs no vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings

from prefixkv.errors import InvariantError, RequestError
from prefixkv.groups.hisparse.row import PageState, ResidentRow
from prefixkv.groups.hisparse.spills import Spills

from .hisparse_cases import ALL, SCENARIOS, STREAMS
from .hisparse_model import BS, MAX_LEN, Model, cdiv

DIRTY, IN_FLIGHT, CLEAN, UNPINNED, HOST = PageState


@dataclass
class RowModel(Model):
    """The model, with a ``ResidentRow`` told what happens and asked what to do."""

    r: ResidentRow = field(default_factory=ResidentRow)
    s: Spills = field(default_factory=lambda: Spills(MAX_LEN // BS))
    key: int = 0  # the request (a new one after each free)
    unpins: list[int] = field(default_factory=list)

    def sync(self) -> None:  # (the step grew the row, and may have taken the hot region)
        self.r.grow(len(self.row) - len(self.r))
        if self.can_read_from_host() and not self.r.hot:
            self.r.hold_hot()

    def pop(self, n: int) -> list[int]:
        before = dict(self.unpinned)
        out = super().pop(n)
        for block in out:
            if block in before:
                self.r.lose(before[block])
        return out

    def plan(self, sealed: int) -> None:
        self.sync()
        planned = self.r.plan(sealed, self.s.budget)
        tids = self.s.plan(self.key, planned)
        known = set(self.pending)
        super().plan(sealed)
        assert sorted(set(self.pending) - known) == tids and [self.pending[t] for t in tids] == planned
        assert self.s.to_send == self.to_send

    def unpin(self, page: int) -> None:
        before = len(self.unpinned)
        super().unpin(page)
        if len(self.unpinned) > before:
            self.unpins.append(page)

    def update_residency(self) -> None:
        expected = self.r.unpinnable()
        asks = self.r.asks_for_hot(len(self.gpu), max(self.hot_blocks, self.num_blocks // 10), self.window)
        asked = self.seen.get("asked for hot", 0)
        self.unpins = []
        super().update_residency()
        assert self.seen.get("asked for hot", 0) - asked == asks
        self.apply_unpins(expected)

    def report(self, enqueued: dict[int, int], completed: dict[int, int]) -> list[int]:
        done = self.s.report(enqueued, completed)
        assert super().report(enqueued, completed) == done
        return done

    def confirm(self, transfers: list[int]) -> None:
        pages = [self.pending[t] for t in sorted(transfers) if t in self.pending]
        expected = [p for p in pages if self.r.confirm(p)]
        self.unpins = []
        super().confirm(transfers)
        self.apply_unpins(expected)

    def apply_unpins(self, expected: list[int]) -> None:
        assert self.unpins == expected, (self.unpins, expected)
        for page in self.unpins:
            self.r.unpin(page)

    def free(self) -> None:
        row, busy, hot = list(self.row), len(self.orphans), len(self.hot)
        before = len(self.gpu)
        split = self.r.free()
        detached = self.s.detach(self.key)
        orphans = set(self.orphans)
        super().free()
        assert sorted(set(self.orphans) - orphans) == detached
        assert all(self.s.page_of(t)[0] is None for t in self.orphans)
        self.key += 1
        after = list(self.gpu)
        tail = [row[p] for p in split.to_tail]
        assert after[len(after) - len(tail):] == tail and len(after) >= before + len(tail)
        head = after[hot:hot + len(split.to_head)]  # (the hot region goes in front of them)
        assert head == [row[p] for p in reversed(split.to_head)]
        assert {b for b, _ in self.orphans.values()} >= {row[p] for p in split.kept}
        assert len(self.orphans) == busy + len(split.kept)  # (each kept page: one copy in flight)

    def check(self) -> None:
        self.r.check_invariants()
        self.s.check_invariants()
        assert self.s.in_flight == len(self.pending) + len(self.orphans)
        assert self.s.has_work() == bool(self.to_send or self.pending or self.orphans)
        assert all(self.s.page_of(t) == (self.key, p) for t, p in self.pending.items())
        lost = [p for p, b in enumerate(self.row) if not b]
        assert self.r.pages(HOST) == lost
        assert self.r.pages(UNPINNED) == sorted(self.unpinned.values())
        assert self.r.pages(CLEAN) == sorted(self.pinned_clean)
        assert self.r.pages(IN_FLIGHT) == sorted(self.pending.values())
        assert len(self.r) == len(self.row) and self.r.ready == self.ready
        busy = set(self.pending.values())
        assert self.r.pages(DIRTY) == sorted(set(range(len(self.row))) - self.valid - busy)


def run(num_blocks: int, host_blocks: int, hot_blocks: int, in_flight: int, prompt: int,
        ops: list[tuple[str, int]]) -> RowModel:
    """``ops`` as test_vllm_hisparse_reference.py runs them, on the model alone."""
    m = RowModel(num_blocks, host_blocks, hot_blocks, cdiv(min(in_flight, MAX_LEN), BS))
    for op, arg in ops:
        if op == "step":
            total = min(m.computed + arg, prompt)
            if total > m.computed:
                m.step(total)
        elif op in ("confirm", "halve"):
            assert m.s.take() == m.to_send
            m.to_send = []
            chosen = [t for k, t in enumerate(sorted([*m.pending, *m.orphans])) if arg >> (k % 16) & 1]
            m.report({t: 1 if op == "confirm" else 2 for t in chosen}, {t: 1 for t in chosen})
        elif op == "free":
            m.free()
        elif op == "take":
            m.take(min(arg, len(m.gpu)))
        else:
            m.give_back()
        m.check()
    return m


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_row_decides_as_the_reference_in_its_scenarios(name: str) -> None:
    shape, ops, expected = SCENARIOS[name]
    assert expected <= set(run(*shape, ops).seen)


def test_freeing_clean_pages_gives_them_back_tail_first() -> None:
    """Without a hot region nothing is unpinned: freeing gives the clean pages' blocks to
    the free queue's tail, the row's last page first (rare in the random streams)."""
    m = run(32, 12, 1, MAX_LEN, MAX_LEN, [("step", 40), ("step", 40), ("confirm", ALL)])
    assert m.r.pages(CLEAN) == [0, 1, 2, 3, 4] and not m.r.hot
    blocks = list(m.row)
    m.free()
    assert list(m.gpu)[-5:] == blocks[::-1]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**STREAMS)
def test_the_row_decides_as_the_reference_on_random_streams(num_blocks: int, host_blocks: int,
                                                            hot_blocks: int, in_flight: int, prompt: int,
                                                            ops: list[tuple[str, int]]) -> None:
    run(num_blocks, host_blocks, hot_blocks, in_flight, prompt, ops)


def test_caller_mistakes_raise_before_any_change() -> None:
    row = ResidentRow()
    row.grow(4)
    assert row.plan(3, 1) == [0]
    for call in (lambda: row.confirm(1), lambda: row.unpin(0), lambda: row.lose(0), lambda: row.state(4),
                 lambda: row.plan(5, 1), lambda: row.plan(1, -1), lambda: row.grow(-1),
                 lambda: row.start_host(2), lambda: row.adopt(1), lambda: row.asks_for_hot(-1, 1, 1)):
        # (a hit starts an empty row; only a HOST page adopts a GPU copy: mutants-r30)
        with pytest.raises(RequestError):
            call()
        assert [row.state(p) for p in range(4)] == [IN_FLIGHT, DIRTY, DIRTY, DIRTY] and row.ready == 0
    assert row.confirm(0) is False  # (no hot region: nothing is unpinned)
    with pytest.raises(RequestError, match="may not be unpinned"):
        row.unpin(0)
    row.hold_hot()
    assert row.unpinnable() == [0]
    row.plan(4, 4)
    row.confirm(3)
    assert row.unpinnable() == [0] and row.ready == 1  # (page 3: among the last two)
    with pytest.raises(RequestError, match="may not be unpinned"):
        row.unpin(3)
    assert row.state(3) == CLEAN
    for call, what in ((lambda: row.unpin(1), "unpin page 1: it is IN_FLIGHT"),
                       (lambda: row.restore(0), "restore page 0: it is CLEAN"),
                       (lambda: row.restored(0), "restored page 0: it is CLEAN")):
        with pytest.raises(RequestError, match=what):  # (mutants-r30)
            call()
    assert [row.state(p) for p in range(4)] == [CLEAN, IN_FLIGHT, IN_FLIGHT, CLEAN]


def test_check_invariants_finds_a_broken_row() -> None:
    row = ResidentRow()
    row.grow(3)
    row.check_invariants()
    row.ready = 1
    with pytest.raises(InvariantError, match="ready"):
        row.check_invariants()
    row._states[0] = UNPINNED  # (what no call does: without a hot region; ready is right)
    with pytest.raises(InvariantError, match="without a hot region"):
        row.check_invariants()
    row.hot = True
    row._states[0], row._states[2] = CLEAN, HOST  # (an import's page may be HOST there)
    row.check_invariants()
    row._states[2] = UNPINNED
    with pytest.raises(InvariantError, match="among the last"):
        row.check_invariants()
    row._states[2] = "DIRTY"  # (not a PageState: mutants-r30)
    with pytest.raises(InvariantError, match="unknown page state"):
        row.check_invariants()


def test_spills_refuse_caller_mistakes_before_any_change_and_ignore_stale_reports() -> None:
    s = Spills(2)
    assert s.plan("a", [0, 1]) == [0, 1] and s.budget == 0
    for call in (lambda: s.plan("b", [2]), lambda: s.report({0: -1}, {}), lambda: s.report({}, {1: "1"}),
                 lambda: s.page_of(2)):
        with pytest.raises(RequestError):
            call()
        assert s.to_send == [0, 1] and s.in_flight == 2
    assert s.take() == [0, 1] and s.budget == 2
    assert s.report({0: 2, 1: 1, 7: 1}, {0: 1, 7: 1}) == []  # (7: no such copy, ignored)
    assert s.report({0: 1}, {1: 1}) == [1]  # (0: two workers, as first reported)
    assert s.report({}, {0: 1}) == [0]
    assert s.report({0: 1}, {0: 1}) == [] and not s.has_work()  # (stale: ignored)
    s.plan("b", [3])
    assert s.detach("b") == [2] and s.page_of(2) == (None, 3) and s.has_work()
    s.check_invariants()
    s.to_send.append(9)
    with pytest.raises(InvariantError, match="not in flight"):
        s.check_invariants()

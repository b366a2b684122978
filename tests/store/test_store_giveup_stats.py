"""``store_errors`` for a fetch that gave up its holds (``core/store_giveup.py``): left
with no valid hit, its request's wait ends at once (``Fetch.expired``, as past its
deadline), but the fetch still runs; when it then fails, that failure is the store's and
is counted, once, as any failed fetch's (before: not counted, ``StoreLink.ended`` taking
every expired fetch for one ``poll`` had counted at its deadline). One that then reads
its run is no error; one past its deadline is counted at ``poll``, not again."""

from __future__ import annotations

from .test_trust_scenarios import PROMPT, computed_and_fetching


class Down:
    """A backend whose reads fail (the server went away while the fetch waited)."""

    def read_into(self, keys, bufs, deadline):
        raise ConnectionError("the store went away")


def given_up(backend, layout):
    """``q``'s fetch of A's third block, holding ``r``'s two blocks as its device hits,
    gives up both (``r`` rewinds to 0): its wait ends, the fetch not run yet."""
    m, ex, e, r = computed_and_fetching(backend, layout)
    f = m._waits.waiting["q"]
    m.rewind("r", 0)
    assert f.expired and not f.ended
    assert m.poll_store() == ["q"]
    return m, ex, e, f


def test_a_given_up_fetch_that_then_fails_is_counted_once(backend, layout):
    m, ex, _, f = given_up(backend, layout)
    assert m.stats.store_errors == 0
    m._waits.link.backend = Down()
    ex.run()
    assert m.poll_store() == []          # (its request computes already)
    assert f.ended and f.failed is not None
    assert m.stats.store_errors == 1     # before: 0
    assert m.poll_store() == [] and m.stats.store_errors == 1
    m.check_invariants()


def test_a_given_up_fetch_that_then_reads_its_run_is_no_error(backend, layout):
    m, ex, e, f = given_up(backend, layout)
    ex.run()
    assert m.poll_store() == []
    assert f.ended and f.failed is None and m.stats.store_errors == 0
    assert m.extend("r", len(PROMPT)) is not None
    m.check_invariants()


def test_a_fetch_past_its_deadline_that_then_fails_is_counted_at_its_deadline_alone(
        backend, layout):
    m, ex, _, _ = computed_and_fetching(backend, layout)
    f = m._waits.waiting["q"]
    f.deadline = -1.0                    # (past it: ``poll`` gives up on it)
    assert m.poll_store() == ["q"] and f.expired and m.stats.store_errors == 1
    m._waits.link.backend = Down()
    ex.run()
    assert m.poll_store() == [] and f.ended and m.stats.store_errors == 1
    m.check_invariants()

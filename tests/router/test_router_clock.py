"""The router's clock (``Router(clock=...)``, ``MetricsPoller``'s): a step back is no
time passing, a reading that is not a finite number is a RouterError before any change.
Checked against a plain model: per replica the forward time it was last heard."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv.router import ReplicaLoad, Router, RouterError

BS = 4
NAMES = ("a", "b", "c")


class Clock:
    def __init__(self) -> None:
        self.t: object = 0.0

    def __call__(self) -> float:
        return self.t  # type: ignore[return-value]


steps = st.lists(st.tuples(st.floats(-1e6, 50.0, allow_nan=False),
                           st.sampled_from(NAMES + ("live",))), max_size=40)


@settings(deadline=None, max_examples=50)
@given(steps)
def test_staleness_counts_the_clocks_forward_motion(ops):
    clock = Clock()
    router = Router(list(NAMES), block_size=BS, stale_after=10.0, clock=clock)
    now, heard, backs = 0.0, {}, 0  # the model: forward time, when each was last heard
    first = True
    for dt, op in ops:
        clock.t, last = float(clock.t) + dt, float(clock.t)  # type: ignore[arg-type]
        if not first:
            if clock.t >= last:  # type: ignore[operator]
                now += float(clock.t) - last  # type: ignore[arg-type]
            else:
                backs += 1
        if op == "live":
            assert router.live() == [r for r in NAMES
                                     if now - heard.get(r, -math.inf) <= 10.0]
        else:
            router.apply(op, [])
            heard[op] = now
        first = False
        assert router.clock_steps_back == backs


def test_a_step_back_keeps_no_silent_replica_alive_and_marks_no_live_one_stale():
    # found by audit: last_heard was the raw reading, so a step back of a day kept "a",
    # silent since, live for a day more
    clock = Clock()
    router = Router(["a", "b"], block_size=BS, stale_after=5.0, clock=clock)
    clock.t = 86400.0
    router.apply("a", [])
    router.apply("b", [])
    clock.t = 0.0  # stepped back a day: no time passes
    assert router.live() == ["a", "b"]
    router.apply("b", [])
    clock.t = 6.0  # 6 s of forward motion: "a" silent for 6, "b" for 6
    assert router.live() == []
    router.apply("b", [])
    clock.t = 10.0
    assert router.live() == ["b"] and router.clock_steps_back == 1


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, "5", None, True])
def test_a_reading_that_is_not_a_finite_number_is_refused_before_any_change(bad):
    clock = Clock()
    router = Router(["a", "b"], block_size=BS, stale_after=5.0, clock=clock)
    router.apply("a", [])
    router.route([1, 2, 3, 4])
    state = (dict(router.last_heard), dict(router.in_flight), dict(router.routed),
             {r: list(d) for r, d in router.loads.since.items()})
    clock.t = bad
    with pytest.raises(RouterError, match="finite"):
        router.live()
    with pytest.raises(RouterError, match="finite"):
        router.apply("b", [])
    with pytest.raises(RouterError, match="finite"):
        router.route([1, 2, 3, 4])
    assert state == (dict(router.last_heard), dict(router.in_flight), dict(router.routed),
                     {r: list(d) for r, d in router.loads.since.items()})
    clock.t = 1.0
    assert router.live() == ["a"]


def test_a_report_read_after_a_step_back_replaces_what_was_routed_before_it():
    # found by audit: the routing since a report was kept by raw reading, so after a
    # step back a report read later than everything routed still counted all of it
    # (the oldest entry, stamped before the step, looked newer than the read)
    clock = Clock()
    router = Router(["a"], block_size=BS, capacity={"a": 100}, clock=clock)
    router.report_load("a", ReplicaLoad(0.0), read_at=0.0)
    clock.t = 1000.0
    router.route(list(range(8)))  # 2 blocks, routed after the report
    assert router.loads.active_blocks("a") == 2.0
    clock.t = 0.0  # back
    router.route(list(range(100, 108)))
    clock.t = 1.0
    router.report_load("a", ReplicaLoad(0.5), read_at=0.5)  # read after both routings
    assert router.loads.active_blocks("a") == 50.0

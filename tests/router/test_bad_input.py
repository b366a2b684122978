"""Bad input to the router's public calls: a typed error (a PrefixKVError, hence a
ValueError) before any state changes, and the router's tallies unchanged after."""

import math

import pytest

from prefixkv.errors import PrefixKVError
from prefixkv.router import (
    AffinityScorer,
    CostScorer,
    LoadError,
    ReplicaLoad,
    ReplicaView,
    Router,
    RouterError,
    ScorerError,
)

NAN, INF = math.nan, math.inf


@pytest.mark.parametrize("bad", [
    dict(kv_usage=NAN), dict(kv_usage=INF), dict(kv_usage="0.5"), dict(kv_usage=True),
    dict(kv_usage=0.5, num_waiting=NAN), dict(kv_usage=0.5, num_waiting=2.5),
    dict(kv_usage=0.5, num_waiting=True), dict(kv_usage=0.5, waiting_tokens=INF),
    dict(kv_usage=0.5, waiting_tokens=NAN), dict(kv_usage=0.5, num_blocks=NAN),
    dict(kv_usage=0.5, num_blocks=INF), dict(kv_usage=0.5, num_blocks=2.5),
    dict(kv_usage=0.5, num_blocks="64"),
])
def test_a_load_report_that_is_not_finite_or_integral_is_a_load_error(bad):
    with pytest.raises(LoadError):
        ReplicaLoad(**bad)
    assert issubclass(LoadError, PrefixKVError)


def test_a_nan_report_can_not_reach_the_scores():
    router = Router(["a", "b"], block_size=4)
    with pytest.raises(LoadError):
        router.report_load("a", ReplicaLoad(0.5, 0, NAN))  # type: ignore[arg-type]
    assert router.loads.reported == {}
    assert router.route(list(range(8))).replica in ("a", "b")


@pytest.mark.parametrize("kw", [dict(load_weight=INF), dict(load_weight=NAN),
                                dict(balance=NAN), dict(balance=0.5)])
def test_affinity_options_that_would_make_nan_scores_are_refused(kw):
    with pytest.raises(ScorerError):
        AffinityScorer(**kw)
    with pytest.raises(RouterError):
        Router(["a"], block_size=4, **kw)


@pytest.mark.parametrize("kw", [dict(prefill_weight=INF), dict(prefill_weight=NAN),
                                dict(temperature=NAN), dict(balance=NAN)])
def test_cost_options_that_would_make_nan_costs_are_refused(kw):
    with pytest.raises(ScorerError):
        CostScorer(**kw)


def _views(in_flight, routed=(0, 0, 0)):
    return [ReplicaView(r, 4, 0, 0, f, 1.0 + i, 2.0, None, None, n)
            for i, (r, f, n) in enumerate(zip("abc", in_flight, routed, strict=True))]


@pytest.mark.parametrize("balance", [INF, 1e308])
def test_a_balance_too_large_to_round_is_no_cap(balance):
    # ceil/floor of balance * mean overflowed: OverflowError on every route
    views = _views((5, 0, 9), (7, 1, 9))
    assert AffinityScorer(balance=balance).pick(views, 0) == 1
    assert CostScorer(balance=balance).pick(views, 0) == 0  # lowest cost, no cap
    router = Router(["a", "b"], block_size=4, balance=balance)
    assert {router.route(list(range(8))).replica for _ in range(4)} <= {"a", "b"}


@pytest.mark.parametrize("temperature", [5e-324, 1e-320])
def test_a_temperature_whose_scale_underflows_picks_the_lowest_cost(temperature):
    # temperature * mean cost rounded to 0.0: (c - low) / 0.0 raised ZeroDivisionError
    views = [ReplicaView(r, 4, 0, 0, 0, p, 0.0, 1000, None) for r, p in (("a", 3.0), ("b", 1.0))]
    assert CostScorer(temperature=temperature, busy_threshold=None).pick(views, 0) == 1


def test_a_huge_temperature_draws_every_candidate():
    views = [ReplicaView(r, 4, 0, 0, 0, p, 0.0, None, None) for r, p in (("a", 3.0), ("b", 1.0))]
    scorer = CostScorer(temperature=1e308, busy_threshold=None, seed=1)
    assert {scorer.pick(views, 0) for _ in range(64)} == {0, 1}

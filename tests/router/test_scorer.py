"""Routing that weighs load: CostScorer (Dynamo's cost), published loads, the load book,
and the approximate index for engines without events."""

import pytest

from prefixkv.router import Router, RouterError, Stored
from prefixkv.router.approx import ApproxIndex, ApproxIndexError
from prefixkv.router.load import LoadError, ReplicaLoad, from_metrics
from prefixkv.router.scorer import (
    AffinityScorer,
    CostScorer,
    ReplicaView,
    ScorerError,
    under_cap,
    under_share,
)

BS = 4


def view(name, *, n=8, run=0, gpu=None, in_flight=0, prefill=0.0, active=0.0, cap=None,
         usage=None, routed=0):
    return ReplicaView(name, n, run, run if gpu is None else gpu, in_flight, prefill, active,
                       cap, usage, routed)


def test_cost_is_weighted_prefill_plus_blocks_over_capacity():
    s = CostScorer(prefill_weight=2.0, cpu_weight=0.5)
    # 8 blocks, 4 cached on the GPU and 2 more on the CPU (count half): 3 to compute
    v = view("a", run=6, gpu=4, prefill=5.0, active=10.0, cap=100)
    assert s.cost(v) == pytest.approx((2.0 * (5 + 8 - 5) + 10 + 8) / 100)
    assert CostScorer().cost(view("b", run=8, active=2.0)) == 10.0  # no capacity: blocks


def test_temperature_zero_picks_the_lowest_cost_first_in_rotation_on_ties():
    s = CostScorer()
    views = [view("a", prefill=8.0), view("b", run=8), view("c", run=8)]
    assert s.pick(views, 0) == 1
    # a cached prompt loses to an idle replica once its queue is long enough
    assert s.pick([view("a", run=8, prefill=20.0), view("b")], 0) == 1


def test_capacity_lets_a_larger_replica_carry_more():
    s = CostScorer()
    views = [view("small", active=50.0, cap=100), view("big", active=80.0, cap=400)]
    assert s.pick(views, 0) == 1


def test_busy_replicas_are_left_out_unless_all_are():
    s = CostScorer(busy_threshold=0.9)
    views = [view("a", run=8, usage=0.95), view("b", usage=0.5)]
    assert s.pick(views, 0) == 1
    assert s.pick([view("a", run=8, usage=0.95), view("b", usage=0.99)], 0) == 0


def test_balance_caps_requests_in_flight():
    views = [view("a", run=8, in_flight=5), view("b", in_flight=1), view("c", in_flight=0)]
    assert CostScorer().pick(views, 0) == 0
    assert CostScorer(balance=1.1).pick(views, 0) == 1  # a is over ceil(1.1 * 7 / 3) = 3


def test_balance_cap_rounds_down_at_a_few_requests_per_replica():
    """Mean 3 in flight after this request: ceil(1.1 * 3) = 4 would let the replica that
    holds the prompt take a fourth while another has 2 (a chat session placed there comes
    back for every turn); CostScorer's cap is max(ceil(3), floor(3.3)) = 3."""
    views = [view("a", run=8, in_flight=3)] + [view(f"r{i}", in_flight=3) for i in range(6)] \
        + [view("low", in_flight=2)]
    assert under_cap(views, 1.1) == list(range(8))  # the rounding AffinityScorer keeps
    assert under_cap(views, 1.1, tight=True) == [7]
    assert CostScorer(balance=1.1).pick(views, 0) == 7
    # with more in flight, floor(balance * mean) leaves the room balance gives
    many = [view("a", run=8, in_flight=32)] + [view(f"r{i}", in_flight=30) for i in range(7)]
    assert 0 in under_cap(many, 1.1, tight=True) and CostScorer(balance=1.1).pick(many, 0) == 0


def test_balance_evens_requests_routed_where_every_candidate_caches_the_same():
    """In flight evenly (2 each), but "a" was sent 10 requests and the others 6 (its
    requests finished sooner): where all cache the same, a would pass the share cap
    max(ceil(29 / 4), floor(1.1 * 29 / 4)) = 8, and the cheapest is not picked."""
    views = [view("a", run=8, in_flight=2, routed=10)] + [
        view(n, run=8, in_flight=2, active=10.0, routed=6) for n in "bcd"]
    assert CostScorer().pick(views, 0) == 0
    assert under_share(views, 1.1) == [1, 2, 3]
    assert CostScorer(balance=1.1).pick(views, 0) == 1


def test_share_cap_never_moves_a_request_off_its_cached_run():
    """a holds the prompt (a session's history) and the others do not: the share cap
    does not apply, a is picked although over its share."""
    views = [view("a", run=8, in_flight=2, routed=10)] + [
        view(n, in_flight=2, active=10.0, routed=6) for n in "bcd"]
    assert CostScorer(balance=1.1).pick(views, 0) == 0
    assert under_share([view("a", routed=4), view("b", routed=2)], 1.0) == [1]
    # under the cap in flight, only a; over its share: kept, since no one else may go
    busy = [view("a", in_flight=0, routed=9), view("b", in_flight=5, routed=0)]
    assert CostScorer(balance=1.1).pick(busy, 0) == 0


def test_balance_sends_a_prompt_to_the_one_replica_caching_more_of_it_whatever_the_cost():
    """a alone holds the prompt's 8 blocks (a session's history) and has 100 blocks in
    use: Dynamo's cost (2 * 0 + 100 + 8 against 2 * 8 + 0 + 8) moves it to b, and the
    session's later turns follow; under balance it stays while a is under the caps."""
    views = [view("a", run=8, in_flight=1, active=100.0), view("b", in_flight=1),
             view("c", in_flight=1)]
    assert CostScorer(prefill_weight=2.0).pick(views, 0) == 1
    assert CostScorer(prefill_weight=2.0, balance=1.1).pick(views, 0) == 0
    # two hold the most: the cost decides between them
    views[1] = view("b", run=8, in_flight=1)
    assert CostScorer(prefill_weight=2.0, balance=1.1).pick(views, 0) == 1
    # what every replica holds singles none out
    same = [view("a", run=8, active=100.0), view("b", run=8)]
    assert CostScorer(prefill_weight=2.0, balance=1.1).pick(same, 0) == 1


def test_balance_holds_the_cap_in_flight_as_the_fleet_drains():
    """After 8 replicas ran 3 requests each, 3 remain in flight: the cap would be
    max(ceil(4 / 8), floor(1.1 * 4 / 8)) = 1 and a chat turn whose replica runs one
    other would move off its history; held at the mean of 3, the cap is 4."""
    busy = [view(f"r{i}", in_flight=3) for i in range(8)]
    drained = [view("home", run=8, in_flight=1), view("r1", in_flight=1),
               view("r2", in_flight=1)] + [view(f"r{i}") for i in range(3, 8)]
    for hold, home in ((64, True), (1, False)):
        s = CostScorer(balance=1.1, hold=hold)
        s.pick(busy, 0)
        assert (s.pick(drained, 1) == 0) is home
    with pytest.raises(ScorerError, match="hold must be an int in \\[1, "):
        CostScorer(hold=0)


def test_temperature_samples_by_cost():
    s = CostScorer(temperature=0.5, seed=1)
    views = [view("a", run=8), view("b", prefill=16.0)]
    picks = [s.pick(views, 0) for _ in range(400)]
    assert 0 < picks.count(1) < picks.count(0)


@pytest.mark.parametrize("kw", [dict(prefill_weight=0), dict(temperature=-1),
                                dict(busy_threshold=0), dict(busy_threshold=1.5),
                                dict(cpu_weight=2), dict(balance=0.5)])
def test_cost_scorer_rejects_bad_options(kw):
    with pytest.raises(ScorerError):
        CostScorer(**kw)


def test_affinity_scorer_rejects_bad_options_and_router_says_so():
    with pytest.raises(ScorerError, match="balance"):
        AffinityScorer(balance=0.5)
    with pytest.raises(RouterError, match="balance"):
        Router(["a"], block_size=BS, balance=0.5)
    with pytest.raises(RouterError, match="capacity"):
        Router(["a"], block_size=BS, capacity={"b": 10})
    with pytest.raises(RouterError, match="capacity"):
        Router(["a"], block_size=BS, capacity={"a": 0})


def test_router_weighs_reported_load():
    router = Router(["a", "b"], block_size=BS, scorer=CostScorer(), capacity={"a": 100, "b": 100})
    prompt = list(range(1, 33))  # 8 blocks
    router.apply("a", [Stored(tuple(router.prompt_hashes(prompt)), None, "GPU")])
    assert router.route(prompt).replica == "a"  # cached there, both idle
    router.finish("a")
    router.report_load("a", ReplicaLoad(0.5, 3, 400, 100))  # 100 blocks queued for prefill
    assert router.route(prompt).replica == "b"
    # unreported, "b" is estimated from what is in flight there; a report replaces that
    assert router.loads.prefill_blocks("b") == 8 and router.loads.active_blocks("b") == 8
    router.report_load("b", ReplicaLoad(0.1, 0, 0))
    assert router.loads.prefill_blocks("b") == 0
    with pytest.raises(RouterError, match="unknown replica"):
        router.report_load("z", ReplicaLoad(0.1))


def test_unreported_replicas_are_estimated_from_requests_in_flight():
    router = Router(["a", "b"], block_size=BS, scorer=CostScorer())
    prompt = list(range(1, 33))
    first = router.route(prompt).replica
    assert router.loads.active_blocks(first) == 8 and router.loads.prefill_blocks(first) == 8
    assert router.route(prompt).replica != first  # the other is idle
    router.finish(first)
    assert router.loads.active_blocks(first) == 0


def test_load_reports_are_checked():
    for bad in (dict(kv_usage=1.5), dict(kv_usage=0.5, num_waiting=-1),
                dict(kv_usage=0.5, waiting_tokens=-1), dict(kv_usage=0.5, num_blocks=0)):
        with pytest.raises(LoadError):
            ReplicaLoad(**bad)


def test_load_from_metrics_text():
    text = ('# HELP vllm:kv_cache_usage_perc usage\n'
            'vllm:kv_cache_usage_perc{model_name="m",engine="0"} 0.25\n'
            'vllm:num_requests_waiting{model_name="m",engine="0"} 3.0\n'
            'vllm:num_requests_running{model_name="m",engine="0"} 7.0\n')
    assert from_metrics(text, num_blocks=64) == ReplicaLoad(0.25, 3, None, 64)
    with pytest.raises(LoadError, match="no vllm:kv_cache_usage_perc"):
        from_metrics("vllm:num_requests_waiting 1\n")
    with pytest.raises(LoadError, match="bad metrics line"):
        from_metrics("vllm:kv_cache_usage_perc{} nan\n")


def test_load_from_the_metrics_of_data_parallel_engines_and_with_timestamps():
    # vLLM serves one label set per engine (data parallel): the usage of each is a
    # fraction of its own pool (summed, 0.75 + 0.5 failed every scrape as "usage > 1"),
    # the queues add up. A sample may end with a timestamp (it was read as the value).
    text = ('vllm:kv_cache_usage_perc{model_name="m",engine="0"} 0.75\n'
            'vllm:kv_cache_usage_perc{model_name="m",engine="1"} 0.5 1700000000000\n'
            'vllm:num_requests_waiting{model_name="m",engine="0"} 3.0\n'
            'vllm:num_requests_waiting{model_name="m",engine="1"}\t2.0\t1700000000000\n')
    assert from_metrics(text, num_blocks=64) == ReplicaLoad(0.625, 5, None, 64)
    assert from_metrics('vllm:kv_cache_usage_perc{model_name="a} b"} 0.5\n').kv_usage == 0.5


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_approx_index_learns_from_routing_and_forgets_after_ttl():
    clock = Clock()
    index = ApproxIndex(10.0, clock=clock)
    router = Router(["a", "b", "c"], block_size=BS, index=index, load_weight=0)
    prompt = list(range(1, 33))
    first = router.route(prompt).replica
    router.finish(first)
    # no event came, yet the next prompt with this prefix follows the first
    assert router.route(prompt[:24] + [99] * 8).replica == first
    router.finish(first)
    assert router.cached_tokens(prompt)[first] == 32
    clock.t = 9.0
    router.route(prompt[:8])  # renews the first two blocks
    clock.t = 10.0
    assert router.cached_tokens(prompt)[first] == 8
    clock.t = 19.0
    assert router.cached_tokens(prompt)[first] == 0
    assert index.num_blocks(first) == 0


def test_approx_index_events_outrank_guesses():
    clock = Clock()
    index = ApproxIndex(5.0, clock=clock)
    index.store("a", [1, 2], "GPU")
    index.routed("a", [1, 2, 3])
    clock.t = 6.0
    assert index.prefix_runs([1, 2, 3], ["a"]) == {"a": (2, 2)}  # the guess of 3 went
    index.remove("a", [2], "GPU")
    index.clear("a")
    assert index.prefix_runs([1], ["a"]) == {}
    for bad in (0, -1.0, "5"):
        with pytest.raises(ApproxIndexError):
            ApproxIndex(bad)  # type: ignore[arg-type]


def test_what_is_remembered_since_a_report_stays_bounded():
    from prefixkv.router.load import MAX_SINCE

    now = [0.0]
    router = Router(["a"], block_size=BS, clock=lambda: now[0])
    router.report_load("a", ReplicaLoad(0.0))  # one report, never another
    prompt = list(range(1, 2 * BS + 1))  # 2 blocks
    for i in range(MAX_SINCE + 50):
        now[0] = float(i)
        router.route(prompt)
        router.finish("a")
    loads = router.loads
    assert len(loads.since["a"]) == MAX_SINCE
    assert loads.since_blocks["a"] == sum(b for _, _, b in loads.since["a"]) == 2 * (MAX_SINCE + 50)
    router.report_load("a", ReplicaLoad(0.0), read_at=float(MAX_SINCE + 40))
    assert loads.since_blocks["a"] == 2 * 10  # the ten routed at or after the read


def test_a_replica_without_capacity_is_costed_in_the_same_unit_as_the_others():
    # "a" states its pool (1000 blocks) and is half full; "b" states none and is idle.
    # Costed in blocks beside a's cost in pools, b looked 36 times as loaded as a.
    views = [view("a", n=4, active=500.0, cap=1000), view("b", n=4, active=10.0)]
    assert CostScorer().pick(views, 0) == 1
    assert CostScorer().cost(views[1], 1000) == pytest.approx((4 + 10 + 4) / 1000)
    # the fill-in is the mean of the capacities stated among the candidates
    three = [view("a", n=4, active=150.0, cap=100), view("b", n=4, active=150.0, cap=300),
             view("c", n=4, active=150.0)]
    s = CostScorer()
    assert [s.cost(v, 200) for v in three] == pytest.approx([1.58, 158 / 300, 0.79])
    assert s.pick(three, 0) == 1
    assert s.pick(three[:2] + [view("c", n=4, active=90.0)], 0) == 2  # 98/200 < 158/300

"""The fleet simulation and its report."""

import json

import pytest

from prefixkv.bench.fleet_report import run_fleet, table, write_fleet
from prefixkv.bench.replicas import simulate
from prefixkv.bench.workloads import builtin


@pytest.fixture(scope="module")
def chat():
    return builtin("chat", scale=0.5)


def test_one_replica_matches_every_policy(chat):
    runs = [simulate(chat, 1, route) for route in ("round-robin", "least-loaded", "prefix")]
    assert len({(r.hits, r.queries, r.prefill_computed) for r in runs}) == 1
    assert runs[0].routed == [len(chat.requests)] and runs[0].imbalance == 1.0


def test_prefix_routing_keeps_the_hit_rate_round_robin_loses(chat):
    single = simulate(chat, 1, "prefix").hit_rate
    rr = simulate(chat, 4, "round-robin")
    px = simulate(chat, 4, "prefix")
    assert px.hit_rate >= 0.9 * single > rr.hit_rate
    assert px.imbalance <= 1.25 and sum(px.routed) == len(chat.requests)
    assert px.prefill_computed < rr.prefill_computed


def test_every_request_is_served_once(chat):
    res = simulate(chat, 3, "least-loaded", pool_blocks=600)  # small pools: preemption
    assert sum(res.routed) == len(chat.requests)
    assert res.queries == sum(len(r.prompt) for r in chat.requests)


def test_errors(chat):
    with pytest.raises(ValueError, match="route"):
        simulate(chat, 2, "random")
    with pytest.raises(ValueError, match="replicas >= 1"):
        simulate(chat, 0, "prefix")
    with pytest.raises(ValueError, match="rate > 0"):
        simulate(chat, 2, "prefix", rate=0)
    with pytest.raises(ValueError, match="does not fit alone"):
        simulate(chat, 2, "prefix", pool_blocks=4)


def test_report_files(tmp_path):
    data = run_fleet([1, 2], ["round-robin", "prefix"], ["system-prompt"], scale=0.1)
    assert [(r["replicas"], r["route"]) for r in data["rows"]] == [
        (1, "round-robin"), (1, "prefix"), (2, "round-robin"), (2, "prefix")]
    assert data["rows"][1]["kept"] == 1.0
    notes = write_fleet(data, tmp_path)
    assert json.loads((tmp_path / "fleet.json").read_text())["rows"][0]["workload"] == "system-prompt"
    md = (tmp_path / "fleet.md").read_text()
    assert table(data) in md
    assert notes or (tmp_path / "fleet.png").stat().st_size > 0


def test_skewed_workload_is_mostly_three_hot_prefixes():
    wl = builtin("skewed", scale=0.5)
    heads = [r.prompt[:2048] for r in wl.requests]
    hot = sorted({h for h in heads if heads.count(h) > 1}, key=heads.count, reverse=True)
    assert len(hot) == 3 and len(wl.requests) == 200
    assert 0.7 <= sum(heads.count(h) for h in hot) / len(heads) <= 0.9


def test_cost_routing_balances_a_skewed_fleet_and_queues_less():
    """At 8 replicas, pure prefix affinity piles a hot prefix onto one replica; the cost
    scorer keeps the hit rate, evens the load and shortens the prefill a request waits for.
    At the benchmark's scale: at half of it (200 requests) the ramp-up, where CostScorer's
    cap rounds down, is a larger share of the run and the fleet keeps 93% (seed 0)."""
    wl = builtin("skewed")
    single = simulate(wl, 1, "prefix").hit_rate
    pure, least, cost = (simulate(wl, 8, r) for r in ("pure-prefix", "least-loaded", "cost"))
    assert pure.imbalance > 1.5 and cost.imbalance <= 1.15
    assert cost.hit_rate >= 0.95 * single > least.hit_rate
    assert cost.ttft_mean < least.ttft_mean < pure.ttft_mean
    assert sum(cost.routed) == len(wl.requests) == len(cost.ttft)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cost_routing_keeps_chat_sessions_even_at_eight_replicas(seed):
    """24 sessions on 8 replicas: each session's turns follow its history, so the load is
    even only when every replica gets 3 sessions at their first turn (seed 0 gave 4/4/4/3
    /3/3/3/0 with the cap rounded up: imbalance 1.22)."""
    wl = builtin("chat", seed=seed)
    single = simulate(wl, 1, "prefix").hit_rate
    cost = simulate(wl, 8, "cost")
    assert cost.imbalance <= 1.15 and cost.hit_rate >= 0.95 * single


def test_ttft_proxy_counts_queued_requests_by_the_prefill_they_compute():
    """The proxy is the prefill queued ahead of a request plus its own: a queued request
    whose prefix is cached costs what it computes (16 tokens here), not its whole
    prompt (80): c waits for b's 16 new tokens, then computes its own 16."""
    from prefixkv.bench.workloads import BenchRequest, Workload

    prefix = tuple(range(1, 65))  # 4 blocks of 16
    reqs = (BenchRequest("a", prefix, (7, 7)),
            BenchRequest("b", prefix + (500,) * 16, (7,), after="a"),
            BenchRequest("c", prefix + (600,) * 16, (7,), after="a"))
    res = simulate(Workload("t", "", reqs, 1024), 1, "prefix", rate=4)
    assert res.ttft == {"a": 64, "b": 16, "c": 32}

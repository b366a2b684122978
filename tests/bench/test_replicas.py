"""The fleet simulation and its report."""

import json

import pytest

from prefixkv.bench.fleet_bound import replicas_used, ttft_floor
from prefixkv.bench.fleet_report import run_fleet, table, write_fleet
from prefixkv.bench.replicas import simulate
from prefixkv.bench.workloads import BenchRequest, Workload, builtin


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
    with pytest.raises(ValueError, match="replicas must be an int >= 1"):
        simulate(chat, 0, "prefix")
    with pytest.raises(ValueError, match="rate must be a finite number > 0"):
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


@pytest.mark.parametrize("seed", [0, 1, 2, 4, 6, 8])
def test_cost_routing_keeps_chat_sessions_even_at_eight_replicas(seed):
    """24 sessions on 8 replicas: each session's turns follow its history, so the load is
    even only when every replica gets 3 sessions at their first turn (seed 0 gave 4/4/4/3
    /3/3/3/0 with the cap rounded up: imbalance 1.22). No session moves: the prefill
    computed is the floor's (seeds 4, 6, 8 moved sessions, by cost or by the cap as the
    fleet drained: 94.996% kept on seed 6, imbalance 1.17 on seed 8)."""
    wl = builtin("chat", seed=seed)
    single = simulate(wl, 1, "prefix").hit_rate
    cost = simulate(wl, 8, "cost")
    assert cost.imbalance <= 1.15 and cost.hit_rate >= 0.95 * single
    assert cost.prefill_computed / len(wl.requests) == ttft_floor(wl, 8, 1.15)


def test_cost_routing_beats_pure_prefix_on_chat_where_the_floor_allows():
    """Chat seed 4: the floor within imbalance 1.15 (176.8) is below pure prefix's proxy
    (181.6); with every session kept on its replica the cost route reaches 180.4 (209.2
    when it moved sessions)."""
    wl = builtin("chat", seed=4)
    cost, pure = simulate(wl, 8, "cost"), simulate(wl, 8, "pure-prefix")
    assert ttft_floor(wl, 8, 1.15) <= cost.ttft_mean < pure.ttft_mean


@pytest.mark.parametrize("seed", [4, 7, 8])
def test_cost_routing_keeps_the_requests_routed_even_on_a_shared_system_prompt(seed):
    """200 requests after one system prompt, 8 replicas: each holds the prompt, so the
    cost picks by load alone, and the replicas whose requests finished sooner took
    more (seed 4: 30 where the mean is 25, imbalance 1.20; seeds 7 and 8: 1.16) while
    none held more than 1.1 times the mean in flight. The cap on requests routed
    applies where every candidate caches the same (scorer.under_share)."""
    wl = builtin("system-prompt", seed=seed)
    cost = simulate(wl, 8, "cost")
    assert cost.imbalance <= 1.15 and sum(cost.routed) == len(wl.requests)
    assert cost.ttft_mean < simulate(wl, 8, "least-loaded").ttft_mean


def test_ttft_proxy_charges_each_step_its_whole_batch():
    """The proxy is the work of the steps from a request's routing to its prefill's step,
    each step charged its whole batch: b and c are admitted in one step, so each waits
    for both prefills (16 + 16 new tokens; the queued-prefill proxy gave b 16)."""
    prefix = tuple(range(1, 65))  # 4 blocks of 16
    reqs = (BenchRequest("a", prefix, (7, 7)),
            BenchRequest("b", prefix + (500,) * 16, (7,), after="a"),
            BenchRequest("c", prefix + (600,) * 16, (7,), after="a"))
    res = simulate(Workload("t", "", reqs, 1024), 1, "prefix", rate=4)
    assert res.ttft == {"a": 64, "b": 32, "c": 32}


def test_ttft_proxy_counts_the_decode_steps_a_request_waits_through():
    """With one running slot, b waits while a decodes. Step 1 computes a's 64-token
    prompt (and a's first token); b arrives in step 2 (with one slot, one arrival a
    step), which decodes a's second token (1); step 3 its third (1), and a finishes;
    step 4 computes b's 32 tokens. b: 1 + 1 + 32 = 34 (the queued-prefill proxy gave
    32: nothing for the steps b waited through)."""
    reqs = (BenchRequest("a", tuple(range(1, 65)), (7, 7, 7)),
            BenchRequest("b", tuple(range(100, 132)), (7,)))
    res = simulate(Workload("t", "", reqs, 1024), 1, "prefix", rate=4, max_running=1)
    assert res.ttft == {"a": 64, "b": 34}


def test_ttft_floor_counts_the_shared_prefix_once_per_replica_a_route_must_use():
    """4 requests on 2 replicas within imbalance 1.15 use both (one may take 2 at most);
    each computes its own 16 tokens and each replica the shared 32 once: (64 + 64) / 4.
    cost reaches the floor (it sends two requests to each replica)."""
    shared = tuple(range(1, 33))
    wl = Workload("t", "", tuple(BenchRequest(f"r{i}", shared + (100 + i,) * 16, (7,))
                                 for i in range(4)), 1024)
    assert replicas_used(4, 2, 1.15) == 2 and replicas_used(144, 8, 1.15) == 8
    assert ttft_floor(wl, 2, 1.15) == 32.0
    assert simulate(wl, 2, "cost", rate=4).ttft_mean >= 32.0


def test_ttft_floor_does_not_count_a_later_turn_as_a_cache():
    """a's blocks are also b's, but b is a's next turn: a computes its 16 tokens after the
    shared block, b its last 16; the shared block once: (16 + 16 + 16) / 2, what one
    replica computes."""
    a = BenchRequest("a", tuple(range(1, 33)), (7,))
    b = BenchRequest("b", a.prompt + (7,) + tuple(range(200, 215)), (7,), after="a")
    wl = Workload("t", "", (a, b), 1024)
    assert ttft_floor(wl, 1, 1.15) == 24.0
    assert simulate(wl, 1, "prefix", rate=4).prefill_computed == 48


class _Scripted:
    """Routes the k-th request to ``names[plan[k]]``, whatever the views say."""

    def __init__(self, plan):
        self.plan, self.k = plan, 0

    def pick(self, views, turn):
        name = f"r{self.plan[self.k]}"
        self.k += 1
        return next(i for i, v in enumerate(views) if v.replica == name)


def _plan(rng, requests, replicas, most):
    counts, plan = [0] * replicas, []
    for _ in range(requests):
        r = rng.choice([i for i in range(replicas) if counts[i] < most])
        counts[r] += 1
        plan.append(r)
    return plan


@pytest.mark.parametrize("name,scale", [("chat", 0.25), ("system-prompt", 0.1),
                                        ("skewed", 0.05)])
def test_ttft_floor_is_below_every_route_within_the_bound(name, scale):
    """The floor is a bound, not an estimate: random routes with imbalance <= 1.15 at 4
    replicas (each replica at most floor(1.15 * R / 4) requests), and the simulation's
    own routes, never compute less prefill per request than it, and so never have a
    lower proxy."""
    import random

    wl = builtin(name, scale, seed=3)
    n = len(wl.requests)
    floor = ttft_floor(wl, 4, 1.15)
    most = int(1.15 * n / 4)
    rng = random.Random(0)
    runs = [simulate(wl, 4, "cost", scorer=_Scripted(_plan(rng, n, 4, most))) for _ in range(6)]
    runs += [simulate(wl, 4, route) for route in ("cost", "least-loaded", "round-robin")]
    within = [r for r in runs if r.imbalance <= 1.15]
    assert len(within) >= 6
    for r in within:
        assert floor <= r.prefill_computed / n <= r.ttft_mean


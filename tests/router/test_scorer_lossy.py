"""The built-in scorers discount a lossy replica's hits (``lossy_weight``): its index may
hold blocks a lost batch removed, so a stale long run must not win over a sound replica's
real shorter one."""

import pytest

from prefixkv.router import AffinityScorer, CostScorer, ReplicaView, Router, RouterError, ScorerError, Stored

BS = 4


def view(name, *, run, gpu=None, lossy=0, n=8):
    return ReplicaView(name, n, run, run if gpu is None else gpu, 0, 0.0, 0.0, None, None,
                       0, lossy)


# (found by the audit of fleet-r9b's mark: no built-in scorer read ``ReplicaView.lossy``,
# so a replica whose index may be stale won every route its stale entries matched)
SCORERS = [AffinityScorer, CostScorer, lambda **kw: CostScorer(balance=1.1, **kw)]
IDS = ["affinity", "cost", "cost-balanced"]


@pytest.mark.parametrize("make", SCORERS, ids=IDS)
def test_a_lossy_replicas_stale_long_hit_loses_to_a_sound_shorter_one(make):
    stale, sound = view("a", run=8, lossy=1), view("b", run=5)
    assert make().pick([stale, sound], 0) == 1
    assert make().pick([sound, stale], 0) == 0  # not rotation: the same either way round
    # its hits are discounted, not ignored: a run twice the sound one's still wins
    assert make().pick([view("a", run=8, lossy=1), view("b", run=3)], 0) == 0
    # the same runs on a sound index: the longer one wins, as before
    assert make().pick([view("a", run=8), sound], 0) == 0


@pytest.mark.parametrize("make", SCORERS, ids=IDS)
def test_lossy_weight_one_ignores_the_mark_and_zero_counts_its_hits_as_misses(make):
    stale, sound = view("a", run=8, lossy=3), view("b", run=5)
    assert make(lossy_weight=1.0).pick([stale, sound], 0) == 0
    assert make(lossy_weight=0.0).pick([view("a", run=8, lossy=1), view("b", run=1)], 0) == 1


def test_the_discount_applies_to_cpu_blocks_too():
    s = CostScorer(cpu_weight=0.5, lossy_weight=0.5)
    # 4 GPU + 4 CPU blocks: 6 credited, halved to 3: 5 blocks to compute
    assert s.cost(view("a", run=8, gpu=4, lossy=1)) == 5 + 8
    assert s.cost(view("a", run=8, gpu=4)) == 2 + 8


@pytest.mark.parametrize("make", [AffinityScorer, CostScorer], ids=["affinity", "cost"])
@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), float("inf")])
def test_lossy_weight_out_of_range_is_rejected(make, bad):
    with pytest.raises(ScorerError, match="lossy_weight"):
        make(lossy_weight=bad)


@pytest.mark.parametrize("make", SCORERS, ids=IDS)
def test_the_router_routes_off_a_lossy_index_until_it_is_forgotten(make):
    router = Router(["a", "b"], block_size=BS, scorer=make())
    prompt = list(range(1, 33))  # 8 blocks
    hashes = router.prompt_hashes(prompt)
    router.apply("a", [Stored(tuple(hashes), None, "GPU")])
    router.apply("b", [Stored(tuple(hashes[:5]), None, "GPU")])
    router.lost("a")  # a batch of a's events lost: its 8 blocks may be stale
    assert router.route(prompt).replica == "b"
    router.finish("b")
    router.forget("a")  # emptied and rebuilt from what it holds now
    router.apply("a", [Stored(tuple(hashes), None, "GPU")])
    assert router.lossy["a"] == 0 and router.route(prompt).replica == "a"


def test_the_routers_keywords_set_lossy_weight_on_its_default_scorer():
    # (found by fleet-r10's check of every tunable: Router(...) had no lossy_weight, so
    # the default scorer's discount could be changed only by building the scorer)
    router = Router(["a", "b"], block_size=BS, lossy_weight=0.0)
    assert router.scorer.lossy_weight == 0.0  # type: ignore[attr-defined]
    prompt = list(range(1, 33))
    hashes = router.prompt_hashes(prompt)
    router.apply("a", [Stored(tuple(hashes), None, "GPU")])
    router.apply("b", [Stored(tuple(hashes[:1]), None, "GPU")])
    router.lost("a")  # at weight 0 its 8 stale blocks count as misses: b's 1 block wins
    assert router.route(prompt).replica == "b"
    defaults = Router(["a"], block_size=BS).scorer
    assert (defaults.load_weight, defaults.balance, defaults.cpu_weight,  # type: ignore[attr-defined]
            defaults.lossy_weight) == (1.0, 1.25, 0.5, 0.5)  # type: ignore[attr-defined]


@pytest.mark.parametrize("kw", [{"lossy_weight": 1.5}, {"lossy_weight": float("nan")},
                                {"lossy_weight": "0.5"}, {"balance": "2"},
                                {"cpu_weight": -1.0}, {"load_weight": float("inf")}])
def test_the_routers_scorer_keywords_out_of_range_are_router_errors(kw):
    with pytest.raises(RouterError):
        Router(["a"], block_size=BS, **kw)


@pytest.mark.parametrize("kw", [{"lossy_weight": 0.0}, {"load_weight": 0.0}, {"balance": 2.0},
                                {"cpu_weight": 1.0}])
def test_scorer_keywords_beside_a_scorer_are_refused_not_ignored(kw):
    # they tuned the default scorer only: with scorer= given they were silently dropped
    with pytest.raises(RouterError, match="scorer"):
        Router(["a"], block_size=BS, scorer=CostScorer(), **kw)


def test_a_choice_states_that_its_cached_tokens_come_from_a_lossy_index():
    # (fleet-r10: Choice.cached_tokens gave a lossy replica's raw run with nothing to say
    # it may overstate, while the scorer itself had discounted it)
    router = Router(["a"], block_size=BS)
    prompt = list(range(1, 33))
    router.apply("a", [Stored(tuple(router.prompt_hashes(prompt)), None, "GPU")])
    sound = router.route(prompt)
    assert (sound.cached_tokens, sound.lossy) == (32, False)
    router.lost("a")
    stale = router.route(prompt)
    assert (stale.cached_tokens, stale.lossy) == (32, True)
    router.forget("a")
    assert router.route(prompt) == router.route(prompt).__class__("a", 0, False)

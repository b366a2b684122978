"""Both scorers under extreme but valid options and loads (Hypothesis): a pick is always
a candidate's position, never an exception, and the same inputs give the same pick."""

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv.router import AffinityScorer, CostScorer, ReplicaView

big = st.sampled_from([0.0, 1e-300, 0.5, 1.0, 3.0, 1e12, 1e300])
view = st.builds(
    ReplicaView, st.sampled_from("abcd"), st.integers(0, 8), st.integers(0, 8),
    st.integers(0, 8), st.integers(0, 10**6), big, big,
    st.one_of(st.none(), st.sampled_from([1, 7, 10**9])),
    st.one_of(st.none(), st.sampled_from([0.0, 0.5, 0.95, 1.0])), st.integers(0, 10**6),
    st.integers(0, 2))


def _consistent(v: ReplicaView) -> ReplicaView:
    run = min(v.run, v.prompt_blocks)
    return ReplicaView(v.replica, v.prompt_blocks, run, min(v.gpu_run, run), v.in_flight,
                       v.prefill_blocks, v.active_blocks, v.capacity, v.kv_usage, v.routed,
                       v.lossy)


views = st.lists(view.map(_consistent), min_size=1, max_size=5)
balances = st.sampled_from([1.0, 1.1, 2.0, 1e300, float("inf")])
lossy_weights = st.sampled_from([0.0, 5e-324, 0.5, 1.0])


@settings(max_examples=50, deadline=None)
@given(views, balances, st.sampled_from([0.0, 1.0, 1e300]), st.sampled_from([0.0, 0.5, 1.0]),
       lossy_weights)
def test_affinity_picks_a_candidate(vs, balance, load_weight, cpu_weight, lossy_weight):
    make = lambda: AffinityScorer(balance=balance, load_weight=load_weight,  # noqa: E731
                                  cpu_weight=cpu_weight, lossy_weight=lossy_weight)
    pick = make().pick(vs, 0)
    assert 0 <= pick < len(vs) and make().pick(vs, 0) == pick


@settings(max_examples=50, deadline=None)
@given(views, st.one_of(st.none(), balances), st.sampled_from([1e-300, 1.0, 2.0, 1e300]),
       st.sampled_from([0.0, 5e-324, 1e-300, 0.5, 1e300, float("inf")]),
       st.sampled_from([None, 0.5, 1.0]), lossy_weights)
def test_cost_picks_a_candidate(vs, balance, prefill_weight, temperature, busy, lossy_weight):
    make = lambda: CostScorer(balance=balance, prefill_weight=prefill_weight,  # noqa: E731
                              temperature=temperature, busy_threshold=busy, seed=3,
                              lossy_weight=lossy_weight)
    picks = [make().pick(vs, 0) for _ in range(2)]
    assert 0 <= picks[0] < len(vs) and picks[0] == picks[1]


def test_costs_that_overflow_to_inf_are_drawn_without_nan():
    # found by test_cost_picks_a_candidate: inf - inf made NaN weights, and
    # random.choices raised "Total of weights must be finite"
    huge = [ReplicaView(r, 4, 0, 0, 0, p, 0.0, None, None) for r, p in (("a", 1e300), ("b", 1.0))]
    scorer = CostScorer(temperature=1.0, prefill_weight=1e300, busy_threshold=None)
    assert {scorer.pick(huge, 0) for _ in range(16)} == {1}  # a's cost is inf: weight 0
    both = [ReplicaView(r, 4, 0, 0, 0, 1e300, 0.0, None, None) for r in "ab"]
    assert scorer.pick(both, 0) == 0  # every cost inf: the first in rotation
    wide = [ReplicaView(r, 4, 0, 0, 0, 0.0, 1.7e308, None, None) for r in "ab"]
    plain = CostScorer(temperature=1.0, busy_threshold=None)
    assert {plain.pick(wide, 0) for _ in range(32)} == {0, 1}  # finite costs, their sum inf

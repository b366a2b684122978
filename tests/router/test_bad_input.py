"""Bad input to the router's public calls: a typed error (a PrefixKVError, hence a
ValueError) before any state changes, and the router's tallies unchanged after."""

import math

import pytest

from prefixkv.errors import PrefixKVError
from prefixkv.router import LoadError, ReplicaLoad, Router

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

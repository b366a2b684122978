"""FetchCost: a fetch starts only when it beats computing; figures follow measurements;
a store judged slow is asked again once its figures are stale; the crossover."""

import pytest

from prefixkv import ConfigError
from prefixkv.store import FetchCost
from prefixkv.store.cost import STALE


def test_a_fetch_is_worth_it_only_when_it_beats_computing():
    c = FetchCost(1000.0, latency=0.001, bandwidth=1e6)   # 1 ms per token to compute
    # 10 blocks of 16 tokens: compute 160 ms; fetch 1 ms + 10 x 1 KB / 1 MB/s = 11 ms
    assert c.worth(10, 1000, 16, now=c.measured_at)
    # 10 blocks of 100 KB: fetch 1 s > 160 ms
    assert not c.worth(10, 100_000, 16, now=c.measured_at)
    assert c.worth(10, 100_000, 16, now=c.measured_at + STALE + 1)   # stale: ask again


def test_measurements_move_the_figures():
    c = FetchCost(1000.0, latency=0.001, bandwidth=1e9)
    for _ in range(4):
        c.observe(0, 0.05, now=1.0)                   # misses taking 50 ms: latency
    assert c.latency == pytest.approx(0.05) and c.bandwidth == 1e9 and c.measured_at == 1.0
    for _ in range(8):                                # and 10 MB taking 100 ms more
        c.observe(10_000_000, 0.15, now=2.0)
        c.observe(0, 0.05, now=2.0)
    assert c.bandwidth == pytest.approx(1e8) and c.latency == pytest.approx(0.05)


def test_the_crossover():
    c = FetchCost(1000.0, latency=0.01, bandwidth=1e6)
    assert c.crossover_tokens(500) == pytest.approx(0.01 / (0.001 - 0.0005))   # 20 tokens
    assert c.crossover_tokens(2000) is None           # a token's bytes take longer than it


@pytest.mark.parametrize("kw", [dict(prefill_tokens_per_s=0), dict(prefill_tokens_per_s="1"),
                                dict(latency=-1), dict(bandwidth=float("inf"))])
def test_bad_figures_raise(kw):
    with pytest.raises(ConfigError):
        FetchCost(**{"prefill_tokens_per_s": 1.0, **kw})

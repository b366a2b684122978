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


def test_worth_for_checks_its_figures_once_and_answers_as_worth():
    """``worth_for(block_bytes, block_size)`` checks those two once (the store link's
    call ``(num_blocks, now)`` then checks nothing: ``worth``'s checks cost it 77
    bytecodes a call, the lean call 22, benchmarks/results/fetch_cost_opcodes.md), and
    answers as ``worth`` for every count, figure and time."""
    import random

    from hostile import HOSTILE

    c = FetchCost(1000.0)
    for value in HOSTILE.values():  # (block_bytes >= 0, block_size >= 1: each slot in turn)
        for slot in (0, 1):
            args = [4096, 16]
            args[slot] = value()
            if type(args[slot]) is int and args[slot] >= slot:
                assert callable(c.worth_for(*args))
            else:
                with pytest.raises(ConfigError, match="worth_for"):
                    c.worth_for(*args)
    for bad in ((-1, 16), (4096, 0), (4096, True), (4096.0, 16), (None, 16)):
        with pytest.raises(ConfigError, match="worth_for"):
            c.worth_for(*bad)  # type: ignore[arg-type]
    rng = random.Random(0)
    for _ in range(500):
        c = FetchCost(rng.uniform(1, 1e5), latency=rng.uniform(1e-6, 0.1),
                      bandwidth=rng.uniform(1e3, 1e10))
        block_bytes, block_size = rng.randrange(0, 1 << 22), rng.randrange(1, 65)
        lean = c.worth_for(block_bytes, block_size)
        for _ in range(4):
            n, now = rng.randrange(0, 4096), c.measured_at + rng.uniform(-1, 2 * STALE)
            assert lean(n, now) == c.worth(n, block_bytes, block_size, now)
        c.observe(rng.randrange(0, 1 << 24), rng.uniform(1e-4, 1.0), c.measured_at + 1)
        n = rng.randrange(0, 4096)
        assert lean(n, c.measured_at) == c.worth(n, block_bytes, block_size, c.measured_at)


def test_worth_for_asks_a_subclass_s_own_worth():
    """A cost rule that overrides ``worth`` (tests' "always fetch") is asked through it."""

    class Never(FetchCost):
        def worth(self, num_blocks: int, block_bytes: int, block_size: int, now: float) -> bool:
            asked.append((num_blocks, block_bytes, block_size, now))
            return False

    asked: list[tuple[int, int, int, float]] = []
    assert not Never(1e9).worth_for(64, 4)(3, 5.0) and asked == [(3, 64, 4, 5.0)]


@pytest.mark.parametrize(("nbytes", "seconds", "now"), [
    pytest.param(None, 0.1, 1.0, id="nbytes-None"),
    pytest.param("x", 0.1, 1.0, id="nbytes-str"),
    pytest.param(-1, 0.1, 1.0, id="nbytes-negative"),
    pytest.param(1.5, 0.1, 1.0, id="nbytes-float"),
    pytest.param(True, 0.1, 1.0, id="nbytes-bool"),
    pytest.param(100, None, 1.0, id="seconds-None"),
    pytest.param(100, float("nan"), 1.0, id="seconds-nan"),
    pytest.param(100, float("inf"), 1.0, id="seconds-inf"),
    pytest.param(100, -1.0, 1.0, id="seconds-negative"),
    pytest.param(100, 0.1, float("nan"), id="now-nan"),
    pytest.param(100, 0.1, None, id="now-None"),
])
def test_a_bad_observation_is_a_config_error_and_moves_no_figure(nbytes, seconds, now):
    """``observe`` is public (a subclass or an engine may feed it): a figure that is no
    count, duration or time raises ConfigError with the window and figures unchanged.
    A NaN duration was kept (``max(nan, 1e-6)`` is nan): latency NaN, so no fetch was
    worth it until the figures went stale, and the NaN stayed in the window for the next
    15 fetches; None raised TypeError, a str ValueError (review-r21)."""
    c = FetchCost(1000.0)
    c.observe(1000, 0.01, 1.0)
    before = (c.latency, c.bandwidth, c.measured_at, list(c._seen))
    with pytest.raises(ConfigError, match="observe"):
        c.observe(nbytes, seconds, now)
    assert (c.latency, c.bandwidth, c.measured_at, list(c._seen)) == before
    c.observe(2000, 0.02, 2.0)  # (the fit still works)
    assert c.latency == c.latency and c.bandwidth == c.bandwidth

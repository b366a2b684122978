"""The engine with a host tier: every step runs the allocator's plan (offloads, loads,
fork copies) on the runner's caches, and greedy tokens equal the no-cache run under
pressure, preemption and forks. Device and host caches are poisoned with NaN, so a load
of a slot never written, or a block read before its load, would show."""

import random

import pytest

torch = pytest.importorskip("torch", reason="the example engine needs torch")

from prefixkv import BlockCopy, BlockLoads, BlockOffloads, KVCacheManager  # noqa: E402
from prefixkv.engine import Engine, ModelRunner, SamplingParams, build_engine  # noqa: E402
from prefixkv.kernels import BlockIdError  # noqa: E402

from .helpers import CONFIG, checker  # noqa: E402


class Recorder:
    """Wraps ``runner.run_kv_ops``: every plan the engine runs, in order."""

    def __init__(self, runner):
        self.plans = []
        self._run = runner.run_kv_ops
        runner.run_kv_ops = self

    def __call__(self, ops):
        self.plans.append(list(ops))
        self._run(ops)

    def count(self, kind):
        """How many blocks the plans moved with ops of ``kind``."""
        return sum(1 if kind is BlockCopy else len(op.src)
                   for plan in self.plans for op in plan if type(op) is kind)


def host_engine(model, num_blocks, host_blocks, **kw):
    alloc = KVCacheManager(num_blocks, 16, vocab_size=CONFIG.vocab_size, host_blocks=host_blocks)
    runner = ModelRunner(model, num_blocks, 16, poison=True, host_blocks=host_blocks)
    return Engine(runner, alloc, **kw), alloc, Recorder(runner)


def generate(engine, alloc, prompts, params):
    result = engine.generate(prompts, params, on_step=checker(alloc))
    assert not engine.has_unfinished() and alloc.num_free_blocks == alloc.num_blocks
    return result


def tokens(result):
    return [[s.token_ids for s in o.samples] for o in result.outputs]


def uncached(make_engine, prompts, params):
    engine, alloc = make_engine(128, caching=False)
    return generate(engine, alloc, prompts, params)


def rotating_prompts(seed=0, prefixes=4, rounds=3):
    """``prefixes`` distinct 48-token prefixes (3 blocks), each asked ``rounds`` times
    in rotation with a 5-token suffix: a prefix comes back after the others went by."""
    rng = random.Random(seed)
    heads = [[rng.randrange(1, CONFIG.vocab_size) for _ in range(48)] for _ in range(prefixes)]
    return [heads[i % prefixes] + [rng.randrange(1, CONFIG.vocab_size) for _ in range(5)]
            for i in range(prefixes * rounds)]


def test_pressure_host_hits_and_identical_tokens(make_engine, model):
    """One request at a time in 8 device blocks: every prefix is evicted before it comes
    back. Device-only caching finds nothing again; the host tier serves the prefixes."""
    prompts = rotating_prompts()
    params = SamplingParams(max_tokens=6)
    ref = uncached(make_engine, prompts, params)
    engine, alloc, rec = host_engine(model, 8, 64, max_num_seqs=1)
    on = generate(engine, alloc, prompts, params)
    assert tokens(on) == tokens(ref)
    assert on.stats.host_hits == on.stats.hits == 8 * 48       # rounds 2 and 3: all 3 blocks
    assert rec.count(BlockLoads) == 8 * 3 and rec.count(BlockOffloads) > 0
    assert on.num_prefill_tokens == ref.num_prefill_tokens - 8 * 48
    device_only, alloc2 = make_engine(8, max_num_seqs=1)
    assert generate(device_only, alloc2, prompts, params).stats.hits == 0


def test_a_small_host_tier_keeps_what_it_can(make_engine, model):
    prompts = rotating_prompts(seed=1)
    params = SamplingParams(max_tokens=6)
    ref = uncached(make_engine, prompts, params)
    engine, alloc, rec = host_engine(model, 8, 5, max_num_seqs=1)
    on = generate(engine, alloc, prompts, params)
    assert tokens(on) == tokens(ref)
    assert 0 < on.stats.host_hits < 8 * 48


def test_preemption_with_a_host_tier(make_engine, model):
    """4 sequences growing to 4 blocks each in 9 device blocks: preemption, re-admission
    through the host tier, same tokens as the unconstrained uncached run."""
    rng = random.Random(4)
    prompts = [[7] * 16 + [rng.randrange(1, CONFIG.vocab_size) for _ in range(6)] for _ in range(4)]
    params = SamplingParams(max_tokens=30)
    ref = uncached(make_engine, prompts, params)
    engine, alloc, rec = host_engine(model, 9, 32)
    on = generate(engine, alloc, prompts, params)
    assert on.num_preemptions > 0
    assert tokens(on) == tokens(ref)
    assert rec.count(BlockLoads) > 0


@pytest.mark.parametrize("num_blocks", [8, 12])
def test_forks_under_pressure_with_a_host_tier(make_engine, model, num_blocks):
    prompts = rotating_prompts(seed=7, prefixes=2, rounds=2)
    params = SamplingParams(max_tokens=14, n=3, temperature=0.8, seed=3)
    ref = uncached(make_engine, prompts, params)
    engine, alloc, rec = host_engine(model, num_blocks, 48)
    on = generate(engine, alloc, prompts, params)
    assert tokens(on) == tokens(ref)
    assert sum(r.forks for r in on.steps) > 0 and rec.count(BlockCopy) > 0
    assert rec.count(BlockOffloads) > 0


def test_build_engine_with_a_host_tier():
    engine = build_engine(CONFIG, num_blocks=8, host_blocks=16)
    assert engine.runner.k_host.shape == (16, CONFIG.num_layers, 16, CONFIG.num_kv_heads, CONFIG.head_dim)
    out = engine.generate(rotating_prompts(prefixes=3, rounds=2), SamplingParams(max_tokens=4))
    assert out.stats.host_hits > 0


def test_a_runner_without_host_caches_refuses_host_ops(model):
    runner = ModelRunner(model, 4, 16)
    before = runner.k_cache.clone()
    with pytest.raises(BlockIdError):
        runner.run_kv_ops([BlockCopy(0, 1), BlockOffloads((2,), (0,))])
    assert torch.equal(runner.k_cache, before)

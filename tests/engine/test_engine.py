"""The engine: greedy outputs do not depend on caching, preemption, eviction or forks;
prefill work with caching matches the hand count. Invariants are checked every step."""

import random

import pytest

torch = pytest.importorskip("torch", reason="the example engine needs torch")

from prefixkv import (  # noqa: E402
    BlockRemoved,
    BlockStored,
    ContiguousAllocator,
    ExtraKeys,
    KVCacheManager,
    MultiModalInput,
    PagedAllocator,
    Prompt,
    TokenError,
)
from prefixkv.engine import SamplingParams, run_chat, synthetic_conversations  # noqa: E402

from .helpers import CONFIG, checker, dense_greedy  # noqa: E402


def prompts_with(prefix, n, suffix_len, seed=0):
    rng = random.Random(seed)
    return [list(prefix) + [rng.randrange(1, CONFIG.vocab_size) for _ in range(suffix_len)]
            for _ in range(n)]


def run(make_engine, prompts, params=None, **kw):
    engine, alloc = make_engine(**kw)
    result = engine.generate(prompts, params or SamplingParams(max_tokens=12), on_step=checker(alloc))
    assert not engine.has_unfinished() and alloc.num_free_blocks == alloc.num_blocks
    return result


def tokens(result):
    return [[s.token_ids for s in o.samples] for o in result.outputs]


def test_greedy_matches_dense_recomputation(make_engine, model):
    prompts = prompts_with([], 3, 21, seed=1)
    result = run(make_engine, prompts, SamplingParams(max_tokens=10))
    assert [o.token_ids for o in result.outputs] == [tuple(dense_greedy(model, p, 10)) for p in prompts]


def test_shared_system_prompt_counts_and_outputs(make_engine):
    """S = 48 tokens (3 blocks), 4 requests with 5 unique tokens each, one batch: the first
    computes 53 tokens, the others hit 48 and compute 5 (admitted in the same step, they
    share the blocks that the first is computing)."""
    prompts = prompts_with(list(range(100, 148)), 4, 5, seed=2)
    on = run(make_engine, prompts, caching=True)
    off = run(make_engine, prompts, caching=False)
    assert tokens(on) == tokens(off)
    assert on.num_prefill_tokens == 48 + 4 * 5
    assert off.num_prefill_tokens == 4 * 53
    assert [o.metrics.num_cached_tokens for o in on.outputs] == [0, 48, 48, 48]
    assert (on.stats.requests, on.stats.queries, on.stats.hits) == (4, 212, 144)
    assert off.stats.hits == 0
    assert on.steps[0].num_seqs == 4 and on.steps[0].num_prefill_tokens == 68


def test_multi_turn_chat_same_outputs_fewer_prefill_tokens(make_engine):
    convs = synthetic_conversations(3, 3, 13, vocab_size=CONFIG.vocab_size, seed=3)
    params = SamplingParams(max_tokens=9)
    results = {}
    for caching in (True, False):
        engine, alloc = make_engine(caching=caching)
        results[caching] = run_chat(engine, convs, params, system_prompt=list(range(1, 30)),
                                    on_step=checker(alloc))
    on, off = results[True], results[False]
    assert on.replies == off.replies and on.histories == off.histories
    assert on.num_prefill_tokens < off.num_prefill_tokens
    # Turn 0 shares the 29-token system prompt's first block; later turns re-hit the
    # history's full blocks. The uncached cost of a turn is its prompt minus its hits.
    for turn in on.turns:
        for o in turn.outputs:
            assert o.metrics.num_prefill_tokens == o.metrics.num_prompt_tokens - o.metrics.num_cached_tokens
    assert all(o.metrics.num_cached_tokens > 0 for o in on.turns[2].outputs)


def test_preemption_in_a_tiny_pool(make_engine):
    """4 sequences growing to 4 blocks each in a pool of 9: preemption must happen, and
    outputs equal an unconstrained run, caching on or off."""
    prompts = prompts_with([7] * 16, 4, 6, seed=4)
    params = SamplingParams(max_tokens=30)
    ref = run(make_engine, prompts, params, num_blocks=64, caching=False)
    for caching in (True, False):
        tiny = run(make_engine, prompts, params, num_blocks=9, caching=caching)
        assert tiny.num_preemptions > 0
        assert tokens(tiny) == tokens(ref)
        assert sum(o.metrics.num_preemptions for o in tiny.outputs) == tiny.num_preemptions
        # each preemption is followed by one re-admission, counted apart from new traffic
        assert (tiny.stats.requests, tiny.stats.preempted_requests) == (4, tiny.num_preemptions)


def test_eviction_when_the_pool_is_smaller_than_the_working_set(make_engine):
    """Many distinct multi-turn histories through 20 blocks: cached blocks get evicted
    (BlockRemoved events), hits still happen, outputs equal the uncached run."""
    convs = synthetic_conversations(6, 3, 17, vocab_size=CONFIG.vocab_size, seed=5)
    params = SamplingParams(max_tokens=8)
    replies = {}
    for caching in (True, False):
        engine, alloc = make_engine(20, caching=caching, events=True, max_num_seqs=3)
        records = []

        def on_step(rec, alloc=alloc, records=records):
            alloc.check_invariants()
            records.append(rec)

        chat = run_chat(engine, convs, params, on_step=on_step)
        replies[caching] = chat.replies
        events = [e for r in records for e in r.events]
        if caching:
            assert any(isinstance(e, BlockRemoved) for e in events)
            assert sum(r.stats.hits for r in records) > 0
    assert replies[True] == replies[False]


@pytest.mark.parametrize("prompt_len", [19, 32])  # partial last block (copied) / none
def test_fork_children_equal_their_prompt_run_alone(make_engine, prompt_len):
    """n = 3 samples at temperature 1: sample i draws from a generator seeded seed + i,
    so it must equal the prompt run alone with that seed. Forked children share the
    prompt's blocks and copy its partial last block."""
    prompt = prompts_with([], 1, prompt_len, seed=6)[0]
    params = SamplingParams(max_tokens=20, n=3, temperature=1.0, seed=11)
    # each sample's prompt run alone, once (the same runs for caching on and off)
    alone = [run(make_engine, [prompt], SamplingParams(max_tokens=20, temperature=1.0, seed=11 + i))
             .outputs[0].token_ids for i in range(params.n)]
    for caching in (True, False):
        result = run(make_engine, [prompt], params, caching=caching)
        (out,) = result.outputs
        assert len({s.token_ids for s in out.samples}) == 3, "samples should differ"
        assert sum(r.forks for r in result.steps) == 2
        assert out.metrics.num_prefill_tokens == prompt_len  # children reuse the parent's
        assert [s.token_ids for s in out.samples] == [alone[s.index] for s in out.samples]


def test_forks_under_preemption_and_fork_shortage(make_engine):
    """Two n = 3 requests in 8 blocks: forks fail or get preempted; every sample still
    equals the unconstrained run."""
    prompts = prompts_with([], 2, 19, seed=7)
    params = SamplingParams(max_tokens=25, n=3, temperature=0.8, seed=3)
    ref = run(make_engine, prompts, params, num_blocks=64)
    for caching in (True, False):
        tiny = run(make_engine, prompts, params, num_blocks=8, caching=caching)
        assert tiny.num_preemptions > 0
        assert tokens(tiny) == tokens(ref)


def test_fork_falls_back_to_admission_when_short(make_engine):
    """A 2-block pool is full after the parent's prefill: ``fork`` returns None, so each
    child waits and is admitted later with its prompt plus its first token, re-hitting
    the prompt's full block when caching is on."""
    prompt = prompts_with([], 1, 19, seed=13)[0]
    params = SamplingParams(max_tokens=10, n=3, temperature=1.0, seed=5)
    ref = run(make_engine, [prompt], params)
    for caching in (True, False):
        tiny = run(make_engine, [prompt], params, num_blocks=2, caching=caching)
        assert sum(r.forks for r in tiny.steps) == 0
        assert tokens(tiny) == tokens(ref)
        recompute = 2 * (20 - 16) if caching else 2 * 20
        assert tiny.outputs[0].metrics.num_prefill_tokens == 19 + recompute


def test_chunked_prefill_same_outputs(make_engine):
    prompts = prompts_with(list(range(1, 40)), 3, 25, seed=8)
    whole = run(make_engine, prompts)
    chunked = run(make_engine, prompts, chunked_prefill=True, max_num_batched_tokens=24)
    assert tokens(chunked) == tokens(whole)
    assert max(r.num_prefill_tokens + r.num_decode_tokens for r in chunked.steps) <= 24
    assert len(chunked.steps) > len(whole.steps)


@pytest.mark.parametrize("kind", ["paged", "contiguous"])
def test_baseline_allocators_drive_the_engine(make_engine, kind):
    prompts = prompts_with([5] * 20, 3, 7, seed=9)
    ref = run(make_engine, prompts)
    alloc = PagedAllocator(64, 16) if kind == "paged" else ContiguousAllocator(64, 16, max_model_len=64)
    engine, _ = make_engine(allocator=alloc)
    result = engine.generate(prompts, SamplingParams(max_tokens=12))
    assert tokens(result) == tokens(ref)
    assert alloc.num_free_blocks == 64 and result.stats.requests == 3 and result.stats.hits == 0


def test_steps_drain_stats_and_events(make_engine):
    """40 prompt tokens + 10 sampled (the last never appended): 49 tokens known to the
    manager, so 3 full blocks, stored 2 at admission and 1 while decoding."""
    engine, alloc = make_engine(caching=True, events=True)
    result = engine.generate([list(range(1, 41))], SamplingParams(max_tokens=10), on_step=checker(alloc))
    stored = [[h for e in r.events if isinstance(e, BlockStored) for h in e.block_hashes]
              for r in result.steps]
    assert len(stored[0]) == 2 and sum(map(len, stored)) == 3
    assert sum(isinstance(e, BlockStored) for e in result.steps[0].events) == 1  # one run
    assert result.steps[0].stats.requests == 1 and all(r.stats.requests == 0 for r in result.steps[1:])
    assert alloc.take_events() == [] and alloc.reset_prefix_cache()


def test_eos_stops_early(make_engine):
    prompt = prompts_with([], 1, 10, seed=10)[0]
    full = run(make_engine, [prompt]).outputs[0].token_ids
    stop = run(make_engine, [prompt], SamplingParams(max_tokens=12, eos_token_id=full[3]))
    out = stop.outputs[0].samples[0]
    assert out.token_ids == full[:full.index(full[3]) + 1] and out.finish_reason == "stop"


def test_metrics_are_consistent(make_engine):
    result = run(make_engine, prompts_with([], 2, 30, seed=12))
    for o in result.outputs:
        m = o.metrics
        assert 0 < m.prefill_time <= m.ttft <= m.e2e
        assert (m.num_prompt_tokens, m.num_cached_tokens, m.num_prefill_tokens) == (30, 0, 30)


@pytest.mark.parametrize("prompt, extra", [
    ([1, -1, 2], None), ([1, CONFIG.vocab_size], None), ([1, 2**32], None),
    ([1, 2.7], None), (["12", 3], None), ([True, 3], None), ("12", None),
    ([1, 2], ExtraKeys(mm=(MultiModalInput("img", 1, 5),))), ([1, 2], {"cache_salt": "a"}),
])
def test_a_request_the_allocator_would_refuse_is_refused_when_queued(make_engine, prompt, extra):
    """Such a request was queued (floats truncated, strings parsed by ``int``), and then
    every ``step`` raised the allocator's TokenError or ExtraKeysError on admitting it:
    the engine could serve nothing more."""
    engine, alloc = make_engine(8)
    with pytest.raises(ValueError):
        engine.add_request(prompt, SamplingParams(max_tokens=2), extra=extra)
    assert not engine.has_unfinished()
    rid = engine.add_request([5, 6, 7], SamplingParams(max_tokens=2))
    for _ in range(3):
        engine.step()
    assert not engine.has_unfinished()
    assert [o.request_id for o in engine.take_finished()] == [rid]
    alloc.check_invariants()


def test_generate_queues_no_prompt_when_one_is_refused(make_engine):
    """The prompts before the refused one were queued: the next ``generate`` ran them
    and returned none of their outputs."""
    engine, alloc = make_engine(8)
    with pytest.raises(ValueError):
        engine.generate([[1, 2, 3], [4, 5], [6, -1]], SamplingParams(max_tokens=2))
    assert not engine.has_unfinished()
    result = engine.generate([[7, 8]], SamplingParams(max_tokens=2), on_step=checker(alloc))
    assert [o.prompt_token_ids for o in result.outputs] == [(7, 8)]
    assert sum(r.num_seqs for r in result.steps[:1]) == 1


def test_engine_rejects_bad_input(make_engine, model):
    engine, alloc = make_engine(4)
    with pytest.raises(ValueError, match="prompt of 0 tokens"):
        engine.add_request([])
    engine.add_request([1, 2], request_id="a")
    with pytest.raises(ValueError, match="already in the engine"):
        engine.add_request([1], request_id="a")
    with pytest.raises(ValueError, match="hashable"):
        engine.add_request([1], request_id=["a"])
    with pytest.raises(ValueError, match="SamplingParams"):
        engine.add_request([1], {"max_tokens": 2})
    from prefixkv.engine import Engine, ModelRunner
    with pytest.raises(ValueError, match="runner's cache"):
        Engine(ModelRunner(model, 4, 8), KVCacheManager(4, 16))
    big, _ = make_engine(2)
    big.add_request(list(range(1, 60)))
    with pytest.raises(RuntimeError, match="does not fit in an empty pool"):
        big.step()
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_prompts_are_prepared_where_they_arrive(make_engine, model, monkeypatch):
    """``Engine.add_request`` prepares the prompt (a bad id is refused there, not in a
    step); the step admits the Prompt, and the outputs are those of token ids."""
    engine, alloc = make_engine()
    with pytest.raises(TokenError):
        engine.add_request([1, CONFIG.vocab_size])
    assert not engine.has_unfinished()
    admitted = []
    original = KVCacheManager.add_request
    monkeypatch.setattr(KVCacheManager, "add_request",
                        lambda self, rid, p, **kw: admitted.append(type(p)) or original(self, rid, p, **kw))
    prompts = prompts_with(list(range(100, 132)), 3, 7, seed=4)
    result = engine.generate(prompts, SamplingParams(max_tokens=6), on_step=checker(alloc))
    assert admitted == [Prompt] * 3
    assert [o.token_ids for o in result.outputs] == [tuple(dense_greedy(model, p, 6)) for p in prompts]

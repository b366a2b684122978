"""The example ``Engine`` (continuous batching, chunked prefill, preemption, forks) over a
``HybridKVCacheManager`` and a ``HybridModelRunner``: a Gemma-like mix (sliding window of
10 tokens beside full attention) and a Llama-4-like mix (chunked local attention of 8
tokens beside full attention), blocks of 4 tokens so windows release blocks within a
few tokens. Greedy tokens equal the model run densely without any cache, and equal the
run with caching off; hits happen (cached tokens), windows release blocks (null entries
in running tables), every cache starts as NaN and the null block is never written."""

import os
import random

import pytest

torch = pytest.importorskip("torch", reason="the example engine needs torch")

from prefixkv import KVCacheManager  # noqa: E402
from prefixkv.engine import (  # noqa: E402
    Engine,
    LlamaConfig,
    ModelRunner,
    SamplingParams,
    TinyLlama,
    UncachedHybridManager,
    build_engine,
    hybrid,  # noqa: E402
    run_chat,
    synthetic_conversations,
)
from prefixkv.engine.hybrid import HybridModelRunner, dense_group_attention  # noqa: E402
from prefixkv.groups import (  # noqa: E402
    GroupBlockRemoved,
    HybridKVCacheManager,
    chunked_local,
    full_attention,
    sliding_window,
)

CFG = LlamaConfig(vocab_size=97, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                  head_dim=16, intermediate_size=128, seed=5)
BS = 4
MIXES = {  # groups, the group of each layer
    "gemma-like": ((sliding_window(10), full_attention()), (0, 0, 1, 0)),
    "chunked-local": ((chunked_local(8), full_attention()), (0, 1, 0, 0)),
}


@pytest.fixture(scope="module")
def model():
    return TinyLlama(CFG)


class Run:
    """An engine over a hybrid manager (caching on or off) and a NaN-poisoned runner;
    ``on_step`` checks the invariants and counts what the windows released."""

    def __init__(self, model, mix, num_blocks=128, caching=True, events=False, **kw):
        groups, layers = MIXES[mix]
        self.alloc = HybridKVCacheManager(groups, num_blocks, BS, enable_events=events,
                                          vocab_size=CFG.vocab_size, enable_caching=caching)
        self.runner = HybridModelRunner(model, groups, layers, num_blocks, BS, poison=True)
        self.engine = Engine(self.runner, self.alloc, **kw)
        self.null_entries = 0   # released positions seen in running tables, summed over steps
        self.records = []

    def on_step(self, record):
        self.alloc.check_invariants()
        self.records.append(record)
        for seq in self.engine.scheduler.running:
            tables = self.alloc.get_block_ids(seq.seq_id)
            self.null_entries += sum(t.count(self.alloc.null_block_id) for t in tables)

    def generate(self, prompts, params):
        result = self.engine.generate(prompts, params, on_step=self.on_step)
        self.check_done()
        return result

    def check_done(self):
        a = self.alloc
        assert not self.engine.has_unfinished() and a.num_free_blocks == a.num_blocks - 1
        null = a.null_block_id
        assert self.runner.k_cache[:, null].isnan().all() and self.runner.v_cache[:, null].isnan().all()


def dense_greedy(model, mix, prompt, max_tokens):
    """Greedy tokens recomputing the whole sequence densely (each layer's own mask)."""
    groups, layers = MIXES[mix]
    specs = [groups[g] for g in layers]
    toks = list(prompt)
    with torch.inference_mode():
        for _ in range(max_tokens):
            hidden = model(torch.tensor(toks), torch.arange(len(toks)),
                           dense_group_attention([0, len(toks)], specs))
            toks.append(int(model.logits(hidden[-1:]).argmax()))
    return tuple(toks[len(prompt):])


def prompts_with(prefix, n, suffix_len, seed):
    rng = random.Random(seed)
    return [list(prefix) + [rng.randrange(1, CFG.vocab_size) for _ in range(suffix_len)]
            for _ in range(n)]


def tokens(result):
    return [[s.token_ids for s in o.samples] for o in result.outputs]


SHARED = list(range(60, 84))  # 24 tokens: 6 blocks, past both the window and the chunk


@pytest.mark.parametrize("mix", MIXES)
def test_shared_prefix_matches_dense_and_cache_off(model, mix):
    prompts = prompts_with(SHARED, 3, 5, seed=1)
    params = SamplingParams(max_tokens=12)
    on = Run(model, mix)
    res_on = on.generate(prompts, params)
    res_off = Run(model, mix, caching=False).generate(prompts, params)
    assert [o.token_ids for o in res_on.outputs] == [dense_greedy(model, mix, p, 12) for p in prompts]
    assert tokens(res_on) == tokens(res_off)
    # admitted in one step, the 2nd and 3rd hit the 24 shared tokens the 1st computes
    assert [o.metrics.num_cached_tokens for o in res_on.outputs] == [0, 24, 24]
    assert res_on.num_prefill_tokens == 29 + 2 * 5 and res_off.num_prefill_tokens == 3 * 29
    assert on.null_entries > 0 and on.alloc.group_stats()[0].blocks_released > 0
    assert on.alloc.group_stats()[1].blocks_released == 0


@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("caching", [True, False])
def test_pool_pressure_preemption_and_eviction(model, mix, caching):
    """5 requests growing to 10 blocks per group (20 with both) in a pool of 31: sequences
    are preempted and re-admitted, cached blocks are evicted; tokens equal the dense run."""
    prompts = prompts_with([7] * 12, 5, 6, seed=4)
    params = SamplingParams(max_tokens=20)
    run = Run(model, mix, num_blocks=31, caching=caching, events=True)
    result = run.generate(prompts, params)
    assert result.num_preemptions > 0
    assert [o.token_ids for o in result.outputs] == [dense_greedy(model, mix, p, 20) for p in prompts]
    events = [e for r in run.records for e in r.events]
    if caching:
        assert any(isinstance(e, GroupBlockRemoved) for e in events)
        assert result.stats.hits > 0
    else:  # (nothing recorded, so nothing announced: vLLM's manager with caching off)
        assert events == [] and result.stats.hits == 0


@pytest.mark.parametrize("mix", MIXES)
def test_chunked_prefill_matches_whole_prefill(model, mix):
    """Prefill chunks of at most 6 tokens cross block, window and chunk edges."""
    prompts = prompts_with(SHARED, 3, 9, seed=8)
    params = SamplingParams(max_tokens=10)
    whole = Run(model, mix).generate(prompts, params)
    run = Run(model, mix, chunked_prefill=True, max_num_batched_tokens=6)
    chunked = run.generate(prompts, params)
    assert tokens(chunked) == tokens(whole)
    assert [o.token_ids for o in chunked.outputs] == [dense_greedy(model, mix, p, 10) for p in prompts]
    assert max(r.num_prefill_tokens + r.num_decode_tokens for r in chunked.steps) <= 6
    assert sum(o.metrics.num_cached_tokens for o in chunked.outputs) > 0 and run.null_entries > 0


@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("num_blocks", [128, 20])
def test_fork_samples_equal_their_prompt_run_alone(model, mix, num_blocks):
    """n = 3 at temperature 1 (sample i: generator seed + i) forks after the first token
    (a partial last block: copied per group); in 20 blocks (a 35-token prefill needs 18)
    forks fail or samples get preempted.
    Each sample equals the prompt run alone with its seed, cache on and off."""
    prompt = prompts_with([], 1, 19, seed=6)[0]
    params = SamplingParams(max_tokens=16, n=3, temperature=1.0, seed=11)
    alone = [Run(model, mix, caching=False).generate(
        [prompt], SamplingParams(max_tokens=16, temperature=1.0, seed=11 + i)).outputs[0].token_ids
        for i in range(3)]
    for caching in (True, False):
        run = Run(model, mix, num_blocks=num_blocks, caching=caching)
        result = run.generate([prompt], params)
        assert [s.token_ids for s in result.outputs[0].samples] == alone
        assert len(set(alone)) == 3 and run.null_entries > 0
        forks = sum(r.forks for r in run.records)
        assert forks == 2 if num_blocks == 128 else (forks < 2 or result.num_preemptions > 0)


@pytest.mark.parametrize("mix", MIXES)
def test_multi_turn_chat_reuses_history(model, mix):
    convs = synthetic_conversations(3, 3, 9, vocab_size=CFG.vocab_size, seed=3)
    params = SamplingParams(max_tokens=7)
    runs = {c: Run(model, mix, caching=c) for c in (True, False)}
    chats = {c: run_chat(r.engine, convs, params, system_prompt=SHARED, on_step=r.on_step)
             for c, r in runs.items()}
    on, off = chats[True], chats[False]
    assert on.replies == off.replies
    assert on.num_prefill_tokens < off.num_prefill_tokens
    for turn in on.turns[1:]:
        for o in turn.outputs:
            # the history's full blocks (its last sampled token never reached the manager)
            assert o.metrics.num_cached_tokens == (o.metrics.num_prompt_tokens - 9 - 1) // BS * BS
    last = on.histories[0]
    assert on.replies[0][-1] == dense_greedy(model, mix, last[:-7], 7)
    runs[True].check_done()


@pytest.mark.parametrize("mix", MIXES)
def test_a_runner_that_reads_released_blocks_is_caught(model, mix, monkeypatch):
    """The negative control: windowed layers attending without their window, chunked
    layers over the whole table, read the null block and released slots (NaN), and the
    tokens no longer match."""
    prompts = prompts_with(SHARED, 2, 5, seed=1)
    params = SamplingParams(max_tokens=8)
    run = Run(model, mix)
    run.runner.windows = [None] * CFG.num_layers
    monkeypatch.setattr(hybrid, "local_chunks", lambda ids, comp, new, chunk, bs: (ids, comp, new))
    bad = run.engine.generate(prompts, params)
    assert [o.token_ids for o in bad.outputs] != [dense_greedy(model, mix, p, 8) for p in prompts]


def test_build_engine_with_groups(model):
    groups, layers = MIXES["gemma-like"]
    prompts = prompts_with(SHARED, 2, 3, seed=2)
    params = SamplingParams(max_tokens=6)
    engine = build_engine(CFG, groups=groups, layer_groups=layers, num_blocks=64, block_size=BS)
    assert isinstance(engine.allocator, HybridKVCacheManager) and engine.runner.layer_groups == layers
    off = build_engine(CFG, groups=groups, layer_groups=layers, num_blocks=64, block_size=BS,
                       enable_caching=False)
    assert isinstance(off.allocator, HybridKVCacheManager) and not off.allocator._index.records
    assert tokens(engine.generate(prompts, params)) == tokens(off.generate(prompts, params)) == [
        [dense_greedy(model, "gemma-like", p, 6)] for p in prompts]
    assert build_engine(CFG, groups=groups, num_blocks=8, block_size=BS).runner.layer_groups == (0, 1, 0, 1)


def test_mismatched_runner_and_allocator_are_refused(model):
    groups, layers = MIXES["gemma-like"]
    hybrid = HybridKVCacheManager(groups, 16, BS)
    with pytest.raises(ValueError, match="layer groups"):
        Engine(ModelRunner(model, 16, BS), hybrid)
    with pytest.raises(ValueError, match="layer groups"):
        Engine(HybridModelRunner(model, groups, layers, 16, BS), KVCacheManager(16, BS))
    other = HybridModelRunner(model, (sliding_window(12), full_attention()), layers, 16, BS)
    with pytest.raises(ValueError, match="layer groups"):
        Engine(other, hybrid)
    with pytest.raises(ValueError, match="not both"):
        build_engine(CFG, groups=groups, allocator=hybrid)
    with pytest.raises(ValueError, match="no host tier"):
        build_engine(CFG, groups=groups, host_blocks=4)
    with pytest.raises(ValueError, match="layer_groups needs groups"):
        build_engine(CFG, layer_groups=layers)


@pytest.mark.parametrize("deprecated", [False, True])
def test_a_manager_with_caching_off_never_hits(deprecated):
    groups = MIXES["gemma-like"][0]
    if deprecated:  # (the old name builds the same manager, and warns)
        with pytest.warns(DeprecationWarning, match="enable_caching=False"):
            m = UncachedHybridManager(groups, 32, BS)
    else:
        m = HybridKVCacheManager(groups, 32, BS, enable_caching=False)
    assert m.add_request("a", SHARED).num_cached_tokens == 0
    m.free("a")
    assert m.lookup(SHARED) == 0 and m.add_request("b", SHARED).num_cached_tokens == 0
    with pytest.raises(ValueError):
        m.lookup([])


def test_caching_off_reuses_a_freed_requests_blocks_first():
    # (vLLM's pool with caching off prepends a free's blocks, each group's tail first,
    # group by group, and takes from the front: LIFO reuse. The indexing subclass this
    # replaced kept them cached, behind blocks never used: b took 5..8, a again 9..12.)
    m = build_engine(CFG, groups=MIXES["gemma-like"][0], num_blocks=16, block_size=BS,
                     enable_caching=False).allocator
    assert m.add_request("a", list(range(8))).group_block_ids == ((1, 2), (3, 4))
    m.free("a")
    assert m.free_block_order()[:5] == [4, 3, 2, 1, 5]
    assert m.add_request("b", list(range(50, 58))).group_block_ids == ((4, 3), (2, 1))
    assert m.add_request("a2", list(range(8))).group_block_ids == ((5, 6), (7, 8))  # (no hit)
    m.check_invariants()


@pytest.mark.parametrize("seed", range(int(os.environ.get("PREFIXKV_HYBRID_SEEDS", 6))))
def test_random_mixes_pools_and_budgets_match_dense(model, seed):
    """Seeded random setups, edges included: windows shorter than a block or not a
    multiple of it, chunks of one block, pools just large enough, chunked prefill with odd
    budgets, prompts sharing prefixes of any length; greedy tokens equal the dense run.
    PREFIXKV_HYBRID_SEEDS=60 runs more seeds."""
    rng = random.Random(seed)
    window = rng.choice([2, 3, 5, 7, 10, 13])
    chunk = rng.choice([4, 8, 12])
    groups = rng.choice([(sliding_window(window), full_attention()),
                         (chunked_local(chunk), full_attention()),
                         (full_attention(), sliding_window(window), chunked_local(chunk))])
    layers = tuple(rng.randrange(len(groups)) for _ in range(CFG.num_layers))
    base = [rng.randrange(1, CFG.vocab_size) for _ in range(rng.randrange(4, 30))]
    prompts = [base[:rng.randrange(1, len(base) + 1)] + prompts_with([], 1, rng.randrange(1, 9), seed + i)[0]
               for i in range(rng.randrange(2, 5))]
    max_tokens = rng.randrange(4, 14)
    longest = max(map(len, prompts)) + max_tokens
    num_blocks = len(groups) * -(-longest // BS) + 1 + rng.randrange(0, 30)
    kw = {}
    if rng.random() < 0.5:
        kw = dict(chunked_prefill=True, max_num_batched_tokens=rng.randrange(3, 12))
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(MIXES, "random", (groups, layers))
        run = Run(model, "random", num_blocks=num_blocks, **kw)
        result = run.generate(prompts, SamplingParams(max_tokens=max_tokens))
        want = [dense_greedy(model, "random", p, max_tokens) for p in prompts]
    assert [o.token_ids for o in result.outputs] == want, (groups, layers, num_blocks, kw)

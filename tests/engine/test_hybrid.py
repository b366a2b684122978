"""A tiny model with full-attention and sliding-window layers, driven by
``HybridKVCacheManager``: greedy tokens with the cache equal the tokens the model gives
without any cache (windowed dense attention), under pool pressure (preemption and
re-admission), prefix hits and forks; every cache starts as NaN."""

from collections import deque

import pytest

pytest.importorskip("torch", reason="the example engine needs torch (pip install prefixkv[kernels])")

import torch  # noqa: E402

from prefixkv.engine import (  # noqa: E402
    LlamaConfig,
    SeqBatchEntry,  # noqa: E402
    TinyLlama,
)
from prefixkv.engine.hybrid import HybridModelRunner, dense_group_attention  # noqa: E402
from prefixkv.errors import ConfigError  # noqa: E402
from prefixkv.groups import HybridKVCacheManager, chunked_local, full_attention, sliding_window  # noqa: E402

CFG = LlamaConfig(vocab_size=97, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                  head_dim=16, intermediate_size=128, seed=5)
GROUPS = (full_attention(), sliding_window(7))
LAYER_GROUPS = (1, 0, 1, 1)
BS = 4


def run(num_blocks, prompts, max_new, fork_at=None):
    """Generate greedily; ``fork_at``: (parent, child) forked after the parent's prefill,
    the child's first token forced to (greedy + 1) % vocab. Returns tokens per request,
    the forced positions, the number of preemptions and the manager."""
    model = TinyLlama(CFG)
    m = HybridKVCacheManager(GROUPS, num_blocks, BS, seed=0)
    runner = HybridModelRunner(model, GROUPS, LAYER_GROUPS, num_blocks, BS, poison=True)
    tokens = {rid: list(p) for rid, p in prompts.items()}
    made = {rid: 0 for rid in prompts}
    forced: dict[str, int] = {}
    waiting = deque((rid, False) for rid in prompts)
    running: list[str] = []
    preemptions = 0
    while waiting or running:
        entries: dict[str, SeqBatchEntry] = {}
        for rid in running:  # decode: the last sampled token
            while m.append_tokens(rid, [tokens[rid][-1]]) is None:
                others = [r for r in running if r != rid]
                assert others, "a lone request must fit the pool"
                victim = others[-1]  # the latest admitted
                m.preempt(victim)
                preemptions += 1
                running.remove(victim)
                entries.pop(victim, None)
                waiting.appendleft((victim, True))
            n = len(tokens[rid])
            entries[rid] = SeqBatchEntry(m.get_block_ids(rid), n - 1, [tokens[rid][-1]])
        while waiting:
            rid, resumed = waiting[0]
            # a re-admitted request computes its last sampled token with the prefill
            adm = m.add_request(rid, tokens[rid], resumed=resumed)
            if adm is None:
                break
            waiting.popleft()
            running.append(rid)
            entries[rid] = SeqBatchEntry(adm.group_block_ids, adm.num_cached_tokens,
                                       tokens[rid][adm.num_cached_tokens:])
        order = [r for r in running if r in entries]
        logits = runner.execute([entries[r] for r in order], m.take_kv_ops())
        for rid, row in zip(order, logits, strict=True):
            tokens[rid].append(int(row.argmax()))
            made[rid] += 1
        if fork_at is not None and fork_at[0] in running and made[fork_at[0]] == 1:
            parent, child = fork_at
            fork_at = None
            assert m.fork(parent, child) is not None
            tokens[child], made[child] = list(tokens[parent]), 1
            forced[child] = len(tokens[child]) - 1  # its last token: replaced below
            tokens[child][-1] = (tokens[child][-1] + 1) % CFG.vocab_size
            prompts = {**prompts, child: prompts[parent]}
            running.append(child)
        for rid in list(running):
            if made[rid] >= max_new:
                m.free(rid)
                running.remove(rid)
        m.check_invariants()
    return tokens, forced, preemptions, m


def dense_check(tokens, prompts, forced):
    """Every generated token is the dense model's greedy choice (forced ones: + 1)."""
    model = TinyLlama(CFG)
    specs = [GROUPS[g] for g in LAYER_GROUPS]
    for rid, seq in tokens.items():
        ids = torch.tensor(seq, dtype=torch.int64)
        hidden = model(ids, torch.arange(len(seq)), dense_group_attention([0, len(seq)], specs))
        greedy = model.logits(hidden).argmax(-1).tolist()
        for t in range(len(prompts[rid]), len(seq)):
            want = greedy[t - 1] if forced.get(rid) != t else (greedy[t - 1] + 1) % CFG.vocab_size
            assert seq[t] == want, (rid, t)


SHARED = [5, 17, 33, 2, 8, 61, 40, 7, 19, 23, 3, 11, 70, 44]  # 14 tokens


def test_tokens_match_the_uncached_model_with_hits_and_forks():
    prompts = {"a": SHARED + [1, 2], "b": SHARED + [9], "c": [4, 4, 4] + SHARED}
    tokens, forced, _, m = run(64, prompts, 12, fork_at=("a", "a2"))
    assert "a2" in tokens and m.stats.hits >= 12
    assert m.group_stats()[1].blocks_released > 0
    dense_check(tokens, {**prompts, "a2": prompts["a"]}, forced)


def test_tokens_match_the_uncached_model_under_pool_pressure_with_preemption():
    prompts = {f"r{i}": SHARED[:6 + i] + [i] for i in range(5)}
    tokens, forced, preemptions, m = run(20, prompts, 14)
    assert preemptions > 0
    dense_check(tokens, prompts, forced)


def test_runner_rejects_bad_layer_groups_and_chunks_off_the_blocks():
    model = TinyLlama(CFG)
    with pytest.raises(ValueError, match="layer_groups"):
        HybridModelRunner(model, GROUPS, (0, 1), 8, BS)
    with pytest.raises(ConfigError, match="multiple of block_size 4"):
        HybridModelRunner(model, (full_attention(), chunked_local(6)), (0, 1, 0, 1), 8, BS)
    HybridModelRunner(model, (full_attention(), chunked_local(8)), (0, 1, 0, 1), 8, BS)


def test_local_chunks_split_the_new_tokens_at_chunk_edges():
    from prefixkv.engine.hybrid import local_chunks
    # block size 2, chunk 8: sequence A computes positions 6..12 (7 new tokens after 6
    # cached), B computes position 9 only (decode)
    ids, comp, new = local_chunks([[10, 11, 12, 13, 14, 15, 16], [20, 21, 22, 23, 24]],
                                  [6, 9], [7, 1], chunk=8, block_size=2)
    assert ids == [[10, 11, 12, 13], [14, 15, 16], [24]]
    assert (comp, new) == ([6, 0, 1], [2, 5, 1])

"""Cascade attention on groups the manager reports for random mixed steps (decoding
requests, forks of forks, chunked prefills that start inside a shared prefix; fp32 or fp8
caches with scales, sinks, softcap, non-causal), and on any regrouping of them an engine
may pass (groups split, prefixes cut short, empty groups): always the result of one pass
over all keys. Bad groups and counts are BatchErrors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv import KVCacheManager, SharedPrefix
from prefixkv.kernels import (
    BatchError,
    build_block_table,
    build_cascade_batch,
    build_cu_seqlens_q,
    cascade_attention,
    paged_prefill_attention_reference,
)
from prefixkv.kernels.fp8 import FP8_DTYPES, quantize

from .cases import tolerance
from .conftest import PRIMARY_DEVICE, triton_skip_reason

BS, KV_HEADS, GROUP, DIM, BLOCKS = 3, 1, 2, 8, 48
PREFIXES = [list(range(100, 109)), list(range(200, 206))]


def _step(draw):
    """A step of a random batch: (groups, block ids, num_computed, num_new)."""
    m = KVCacheManager(BLOCKS, BS, seed=0)
    running: list[str] = []
    for i in range(draw(st.integers(1, 4))):  # earlier steps: prompts computed whole
        prompt = PREFIXES[draw(st.integers(0, 1))][:draw(st.integers(0, 9))] + [i] * draw(st.integers(1, 4))
        m.add_request(f"old{i}", prompt)
        m.take_kv_ops()
        running.append(f"old{i}")
        for _ in range(draw(st.integers(0, 2))):  # forks, each of the last (a fork of a fork)
            child = f"{running[-1]}'"
            m.fork(running[-1], child)
            running.append(child)
    order, computed, new = [], [], []
    for rid in running:  # this step: every running request decodes a token
        n = m.num_tokens(rid)
        m.append_tokens(rid, [7])
        order.append(rid), computed.append(n), new.append(1)
    for i in range(draw(st.integers(0, 3))):  # and new prompts prefill a chunk after their hit
        prompt = PREFIXES[draw(st.integers(0, 1))] + [50 + i] * draw(st.integers(1, 5))
        adm = m.add_request(f"new{i}", prompt, num_new_tokens=draw(st.integers(1, 6)))
        order.append(f"new{i}"), computed.append(adm.num_cached_tokens), new.append(adm.num_new_tokens)
    if draw(st.booleans()):  # a chunk after another's chunk: its cached blocks computed earlier
        prompt = PREFIXES[0] + [60]
        adm = m.add_request("late", prompt, num_new_tokens=4)
        order.append("late"), computed.append(adm.num_cached_tokens), new.append(adm.num_new_tokens)
    ids = [list(m.get_block_ids(r)) for r in order]
    return m.shared_prefixes(order), ids, computed, new


def _regroup(draw, groups):
    """Any grouping as valid as the manager's: each group's members split into parts,
    each part's prefix cut to any length, empty and one-member groups added."""
    out = []
    for g in groups:
        members = draw(st.permutations(g.members))
        cut = sorted(draw(st.sets(st.integers(1, len(members) - 1), max_size=2)))
        for part in (members[a:b] for a, b in zip([0, *cut], [*cut, len(members)], strict=True)):
            out.append(SharedPrefix(draw(st.integers(0, g.num_blocks)), tuple(part)))
    out += [SharedPrefix(draw(st.integers(0, 3)), ()) for _ in range(draw(st.integers(0, 2)))]
    return draw(st.permutations(out))


def _problem(ids, computed, new, seed, dtype=torch.float32, device="cpu"):
    """Attention arguments of the step; blocks no request holds are NaN."""
    gen = torch.Generator().manual_seed(seed)
    k, v = (torch.full((BLOCKS, BS, KV_HEADS, DIM), float("nan")) for _ in range(2))
    used = sorted({b for row in ids for b in row})
    for c in (k, v):
        c[used] = torch.randn(len(used), BS, KV_HEADS, DIM, generator=gen)
    q = torch.randn(sum(new), KV_HEADS * GROUP, DIM, generator=gen)
    seqused = [a + b for a, b in zip(computed, new, strict=True)]
    width = max(len(r) for r in ids) + 1
    return (q.to(dtype).to(device), k.to(dtype).to(device), v.to(dtype).to(device),
            build_block_table(ids, max_blocks=width, pad_id=BLOCKS - 1, device=device),
            build_cu_seqlens_q(new, device=device), torch.tensor(seqused, dtype=torch.int32, device=device),
            max(new), max(seqused))


@settings(max_examples=25, deadline=None)
@given(st.data(), st.sampled_from([{}, dict(softcap=2.0), dict(causal=False)]), st.booleans(),
       st.sampled_from([None, *FP8_DTYPES]))
def test_any_valid_grouping_of_a_managers_step_matches_one_pass(data, options, sinks, cache):
    groups, ids, computed, new = _step(data.draw)
    if data.draw(st.booleans()):
        groups = _regroup(data.draw, groups)
    args = _problem(ids, computed, new, seed=data.draw(st.integers(0, 99)))
    if sinks:
        options = {**options, "sinks": torch.tensor([0.5, -1.0])}
    dtype = torch.float32
    if cache is not None:  # both passes read the fp8 cache with its scales; q in fp16
        k_scale, v_scale = torch.tensor([0.75]), torch.tensor([1.5])
        k_cache, v_cache = quantize(args[1], k_scale, cache), quantize(args[2], v_scale, cache)
        args = (args[0].half(), k_cache, v_cache, *args[3:])
        options, dtype = {**options, "k_scale": k_scale, "v_scale": v_scale}, torch.float16
    cascade = build_cascade_batch(groups, ids, computed, new, BS)
    got, got_lse = cascade_attention(*args, cascade, return_lse=True, backend="torch", **options)
    want, want_lse = paged_prefill_attention_reference(*args, return_lse=True, **options)
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), **tolerance(dtype))
    torch.testing.assert_close(got_lse, want_lse, **tolerance(dtype))


@pytest.mark.skipif(triton_skip_reason() is not None, reason=str(triton_skip_reason()))
@given(st.data())
@settings(max_examples=3, deadline=None)
def test_the_triton_path_on_a_regrouped_step(data):
    groups, ids, computed, new = _step(data.draw)
    groups = _regroup(data.draw, groups)
    args = _problem(ids, computed, new, seed=1, dtype=torch.float16, device=PRIMARY_DEVICE)
    cascade = build_cascade_batch(groups, ids, computed, new, BS, device=PRIMARY_DEVICE)
    got = cascade_attention(*args, cascade, softcap=3.0, backend="triton")
    torch.testing.assert_close(got.float(), paged_prefill_attention_reference(*args, softcap=3.0).float(),
                               **tolerance(torch.float16))


IDS, COMPUTED, NEW = [[1, 2, 3], [1, 2, 4], [5]], [6, 6, 0], [1, 1, 2]


def test_an_empty_group_is_dropped():
    # Before: IndexError (its first member was read) instead of the documented drop.
    got = build_cascade_batch([SharedPrefix(2, ()), SharedPrefix(2, (0, 1))], IDS, COMPUTED, NEW, BS)
    assert got.num_groups == 1 and got.shift_blocks.tolist() == [2, 2, 0] and got.rows.tolist() == [0, 1]
    assert build_cascade_batch([SharedPrefix(1, ())], IDS, COMPUTED, NEW, BS).num_groups == 0


@pytest.mark.parametrize("groups, kw, match", [
    ([SharedPrefix(2, (0, 1.0))], {}, "members must be ints"),      # was a TypeError
    ([SharedPrefix(2, (0, True))], {}, "members must be ints"),     # was taken as member 1
    ([SharedPrefix(1.5, (0, 1))], {}, "num_blocks an int >= 0"),    # was a TypeError
    ([SharedPrefix(-1, (0, 1))], {}, "num_blocks an int >= 0"),
    ([SharedPrefix(2, (0, 1))], dict(block_size=0), "block_size"),  # was a ZeroDivisionError
    ([SharedPrefix(2, (0, 1))], dict(num_new=[1, -1, 2]), "num_new"),  # was taken: rows off by one
    ([SharedPrefix(2, (0, 1))], dict(num_computed=[6, 6.0, 0]), "num_computed"),
    ([SharedPrefix(1, (0, 1)), SharedPrefix(1, (1, 2))], {}, "in two groups"),
    ([SharedPrefix(2, (0, 1))], dict(num_computed=[9, 6, 0]), "request 0: 9 cached"),  # was taken
])
def test_bad_groups_and_counts_are_batch_errors(groups, kw, match):
    args = {**dict(num_computed=COMPUTED, num_new=NEW, block_size=BS), **kw}
    with pytest.raises(BatchError, match=match):
        build_cascade_batch(groups, IDS, args["num_computed"], args["num_new"], args["block_size"])


def test_counts_past_a_groups_listed_blocks_are_refused_not_padded_with_block_0():
    """The audit of r8: members (2, 3) list one block but their counts claim two cached
    blocks. The group's table was its first member's blocks padded to the widest row with
    block id 0, so the prefix pass read block 0 (another request's KV, or none) as their
    shared prefix: ``[[7, 8], [9, 0]]`` with 8 shared keys each."""
    ids, computed, new = [[7, 8, 1], [7, 8, 2], [9], [9]], [8, 8, 8, 8], [1, 1, 1, 1]
    groups = [SharedPrefix(2, (0, 1)), SharedPrefix(2, (2, 3))]
    with pytest.raises(BatchError, match=r"request 2: 8 cached \+ 1 new tokens need 3 blocks of 4, it has 1"):
        build_cascade_batch(groups, ids, computed, new, 4)
    ok = build_cascade_batch(groups, [[7, 8, 1], [7, 8, 2], [9, 3, 4], [9, 3, 5]], computed, new, 4)
    assert ok.block_table.tolist() == [[7, 8], [9, 3]] and ok.seqused_k.tolist() == [8, 8]
    with pytest.raises(BatchError, match="block_ids must be a sequence"):
        build_cascade_batch(groups, iter(ids), computed, new, 4)

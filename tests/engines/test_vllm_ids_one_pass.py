"""The plug-in's step maps block ids without a loop of bytecodes a block: vLLM's block
objects of prefixkv's ids (``Blocks.of``: one C pass, its bytecodes the same for 16
ids and 512), and the lookup's ids (``KVCacheManager.lookup_block_ids`` without a host
tier: a comprehension, 6 bytecodes a block, where the loop with its type test and
``append`` ran 16; benchmarks/results/events-r26.md). Each answers what the loop
answered. ``allocate_slots`` after a hit lists the new blocks' ids alone
(``Admission.block_ids_from``), not the hit's again (benchmarks/results/events-r28.md)."""

from __future__ import annotations

import gc
from collections import Counter

import pytest

pytest.importorskip("vllm")

from prefixkv import KVCacheManager  # noqa: E402
from prefixkv.bench.opcodes import count_opcodes  # noqa: E402
from prefixkv.integrations.vllm.pool import Blocks  # noqa: E402

BS = 4
LOOKUP = "prefixkv/core/lookups.py:lookup_block_ids"  # (and its comprehension, below)


def _counted(fn: object, own: str | None = None) -> int:
    """``fn()``'s bytecodes, or only those of the function named ``own`` (``code_name``)
    and of the functions defined in it."""
    per: Counter[str] = Counter()
    gc.disable()  # (a collection's callbacks would be counted)
    try:
        n = count_opcodes(fn, per)  # type: ignore[arg-type]
    finally:
        gc.enable()
    return n if own is None else sum(c for k, c in per.items() if k == own or k.startswith(own + "."))


def _cached(blocks: int) -> tuple[KVCacheManager, list[int], tuple[int, ...]]:
    """A manager holding a prompt of ``blocks`` full blocks (and one token more) cached,
    the prompt and the block ids its admission held."""
    m = KVCacheManager(1100, BS, enable_events=True)
    prompt = [7, *range(blocks * BS)]
    adm = m.add_request("a", prompt)
    ids = adm.block_ids
    m.free("a")
    return m, prompt, ids


@pytest.mark.parametrize("prepared", [False, True])
def test_lookup_block_ids_costs_a_comprehension_a_block(prepared: bool) -> None:
    costs = []
    for n in (16, 512):
        m, prompt, ids = _cached(n)
        p = m.prepare(prompt) if prepared else prompt
        got = m.lookup_block_ids(p)
        assert got == ids[:n] and type(got) is tuple  # the prompt's last token's block: not a hit
        # (its own: encoding ids and walking the index are other functions' costs)
        costs.append(_counted(lambda m=m, p=p: m.lookup_block_ids(p), LOOKUP))
        assert costs[-1] > 0
    assert (costs[1] - costs[0]) / (512 - 16) <= 6


def test_lookup_block_ids_with_a_host_tier_stops_at_the_device() -> None:
    m = KVCacheManager(20, BS, host_blocks=40)
    prompt = list(range(16 * BS + 1))
    ids = m.add_request("a", prompt).block_ids
    m.take_kv_ops()  # (computed: what is evicted is offloaded)
    m.free("a")
    m.add_request("b", [9000 + i for i in range(8 * BS)])  # evicts some of them to the host
    m.take_kv_ops()
    found = m.lookup(prompt) // BS
    got = m.lookup_block_ids(prompt)
    # (a host slot has a ``block_id`` too: the ids stop where the device's blocks stop)
    assert 0 < len(got) < found == 16
    assert got == ids[:len(got)]


@pytest.mark.parametrize("offset", [0, 1])
def test_blocks_of_costs_the_same_for_any_length_and_gives_the_tables_objects(offset: int) -> None:
    blocks = Blocks(600, 2, offset, lambda i: 0)
    costs = []
    for n in (16, 512):
        ids = (tuple(range(n)), tuple(range(n, 0, -1)))
        got = blocks.of(ids)
        for g, want in zip(got.blocks, ids, strict=True):
            assert type(g) is list
            assert all(a is blocks.table[i + offset] for a, i in zip(g, want, strict=True))
            assert [a.block_id for a in g] == [i + offset for i in want]
        costs.append(_counted(lambda ids=ids: blocks.of(ids)))
    assert costs[0] == costs[1]
    assert blocks.of(((), ())) is blocks.empty




@pytest.mark.parametrize("prepared", [False, True])
def test_allocate_slots_lists_the_new_blocks_ids_alone(prepared: bool) -> None:
    # a waiting request's allocate_slots after a hit of n blocks: the blocks past the
    # hit are vLLM's answer, so the hit's ids are not listed (main: all of them, ~5
    # bytecodes a block); the same new blocks, the same ids, whatever n
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from prefixkv.integrations.vllm import KVCacheManager as Plugin

    from .test_vllm_plugin import config, full

    costs = []
    for n in (16, 512):
        m = Plugin(config(full(BS), num_blocks=1100), max_model_len=BS * 600,
                   scheduler_block_size=BS, hash_block_size=BS)
        hasher = m.prepared_prompts.hasher(None) if prepared else None

        def request(rid: str, tokens: list[int], m: Plugin = m, hasher: object = hasher) -> Request:
            return Request(request_id=rid, prompt_token_ids=tokens, pooling_params=None,
                           sampling_params=SamplingParams(max_tokens=4), block_hasher=hasher)

        cached = [7, *range(n * BS)]
        a = request("a", cached)
        blocks, hit, _ = m.get_computed_blocks(a)
        assert hit == 0 and m.allocate_slots(a, len(cached)) is not None
        m.free(a)
        # (with cached's last token: 3 more full blocks, then a partial one)
        tokens = [*cached, *range(5000, 5000 + 3 * BS + 2)]
        b = request("b", tokens)
        blocks, hit, _ = m.get_computed_blocks(b)
        assert hit == (n + 1) * BS - BS  # (every full block of ``cached``: it ends a token short)
        got = []
        new = len(tokens) - hit
        costs.append(_counted(lambda m=m, b=b, new=new, hit=hit, blocks=blocks, got=got: got.append(
            m.allocate_slots(b, new, hit, blocks))))
        ids = m.core.get_block_ids(m.key_of("b"))
        off = blocks.blocks[0][0].block_id - ids[0]  # (vLLM's ids: past its null block)
        assert [x.block_id - off for x in blocks.blocks[0]] == list(ids[:hit // BS])
        assert got[0].get_block_ids() == ([i + off for i in ids[hit // BS:]],)
        assert len(ids) - hit // BS == 4
    assert (costs[1] - costs[0]) / (512 - 16) <= 1

"""Probes (``KVCacheManager.block_probe``, ``HybridKVCacheManager.prefix_probe``): one
prompt encoded once, asked which block holds each of its prefixes again and again
while the cache changes under it (core/probe.py, groups/cached.py). Each answer is the
one a fresh walk gives now: for the one-size manager ``match``'s (through
``lookup_block_ids`` of the prefix with one token more), for the hybrid one a probe made
anew. And the cost of a question does not grow with the prompt (vLLM's connectors ask
every block of a request, every step)."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv import KVCacheManager
from prefixkv.bench.opcodes import count_opcodes
from prefixkv.groups import HybridKVCacheManager, full_attention, sliding_window

BS = 4
# prompts sharing prefixes (and one block-aligned, whose re-admission makes a spare)
PROMPTS = [list(range(12)), [*range(8), 50, 51, 52, 53, 54], [*range(4), 60, 61, 62, 63, 64],
           [70] * 9, list(range(16))]


def _truth(m: KVCacheManager, prompt: list[int], n: int) -> int | None:
    ids = m.lookup_block_ids([*prompt[:n], 0])  # (its hit: every block before the last token's)
    return ids[n // BS - 1] if len(ids) >= n // BS else None


OPS = st.lists(st.tuples(st.sampled_from(["add", "free", "add again"]), st.integers(0, len(PROMPTS) - 1)),
               min_size=4, max_size=30)


def _drive(m: Any, ops: list[tuple[str, int]], check: Callable[[int], None]) -> None:
    """Admit and free ``PROMPTS`` as ``ops`` say (an admission that does not fit is
    skipped), events taken, ``check(serial)`` after each."""
    live: dict[str, int] = {}
    for serial, (op, i) in enumerate(ops):
        if op == "free":
            for rid in [r for r, j in live.items() if j == i][:1]:
                m.free(rid)
                del live[rid]
        elif m.add_request(f"r{serial}", PROMPTS[i]) is not None:
            live[f"r{serial}"] = i
        m.take_events()
        check(serial)


def _sizes(p: list[int]) -> range:
    return range(BS, len(p) // BS * BS + 1, BS)


@settings(max_examples=40, deadline=None)
@given(num_blocks=st.integers(4, 12), ops=OPS, events=st.booleans())
def test_a_probe_answers_as_a_fresh_walk_while_blocks_come_and_go(num_blocks, ops, events):
    m = KVCacheManager(num_blocks, BS, enable_events=events)
    probes = [m.block_probe(p) for p in PROMPTS]

    def check(serial: int) -> None:
        for p, probe in zip(PROMPTS, probes, strict=True):
            for n in _sizes(p):
                assert probe.at(n) == _truth(m, p, n) == m.cached_block_id(p, n), (serial, p, n)

    _drive(m, ops, check)
    assert m.check_invariants() is None


@settings(max_examples=40, deadline=None)
@given(num_blocks=st.integers(10, 20), ops=OPS, events=st.booleans())
def test_a_hybrid_probe_answers_as_a_fresh_one_while_blocks_come_and_go(num_blocks, ops, events):
    m = HybridKVCacheManager([full_attention(), sliding_window(2 * BS)], num_blocks, BS, enable_events=events)
    probes = [m.prefix_probe(p) for p in PROMPTS]

    def check(serial: int) -> None:
        for p, probe in zip(PROMPTS, probes, strict=True):
            for n in _sizes(p):
                assert probe.ids(n) == m.prefix_probe(p).ids(n), (serial, p, n)

    _drive(m, ops, check)


def test_a_spare_that_takes_over_is_the_answer_and_a_block_refilled_as_a_spare_is_not():
    m = KVCacheManager(6, BS)
    p = PROMPTS[4]  # 16 tokens: 4 full blocks
    m.add_request("a", p)
    probe, other = m.block_probe(p), m.block_probe(p)
    assert probe.at(16) == other.at(16) == 3
    assert m.add_request("b", p).block_ids == (0, 1, 2, 4)  # its last block computed anew: a spare
    m.free("a")
    assert probe.at(16) == 3  # (the primary, free and cached)
    assert m.add_request("c", [90] * 8).block_ids == (5, 3)  # a's freed last block: b's spare takes over
    assert other.at(16) == _truth(m, p, 16) == 4
    m.free("c")
    assert m.add_request("d", p).block_ids == (0, 1, 2, 3)
    # block 3 holds its old content again (the same content id), as a spare of 4: not the answer
    assert probe.at(16) == other.at(16) == _truth(m, p, 16) == 4


def test_a_hybrid_probe_walks_again_once_its_prefix_left_the_table():
    m = HybridKVCacheManager([full_attention(), sliding_window(2 * BS)], 12, BS)
    p = PROMPTS[4]
    probe = m.prefix_probe(p)
    m.add_request("a", p)
    assert probe.ids(16) == (4, 8)
    m.free("a")
    for i in range(3):  # (other prompts take every block a left)
        m.add_request(f"c{i}", [90 + i] * 8)
        m.free(f"c{i}")
    assert probe.ids(16) == (None, None)
    m.add_request("a2", p)  # the same prefix, new nodes
    assert probe.ids(16) == m.prefix_probe(p).ids(16) == (3, 1)


@pytest.mark.parametrize("hybrid", [False, True])
def test_a_question_costs_the_same_on_a_long_prompt(hybrid):
    def cost(blocks: int) -> int:
        prompt = [(i * 31) % 1000 for i in range(blocks * BS)]
        if hybrid:
            m = HybridKVCacheManager([full_attention(), sliding_window(2 * BS)], 2 * blocks + 4, BS)
            m.add_request("a", prompt)
            ask = m.prefix_probe(prompt).ids
        else:
            m = KVCacheManager(blocks + 2, BS)
            m.add_request("a", prompt)
            ask = m.block_probe(prompt).at
        for n in range(BS, blocks * BS + 1, BS):  # (every block once: the walk's cost paid)
            ask(n)
        gc.disable()  # (a collection's callbacks would be counted)
        try:
            return count_opcodes(lambda: ask(blocks * BS // 2))
        finally:
            gc.enable()

    assert cost(512) == cost(16)

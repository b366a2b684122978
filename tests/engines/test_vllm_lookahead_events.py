"""KV events under vLLM 0.33's lookahead hashing (``num_hash_lookahead_tokens`` = L > 0)
on one full-attention group: prefixkv's plug-in beside vLLM's own ``KVCacheManager``, both
with ``enable_kv_cache_events``, on test_vllm_lookahead's random streams (chunked prompts,
decode steps, ``cache_blocks``, frees, preemptions), then requests that fill the pool
until every cached block is evicted (``BlockRemoved``: both views then hold only the
fill requests' contents).

The hashes differ (prefixkv's chain hashes, vLLM's own), so each side's events are read
as a consumer reads them: a ``BlockStored`` names each block by its parent's content,
its own tokens and the ``lookahead_token_ids`` after it; a count of stores minus
removals per content (an ``AllBlocksCleared`` clears them). After every call the
contents each side's events say are cached are the same, each announced with the same
``token_ids``, ``lookahead_token_ids`` and ``extra_keys`` (the consumer's view is
exactly vLLM's); hits, probes, free counts and ``get_cached_block`` agree as in
test_vllm_lookahead. Needs vllm installed."""

from __future__ import annotations

import os
import random
from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lookahead_model import LookaheadModel

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
pytest.importorskip("torch")

from .test_vllm_lookahead import _agree, _pair, _request, run_stream  # noqa: E402
from .test_vllm_lookahead_model import ALPHABET, BS  # noqa: E402


class Contents:
    """A consumer's view of one manager's events: content -> stores minus removals, a
    content being ``(the tokens up to the block's end, the L tokens after it, the
    block's extra keys)``, found from the event's parent and fields."""

    def __init__(self, manager: Any) -> None:
        self.m, self.count, self.removed = manager, Counter(), 0
        self.of: dict[Any, tuple[Any, ...]] = {}  # hash -> content (kept once seen)

    def drain(self) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        for ev in self.m.take_events():
            if isinstance(ev, AllBlocksCleared):
                self.count.clear()
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    self.count[self.of[h]] -= 1
                    self.removed += 1
            else:
                assert isinstance(ev, BlockStored) and ev.block_size == BS
                n = len(ev.block_hashes)
                assert ev.lookahead_token_ids is not None and len(ev.lookahead_token_ids) == n
                assert ev.extra_keys is not None and len(ev.extra_keys) == n
                prefix = () if ev.parent_block_hash is None else self.of[ev.parent_block_hash][0]
                for i, h in enumerate(ev.block_hashes):
                    prefix = (*prefix, *ev.token_ids[i * BS:(i + 1) * BS])
                    content = (prefix, tuple(ev.lookahead_token_ids[i]), ev.extra_keys[i])
                    assert self.of.setdefault(h, content) == content, "one hash, one content"
                    self.count[content] += 1

    def cached(self) -> set[tuple[Any, ...]]:
        return {c for c, n in self.count.items() if n > 0}


@pytest.mark.parametrize(("lookahead", "prefill_lookahead"), [(1, 0), (1, 1), (2, 2), (3, 3), (2, 0), (1, 3)])
@settings(max_examples=10, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1))
def test_events_name_the_contents_vllms_events_name(lookahead, prefill_lookahead, seed):
    managers = _pair(lookahead, prefill_lookahead, enable_kv_cache_events=True)
    model = LookaheadModel(BS, lookahead, prefill_lookahead)
    views = [Contents(m) for m in managers]
    seen = [0]

    def same(serial: Any) -> None:
        for v in views:
            v.drain()
        ours, theirs = (v.cached() for v in views)
        assert ours == theirs, (serial, ours ^ theirs)
        seen[0] = max(seen[0], len(ours))

    def check(live: dict[str, Any], serial: int) -> None:
        _agree(managers, model, live, lookahead, serial)
        same(serial)

    live = run_stream(random.Random(seed), managers, model, lookahead, check)
    assert seen[0] > 0  # (the stream cached something: the comparison is not of two empty sets)
    for r in live.values():
        for m in managers:
            m.free(r)
    # requests of new tokens, held, until neither pool has a block left (4 blocks each,
    # then 1): every cached block is evicted on both sides. The order in which they go is
    # not compared: in some streams prefixkv evicts a block one step after vLLM does
    # ((L, P) = (2, 2), seed 108841: docs/lookahead.md, "What serving the rest takes")
    for k in range(500):
        n = 4 * BS if k < 120 else BS
        r = _request(f"fill{k}", [ALPHABET + 1 + 16 * k + i for i in range(n)], lookahead, managers[0])
        got = [m.allocate_slots(r, r.num_tokens) is not None for m in managers]
        assert got[0] == got[1], k
        for v in views:
            v.drain()
        if not got[0] and n == BS:
            break
    same("filled")
    assert views[0].removed == views[1].removed > 0

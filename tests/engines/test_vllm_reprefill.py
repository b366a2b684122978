"""Multi-module MTP's re-prefillable tokens (``num_prefill_lookahead`` = P > 1, lookahead
hashing off) on one full-attention group: prefixkv's plug-in beside vLLM 0.33's own
``KVCacheManager`` and tests/lookahead_model.py on random request streams (chunked
prompts, decode steps that append a sampled token, frees), with and without EAGLE's
block drop. Admission hits, the hit a probe of every live request's tokens finds, the
free block count and the blocks each call's events announce (their count and tokens)
must agree after every call (docs/lookahead.md). Needs vllm installed."""

from __future__ import annotations

import os
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lookahead_model import LookaheadModel

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
pytest.importorskip("torch")

from .test_vllm_lookahead_model import ALPHABET, BS, _request  # noqa: E402
from .test_vllm_plugin import config, full  # noqa: E402


def _pair(prefill_lookahead: int, use_eagle: bool) -> tuple[Any, Any]:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager as Theirs
    from vllm.v1.core.kv_cache_utils import init_none_hash

    from prefixkv.integrations.vllm import KVCacheManager as Ours

    init_none_hash(sha256)
    kw = dict(max_model_len=256, enable_caching=True, hash_block_size=BS, scheduler_block_size=BS,
              use_eagle=use_eagle, num_prefill_lookahead=prefill_lookahead, enable_kv_cache_events=True)
    return (Ours(config(full(BS), num_blocks=400), **kw), Theirs(config(full(BS), num_blocks=400), **kw))


def _hit(model: LookaheadModel, tokens: list[int], use_eagle: bool) -> int:
    hit = model.hit(tokens)
    return max(0, hit - BS) if use_eagle else hit  # (EAGLE drops the hit's last block)


@pytest.mark.parametrize("prefill_lookahead", [2, 3])
@pytest.mark.parametrize("use_eagle", [False, True])
@settings(max_examples=20, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1))
def test_prefixkv_caches_the_re_prefillable_tokens_a_step_late_as_vllm(prefill_lookahead, use_eagle, seed):
    rng = random.Random(seed)
    managers = _pair(prefill_lookahead, use_eagle)
    model = LookaheadModel(BS, 0, prefill_lookahead)
    live: dict[str, Any] = {}
    announced: tuple[set[Any], set[Any]] = (set(), set())
    for serial in range(40):
        op = rng.random()
        if op < 0.35 or not live:
            n = rng.randint(1, 6 * BS)
            r = _request(f"r{serial}", [rng.randrange(ALPHABET) for _ in range(n)], 0)
            found = [m.get_computed_blocks(r)[:2] for m in managers]
            hit = _hit(model, list(r.all_token_ids), use_eagle)
            assert [h for _, h in found] == [hit, hit], (serial, list(r.all_token_ids))
            chunk, delay = rng.randint(1, r.num_tokens - hit), rng.random() < 0.2
            for m, (blocks, _) in zip(managers, found, strict=True):
                assert m.allocate_slots(r, chunk, hit, blocks, delay_cache_blocks=delay) is not None
            r.num_computed_tokens = hit + chunk
            live[r.request_id] = r
            if delay:  # (nothing cached past the hit: a load in flight)
                _agree(managers, model, live, use_eagle, serial, announced)
                continue
        else:
            r = live_call(rng, op, managers, live)
        if r.request_id in live:
            model.allocate(list(r.all_token_ids), r.num_computed_tokens)
        _agree(managers, model, live, use_eagle, serial, announced)


def live_call(rng: random.Random, op: float, managers: tuple[Any, ...], live: dict[str, Any]) -> Any:
    """One call on a live request, the same on every manager, by ``op`` in [0.35, 1): the
    scheduler's ``cache_blocks`` (a step's outputs, a landed load), a step (a decode step
    appends a sampled token first), a free (the request leaves ``live``); the request."""
    if op < 0.5:
        r = live[rng.choice(sorted(live))]
        for m in managers:
            m.cache_blocks(r, r.num_computed_tokens)
    elif op < 0.8:
        r = live[rng.choice(sorted(live))]
        if r.num_computed_tokens == r.num_tokens:  # decode: a sampled token
            r.append_output_token_ids(rng.randrange(ALPHABET))
        n = rng.randint(1, r.num_tokens - r.num_computed_tokens)
        for m in managers:
            assert m.allocate_slots(r, n) is not None
        r.num_computed_tokens += n
    else:
        r = live.pop(rng.choice(sorted(live)))
        for m in managers:
            m.free(r)
    return r


def _agree(managers: tuple[Any, Any], model: LookaheadModel, live: dict[str, Any], use_eagle: bool,
           serial: int, announced: tuple[set[Any], set[Any]]) -> None:
    """A probe of each live request's tokens (and one more) hits alike on all three; the
    pools hold as many free blocks."""
    for r in live.values():
        probe = _request(f"probe{serial}-{r.request_id}", [*r.all_token_ids, ALPHABET], 0)
        hit = _hit(model, list(probe.all_token_ids), use_eagle)
        assert [m.get_computed_blocks(probe)[1] for m in managers] == [hit, hit], (r.request_id, serial)
    ours, theirs = managers
    assert ours.block_pool.get_num_free_blocks() == theirs.block_pool.get_num_free_blocks()
    # the blocks cached so far, announced alike: as many distinct hashes (nothing is
    # evicted: a large pool; vLLM announces a hash again for a second block of equal
    # content, prefixkv once (index/content.py), so the counts are of distinct ones)
    for m, seen in zip(managers, announced, strict=True):
        seen.update(h for e in m.take_events() for h in e.block_hashes)
    assert len(announced[0]) == len(announced[1]), serial


def test_multi_module_mtp_beside_eagle_needs_a_block_as_long_as_its_lookahead():
    from prefixkv.errors import ConfigError

    # vLLM's coordinator raises ValueError: the dropped block must hold the re-prefilled tokens
    with pytest.raises(ConfigError, match="num_prefill_lookahead"):
        _pair(BS + 1, True)
    assert _pair(BS, True)[0].use_eagle

"""tests/lookahead_model.py (lookahead hashing and MTP's re-prefillable tokens on one
full-attention group) beside vLLM 0.33's own ``KVCacheManager``: random request streams
(chunked prompts, decode steps that append a sampled token, frees) on both; hits, the
hashes a request has and which of them are cached must agree after every call. The KV
side (``KVModel``) checks that no hit the reference serves holds KV of other tokens, and
that with the lookahead left out of the keys (prefixkv's keys today) one would.
Needs vllm installed."""

from __future__ import annotations

import os
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lookahead_model import KVModel, LookaheadModel

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
pytest.importorskip("torch")

from .test_vllm_plugin import config, full  # noqa: E402

BS = 4
ALPHABET = 3  # few token ids: prompts share prefixes and diverge inside lookaheads


def _vllm(lookahead: int, prefill_lookahead: int) -> Any:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)
    return KVCacheManager(config(full(BS), num_blocks=400), max_model_len=256, enable_caching=True,
                          hash_block_size=BS, scheduler_block_size=BS,
                          num_hash_lookahead_tokens=lookahead, num_prefill_lookahead=prefill_lookahead)


def _request(rid: str, tokens: list[int], lookahead: int) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    return Request(request_id=rid, prompt_token_ids=tokens, sampling_params=SamplingParams(max_tokens=64),
                   pooling_params=None, block_hasher=get_request_block_hasher(BS, sha256, lookahead))


def _run(lookahead: int, prefill_lookahead: int, seed: int, steps: int) -> tuple[bool, bool]:
    """Drive vLLM and the reference with one stream (hits, hashes and cached hashes
    agree after every call); whether every hit held the reader's own KV: the
    reference's, and that of the same caching keyed by the prefix alone (``plain``)."""
    rng = random.Random(seed)
    theirs = _vllm(lookahead, prefill_lookahead)
    ours = LookaheadModel(BS, lookahead, prefill_lookahead)
    plain = LookaheadModel(BS, 0, prefill_lookahead)
    kv, plain_kv = KVModel(BS, lookahead, prefill_lookahead), KVModel(BS, lookahead, prefill_lookahead)
    live: dict[str, Any] = {}
    sound = plain_sound = True
    for serial in range(steps):
        op = rng.random()
        if op < 0.35 or not live:
            n = rng.randint(1, 6 * BS)
            r = _request(f"r{serial}", [rng.randrange(ALPHABET) for _ in range(n)], lookahead)
            blocks, hit, _ = theirs.get_computed_blocks(r)
            tokens = list(r.all_token_ids)
            assert hit == ours.hit(tokens), (serial, tokens)
            sound &= _served_rightly(ours, kv, tokens, hit)
            plain_sound &= _served_rightly(plain, plain_kv, tokens, plain.hit(tokens))
            chunk = rng.randint(1, r.num_tokens - hit)
            assert theirs.allocate_slots(r, chunk, hit, blocks) is not None
            r.num_computed_tokens = hit + chunk
            live[r.request_id] = r
        elif op < 0.8:
            r = live[rng.choice(sorted(live))]
            if r.num_computed_tokens == r.num_tokens:  # decode: a sampled token
                r.append_output_token_ids(rng.randrange(ALPHABET))
            n = rng.randint(1, r.num_tokens - r.num_computed_tokens)
            assert theirs.allocate_slots(r, n) is not None
            r.num_computed_tokens += n
        else:
            r = live.pop(rng.choice(sorted(live)))
            theirs.free(r)
            continue
        tokens, computed = list(r.all_token_ids), r.num_computed_tokens
        for i, key in ours.allocate(tokens, computed):
            kv.write(key, tokens, i, computed)
            plain_key = plain.key(tokens, i)  # (cached as late as the reference)
            assert plain_key is not None
            plain.cached.add(plain_key)
            plain_kv.write(plain_key, tokens, i, computed)
        _agree(theirs, ours, live)
    return sound, plain_sound


def _served_rightly(model: LookaheadModel, kv: KVModel, tokens: list[int], hit: int) -> bool:
    """Whether each block of a hit of ``hit`` tokens holds the KV ``tokens`` would compute."""
    keys = [model.key(tokens, i) for i in range(hit // BS)]
    return all(k is not None and kv.served_rightly(k, tokens, i) for i, k in enumerate(keys))


def _agree(theirs: Any, ours: LookaheadModel, live: dict[str, Any]) -> None:
    """Every live request's hashes, and whether each is cached, as the reference says."""
    pool = theirs.block_pool
    for r in live.values():
        tokens = list(r.all_token_ids)
        assert len(r.block_hashes) == ours.num_hashes(tokens), (r.request_id, tokens)
        for i, h in enumerate(r.block_hashes):
            cached = pool.get_cached_block(h, [0]) is not None
            assert cached == (ours.key(tokens, i) in ours.cached), (r.request_id, i, tokens)


CASES = [(1, 0), (1, 1), (2, 2), (3, 3), (2, 0), (0, 2), (0, 3), (1, 3)]
"""(L, P): vLLM runs L = P (``num_hash_lookahead_tokens`` is ``num_prefill_lookahead_tokens``
when it hashes ahead: EAGLE 1, multi-module MTP its module count); the others each
rule alone."""


@pytest.mark.parametrize(("lookahead", "prefill_lookahead"), CASES)
@settings(max_examples=25, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1))
def test_the_reference_caches_and_hits_as_vllm_and_serves_only_the_readers_kv(
        lookahead, prefill_lookahead, seed):
    assert _run(lookahead, prefill_lookahead, seed, steps=40)[0]


@pytest.mark.parametrize("lookahead", [1, 2])
def test_keys_without_the_lookahead_would_serve_kv_of_other_tokens(lookahead):
    # the same caching, keyed by the prefix alone (prefixkv's content keys): some hit
    # serves a block whose last positions' drafter KV read other tokens after it
    assert not all(_run(lookahead, lookahead, seed, steps=60)[1] for seed in range(40))

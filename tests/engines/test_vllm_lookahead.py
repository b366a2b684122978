"""vLLM 0.33's lookahead hashing (``num_hash_lookahead_tokens`` = L > 0, with and without
multi-module MTP's ``num_prefill_lookahead`` = P) on one full-attention group: prefixkv's
plug-in (integrations/vllm/lookahead.py) beside vLLM's own ``KVCacheManager`` and
tests/lookahead_model.py on random request streams (chunked prompts, decode steps that
append a sampled token, the scheduler's ``cache_blocks``, frees, preemptions). After every call these
agree: admission hits, the hit a probe of every live request's tokens finds, the free
block counts, and which of every live request's block hashes ``get_cached_block``
finds (docs/lookahead.md). And what stays refused, by name. Needs vllm installed."""

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

from .test_vllm_lookahead_model import ALPHABET, BS  # noqa: E402
from .test_vllm_plugin import config, full  # noqa: E402
from .test_vllm_reprefill import live_call  # noqa: E402


def _pair(lookahead: int, prefill_lookahead: int, **options: Any) -> tuple[Any, Any]:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager as Theirs
    from vllm.v1.core.kv_cache_utils import init_none_hash

    from prefixkv.integrations.vllm import KVCacheManager as Ours

    init_none_hash(sha256)
    kw = dict(max_model_len=256, enable_caching=True, hash_block_size=BS, scheduler_block_size=BS,
              num_hash_lookahead_tokens=lookahead, num_prefill_lookahead=prefill_lookahead, **options)
    return (Ours(config(full(BS), num_blocks=400), **kw), Theirs(config(full(BS), num_blocks=400), **kw))


def _request(rid: str, tokens: list[int], lookahead: int, ours: Any) -> Any:
    """A vLLM Request hashed with lookahead, built with prefixkv's hasher in front (it
    notes the request: its Prompt, and the prefixes its hashes name)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    hasher = ours.prepared_prompts.hasher(get_request_block_hasher(BS, sha256, lookahead))
    return Request(request_id=rid, prompt_token_ids=tokens, sampling_params=SamplingParams(max_tokens=64),
                   pooling_params=None, block_hasher=hasher)


@pytest.mark.parametrize(("lookahead", "prefill_lookahead"), [(1, 0), (1, 1), (2, 2), (3, 3), (2, 0), (1, 3)])
@settings(max_examples=15, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1))
def test_prefixkv_keys_blocks_with_their_lookahead_tokens_as_vllm(lookahead, prefill_lookahead, seed):
    managers = _pair(lookahead, prefill_lookahead)
    model = LookaheadModel(BS, lookahead, prefill_lookahead)
    run_stream(random.Random(seed), managers, model, lookahead,
               lambda live, serial: _agree(managers, model, live, lookahead, serial))


def run_stream(rng: random.Random, managers: tuple[Any, Any], model: LookaheadModel, lookahead: int,
               check: Any) -> dict[str, Any]:
    """40 random calls on both managers (admissions, preemptions, ``live_call``'s), the
    reference caching as vLLM; ``check(live, serial)`` after each. Returns the live
    requests by id."""
    live: dict[str, Any] = {}
    for serial in range(40):
        op = rng.random()
        if op < 0.35 or not live:
            n = rng.randint(1, 6 * BS)
            r = _request(f"r{serial}", [rng.randrange(ALPHABET) for _ in range(n)], lookahead, managers[0])
            found = [m.get_computed_blocks(r)[:2] for m in managers]
            hit = model.hit(list(r.all_token_ids))
            assert [h for _, h in found] == [hit, hit], (serial, list(r.all_token_ids))
            chunk = rng.randint(1, r.num_tokens - hit)
            for m, (blocks, _) in zip(managers, found, strict=True):
                assert m.allocate_slots(r, chunk, hit, blocks) is not None
            r.num_computed_tokens = hit + chunk
            live[r.request_id] = r
        elif op > 0.93:  # preempted, then admitted again with its outputs
            r = live[rng.choice(sorted(live))]
            _readmit(r, managers, model)
        else:  # cache_blocks, a step, a free
            r = live_call(rng, op, managers, live)
        if r.request_id in live:
            model.allocate(list(r.all_token_ids), r.num_computed_tokens)
        check(live, serial)
    return live


def _readmit(r: Any, managers: tuple[Any, Any], model: LookaheadModel) -> None:
    """vLLM's preemption (``free``, the count set back to 0), then the request's
    admission again, whole: its hit as the reference's."""
    from vllm.v1.request import RequestStatus

    for m in managers:
        m.free(r)
    r.status, r.num_computed_tokens = RequestStatus.PREEMPTED, 0
    r.num_preemptions += 1
    found = [m.get_computed_blocks(r)[:2] for m in managers]
    hit = model.hit(list(r.all_token_ids))
    assert [h for _, h in found] == [hit, hit], list(r.all_token_ids)
    for m, (blocks, _) in zip(managers, found, strict=True):
        assert m.allocate_slots(r, r.num_tokens - hit, hit, blocks) is not None
    r.status, r.num_computed_tokens = RequestStatus.RUNNING, r.num_tokens


def _agree(managers: tuple[Any, Any], model: LookaheadModel, live: dict[str, Any], lookahead: int,
           serial: int) -> None:
    """A probe of each live request's tokens (and one more) hits alike on all three; the
    pools hold as many free blocks; each live request's hashes are found alike."""
    ours, theirs = managers
    for r in live.values():
        probe = _request(f"probe{serial}-{r.request_id}", [*r.all_token_ids, ALPHABET], lookahead, ours)
        hit = model.hit(list(probe.all_token_ids))
        assert [m.get_computed_blocks(probe)[1] for m in managers] == [hit, hit], (r.request_id, serial)
        found = [[m.block_pool.get_cached_block(h, [0]) is not None for h in r.block_hashes]
                 for m in managers]
        assert found[0] == found[1], (r.request_id, serial, found)
    assert ours.block_pool.get_num_free_blocks() == theirs.block_pool.get_num_free_blocks()


def test_what_lookahead_hashing_does_not_offer_is_refused_by_name():
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    from prefixkv.integrations.vllm import KVCacheManager
    from prefixkv.integrations.vllm.layout import UnsupportedByPrefixKV

    init_none_hash(sha256)

    from .test_vllm_plugin import BS as PBS
    from .test_vllm_plugin import window

    kw = dict(max_model_len=256, enable_caching=True, scheduler_block_size=BS, num_hash_lookahead_tokens=1)
    with pytest.raises(UnsupportedByPrefixKV, match="lookahead hashing"):
        KVCacheManager(config(full(BS), num_blocks=40), hash_block_size=BS, use_eagle=True, **kw)
    with pytest.raises(UnsupportedByPrefixKV, match="lookahead hashing"):  # (beside a window)
        KVCacheManager(config(full(PBS), window(), num_blocks=40), hash_block_size=PBS,
                       **{**kw, "scheduler_block_size": PBS})
    with pytest.raises(UnsupportedByPrefixKV, match="lookahead hashing"):  # (a block of 1 token)
        KVCacheManager(config(full(1), num_blocks=40), hash_block_size=1, **{**kw, "scheduler_block_size": 1})
    ours = KVCacheManager(config(full(BS), num_blocks=40), hash_block_size=BS, **kw)
    r = _request("r", list(range(3 * BS)), 1, ours)
    with pytest.raises(UnsupportedByPrefixKV, match="delay_cache_blocks"):
        ours.allocate_slots(r, r.num_tokens, delay_cache_blocks=True)
    # caching off: nothing is keyed, so nothing to refuse (vLLM caches nothing either)
    off = KVCacheManager(config(full(BS), num_blocks=40), hash_block_size=BS,
                         **{**kw, "enable_caching": False})
    assert off.allocate_slots(r, r.num_tokens) is not None


def _spec_step(rng: random.Random, r: Any, managers: tuple[Any, Any], model: LookaheadModel,
               drafts: int) -> list[int] | None:
    """A speculative decode step as vLLM's scheduler makes it: ``drafts`` draft tokens
    (``spec_token_ids``, not among the request's tokens) scheduled after its pending
    sampled token with ``num_lookahead_tokens`` slots for the next drafts; then the
    first ``a`` drafts accepted, the rest rejected (``num_computed_tokens`` set back by
    them), the accepted ones and a bonus token appended (the reference caches at the
    call, with the tokens known then: the drafts are not among them). Returns the tokens the request
    had with every draft after them, when one was rejected."""
    if r.num_computed_tokens == r.num_tokens:  # (the pending sampled token)
        r.append_output_token_ids(rng.randrange(ALPHABET))
    if r.num_tokens - r.num_computed_tokens != 1:  # (a prefill still in its chunks)
        return None
    r.spec_token_ids = [rng.randrange(ALPHABET) for _ in range(drafts)]
    n = r.num_tokens_with_spec - r.num_computed_tokens
    for m in managers:
        assert m.allocate_slots(r, n, num_lookahead_tokens=drafts) is not None
    r.num_computed_tokens += n
    model.allocate(list(r.all_token_ids), r.num_computed_tokens)
    accepted = rng.randint(0, drafts)
    bonus = rng.randrange(ALPHABET)
    out = [*r.spec_token_ids[:accepted], bonus]
    r.num_computed_tokens -= drafts - accepted
    took = [*r.all_token_ids, *r.spec_token_ids] if accepted < drafts else None
    r.spec_token_ids = []
    for t in out:
        r.append_output_token_ids(t)
    return took


@pytest.mark.parametrize(("lookahead", "prefill_lookahead", "drafts"),
                         [(1, 0, 1), (1, 0, 3), (2, 0, 2), (3, 3, 3)])
@settings(max_examples=10, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1))
def test_speculative_steps_key_only_accepted_tokens_as_vllm(lookahead, prefill_lookahead, drafts, seed):
    """Draft tokens accepted and rejected (EAGLE/MTP's steps): a block is keyed with
    the tokens after it that the request kept, never a rejected draft, as vLLM's hashes
    are; so a later request whose tokens after a block are the rejected drafts finds it
    only where vLLM does (every probe, both managers and the reference alike)."""
    rng = random.Random(seed)
    managers = _pair(lookahead, prefill_lookahead)
    model = LookaheadModel(BS, lookahead, prefill_lookahead)
    live: dict[str, Any] = {}
    rejected: list[list[int]] = []
    for serial in range(30):
        op = rng.random()
        if op < 0.3 or not live:
            tokens = [rng.randrange(ALPHABET) for _ in range(rng.randint(1, 5 * BS))]
            if rejected and rng.random() < 0.5:  # (a prompt that goes on with rejected drafts)
                tokens = rng.choice(rejected) + tokens[:BS]
            r = _request(f"r{serial}", tokens, lookahead, managers[0])
            found = [m.get_computed_blocks(r)[:2] for m in managers]
            hit = model.hit(list(r.all_token_ids))
            assert [h for _, h in found] == [hit, hit], (serial, list(r.all_token_ids))
            for m, (blocks, _) in zip(managers, found, strict=True):
                got = m.allocate_slots(r, r.num_tokens - hit, hit, blocks, num_lookahead_tokens=drafts)
                assert got is not None
            r.num_computed_tokens = r.num_tokens
            live[r.request_id] = r
        elif op < 0.8:
            r = live[rng.choice(sorted(live))]
            took = _spec_step(rng, r, managers, model, drafts)
            if took is not None:
                rejected.append(took)
            _agree(managers, model, live, lookahead, serial)
            continue
        elif op < 0.9:
            r = live[rng.choice(sorted(live))]
            for m in managers:
                m.cache_blocks(r, r.num_computed_tokens)
        else:
            r = live.pop(rng.choice(sorted(live)))
            for m in managers:
                m.free(r)
        if r.request_id in live:
            model.allocate(list(r.all_token_ids), r.num_computed_tokens)
        _agree(managers, model, live, lookahead, serial)

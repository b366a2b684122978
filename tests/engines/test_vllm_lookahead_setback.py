"""vLLM 0.33's lookahead hashing on one full-attention group, beside vLLM's own
``KVCacheManager`` and tests/lookahead_model.py (as test_vllm_lookahead.py), in the two
cases where vLLM's counts run apart from the tokens prefixkv keyed:

- ``evict_blocks`` with the request's computed count set back to the first invalid
  block's start (vLLM's ``_update_requests_with_invalid_blocks``), then recomputed.
  vLLM's manager leaves the recomputed blocks uncached while the request lives;
  prefixkv caches them again (docs/integration.md, "After a failed KV load"). So the
  reference drops the evicted keys and caches the recompute as prefixkv does: prefixkv's
  hits equal it, vLLM's are never longer, and equal until the first eviction.
- Async scheduling (``num_output_placeholders``) with draft tokens: a step scheduled
  while the one before is in flight, its drafts placeholders (-1), the computed count
  past the known tokens; then the older step's outputs resolve (drafts rejected set the
  count and the placeholders back).

After every call: hits of a probe of every live request's tokens, free block counts,
``get_cached_block`` of every live request's hashes. Needs vllm installed."""

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

from .test_vllm_lookahead import _pair, _request  # noqa: E402
from .test_vllm_lookahead_model import ALPHABET, BS  # noqa: E402
from .test_vllm_reprefill import live_call  # noqa: E402


def _agree(managers: tuple[Any, Any], model: LookaheadModel, live: dict[str, Any], lookahead: int,
           serial: int, strict: bool) -> None:
    """prefixkv as the reference (hits, the hashes it finds); vLLM's hits never longer
    and its found hashes among prefixkv's (equal while ``strict``); free counts equal."""
    ours, theirs = managers
    for r in live.values():
        probe = _request(f"probe{serial}-{r.request_id}", [*r.all_token_ids, ALPHABET], lookahead, ours)
        hit = model.hit(list(probe.all_token_ids))
        got = [m.get_computed_blocks(probe)[1] for m in managers]
        assert got[0] == hit and (got[1] == hit if strict else got[1] <= hit), (r.request_id, serial, got)
        tokens = list(r.all_token_ids)
        want = [model.key(tokens, i) in model.cached for i in range(len(r.block_hashes))]
        found = [[m.block_pool.get_cached_block(h, [0]) is not None for h in r.block_hashes]
                 for m in managers]
        assert found[0] == want, (r.request_id, serial, found, want)
        assert all(o or not t for o, t in zip(*found, strict=True)), (r.request_id, serial, found)
        assert not strict or found[1] == want, (r.request_id, serial, found)
    assert ours.block_pool.get_num_free_blocks() == theirs.block_pool.get_num_free_blocks()


def _admit(r: Any, managers: tuple[Any, Any], model: LookaheadModel, chunk: int | None = None,
           drafts: int = 0) -> None:
    """Admit ``r`` on both: the hit as the reference's, then ``chunk`` tokens (all)."""
    from vllm.v1.request import RequestStatus

    found = [m.get_computed_blocks(r)[:2] for m in managers]
    hit = model.hit(list(r.all_token_ids))
    assert [h for _, h in found] == [hit, hit], list(r.all_token_ids)
    n = r.num_tokens - hit if chunk is None else min(chunk, r.num_tokens - hit)
    for m, (blocks, _) in zip(managers, found, strict=True):
        assert m.allocate_slots(r, n, hit, blocks, num_lookahead_tokens=drafts) is not None
    r.status, r.num_computed_tokens = RequestStatus.RUNNING, hit + n
    model.allocate(list(r.all_token_ids), r.num_computed_tokens)


def _evict(rng: random.Random, r: Any, managers: tuple[Any, Any], model: LookaheadModel,
           live: dict[str, Any]) -> bool:
    """vLLM's invalid-block handling on ``r``: its blocks from a computed block ``j`` on
    evicted (``evict_blocks``), its count set back to ``j * BS``; whether it ran (not
    where another live request holds one of them, or vLLM holds a second block of one
    of their hashes: there the hits part by which copy each evicts, not by this rule)."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    ours, theirs = managers
    j = rng.randint(0, r.num_computed_tokens // BS)
    rows = [m.get_block_ids(r.request_id)[0] for m in managers]
    if j >= len(rows[0]):
        return False
    for m, row in zip(managers, rows, strict=True):
        others = {b for q in live.values() if q is not r for b in m.get_block_ids(q.request_id)[0]}
        if others & set(row[j:]):
            return False
    tokens, dropped = list(r.all_token_ids), []
    for i, h in enumerate(r.block_hashes[j:len(rows[0])], j):
        mine = [m.block_pool.get_cached_block(h, [0]) for m in managers]
        held = theirs.block_pool.cached_block_hash_to_block._cache.get(make_block_hash_with_group_id(h, 0))
        if isinstance(held, dict) or (mine[0] is not None and mine[0][0].block_id != rows[0][i]):
            return False
        if mine[0] is not None:
            dropped.append(model.key(tokens, i))
    for m, row in zip(managers, rows, strict=True):
        m.evict_blocks(set(row[j:]))
    model.cached.difference_update(dropped)
    r.num_computed_tokens = min(r.num_computed_tokens, j * BS)
    return True


@pytest.mark.parametrize(("lookahead", "prefill_lookahead"), [(1, 0), (1, 1), (2, 2), (3, 3), (2, 0), (1, 3)])
@settings(max_examples=15, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1))
def test_evicted_blocks_and_set_back_counts_as_vllm(lookahead, prefill_lookahead, seed):
    """Blocks evicted and recomputed: a hit serves only blocks keyed with the reader's
    own tokens and the L after them, never an evicted block's content before its
    recompute (the reference's keys are the tokens); vLLM's hits never longer."""
    rng = random.Random(seed)
    managers = _pair(lookahead, prefill_lookahead)
    model = LookaheadModel(BS, lookahead, prefill_lookahead)
    live: dict[str, Any] = {}
    strict = True
    for serial in range(40):
        op = rng.random()
        if op < 0.3 or not live:
            n = rng.randint(1, 6 * BS)
            r = _request(f"r{serial}", [rng.randrange(ALPHABET) for _ in range(n)], lookahead, managers[0])
            _admit(r, managers, model, rng.randint(1, n))
            live[r.request_id] = r
        elif op < 0.45:
            r = live[rng.choice(sorted(live))]
            strict = not _evict(rng, r, managers, model, live) and strict
        else:  # cache_blocks, a step (the recompute after a set-back), a free
            r = live_call(rng, 0.35 + (op - 0.45) * 0.65 / 0.55, managers, live)
        if r.request_id in live:
            model.allocate(list(r.all_token_ids), r.num_computed_tokens)
        _agree(managers, model, live, lookahead, serial, strict)


def _schedule(r: Any, managers: tuple[Any, Any], model: LookaheadModel, drafts: int,
              flight: list[tuple[int, int]]) -> None:
    """An async step of the decoding ``r``: its next token and its drafts scheduled
    while the step before may be in flight (vLLM's ``num_tokens_with_spec +
    num_output_placeholders - num_computed_tokens``), the ``drafts`` drafts of the next
    step placeholders (-1), as vLLM's AsyncScheduler."""
    n = r.num_tokens_with_spec + r.num_output_placeholders - r.num_computed_tokens
    for m in managers:
        assert m.allocate_slots(r, n, num_lookahead_tokens=drafts) is not None
    r.num_computed_tokens += n
    model.allocate(list(r.all_token_ids), r.num_computed_tokens)
    flight.append((len(r.spec_token_ids), n))
    r.num_output_placeholders += 1 + len(r.spec_token_ids)
    r.num_in_flight_tokens += n
    r.spec_token_ids = [-1] * drafts


def _resolve(rng: random.Random, r: Any, managers: tuple[Any, Any], flight: list[tuple[int, int]]) -> None:
    """The oldest step in flight returns: ``a`` of its drafts accepted (the rest set
    the count and the placeholders back), the accepted ones and a bonus appended; then
    vLLM's scheduler caches up to the tokens no step in flight still computes."""
    drafts, n = flight.pop(0)
    r.num_in_flight_tokens -= n
    accepted = rng.randint(0, drafts)
    r.num_computed_tokens -= drafts - accepted
    r.num_output_placeholders -= drafts - accepted
    for _ in range(accepted + 1):
        r.append_output_token_ids(rng.randrange(ALPHABET))
    r.num_output_placeholders -= accepted + 1
    assert r.num_output_placeholders >= 0
    for m in managers:
        m.cache_blocks(r, r.num_computed_tokens - r.num_in_flight_tokens)


@pytest.mark.parametrize(("lookahead", "prefill_lookahead", "drafts"),
                         [(1, 0, 1), (1, 0, 3), (2, 0, 2), (3, 3, 3), (1, 1, 2)])
@settings(max_examples=10, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1))
def test_async_steps_with_drafts_key_as_vllm(lookahead, prefill_lookahead, drafts, seed):
    """Async scheduling with drafts: a block is keyed only once the L tokens after it
    are sampled, never with a placeholder; hits and found hashes as vLLM's."""
    rng = random.Random(seed)
    managers = _pair(lookahead, prefill_lookahead)
    model = LookaheadModel(BS, lookahead, prefill_lookahead)
    live: dict[str, Any] = {}
    flights: dict[str, list[tuple[int, int]]] = {}
    for serial in range(30):
        op = rng.random()
        if op < 0.25 or not live:
            tokens = [rng.randrange(ALPHABET) for _ in range(rng.randint(1, 5 * BS))]
            r = _request(f"r{serial}", tokens, lookahead, managers[0])
            _admit(r, managers, model, drafts=drafts)  # (the prompt's last chunk: a step in flight)
            r.num_output_placeholders, r.num_in_flight_tokens = 1, r.num_computed_tokens
            r.spec_token_ids = [-1] * drafts
            live[r.request_id], flights[r.request_id] = r, [(0, r.num_computed_tokens)]
        else:
            r = live[rng.choice(sorted(live))]
            flight = flights[r.request_id]
            if op < 0.65 and len(flight) < 2:
                _schedule(r, managers, model, drafts, flight)
            elif op < 0.9 and flight:
                _resolve(rng, r, managers, flight)
            elif not flight:
                live.pop(r.request_id)
                for m in managers:
                    m.free(r)
        if r.request_id in live:
            model.allocate(list(r.all_token_ids), r.num_computed_tokens - r.num_in_flight_tokens)
        _agree(managers, model, live, lookahead, serial, True)

"""vLLM 0.33's ``session_id`` on ``BlockStored`` (sessions.py): the session of the request
whose ``allocate_slots`` or ``cache_blocks`` stored the blocks, never part of a hash.
prefixkv's plug-in and vLLM's own manager run the same requests side by side (seeded
random steps: sessions, shared prefixes, chunked prefills, frees) and announce the same
blocks with the same sessions, block by block (hashes differ: prefixkv's chain hashes).
Needs vllm installed."""

from __future__ import annotations

import os
import random
from typing import Any

import pytest

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")

from .test_vllm_reference import BS, _managers, _request  # noqa: E402


def _session_request(rid: str, tokens: list[int], session: str | None) -> Any:
    r = _request(rid, tokens, None)
    r.session_id = session
    return r


def _stored(m: Any) -> list[tuple[tuple[int, ...], str | None]]:
    """The blocks the manager's events announce, in order: (the block's tokens, session)."""
    from vllm.distributed.kv_events import BlockStored

    out = []
    for e in m.take_events():
        if isinstance(e, BlockStored):
            t = list(e.token_ids)
            out += [(tuple(t[i:i + BS]), e.session_id) for i in range(0, len(t), BS)]
    return out


def _admit(m: Any, r: Any, chunk: int) -> bool:
    """Admit ``r`` and compute ``chunk`` tokens (its whole prompt at most); whether it fit."""
    blocks, hit, _ = m.get_computed_blocks(r)
    n = min(chunk, r.num_tokens - hit)
    if m.allocate_slots(r, n, hit, blocks) is None:
        return False
    r.num_computed_tokens = hit + n
    return True


def _step(m: Any, r: Any, chunk: int) -> None:
    """The next chunk of a live request's prompt (cache_blocks of the last one first)."""
    m.cache_blocks(r, r.num_computed_tokens)
    n = min(chunk, r.num_tokens - r.num_computed_tokens)
    if n and m.allocate_slots(r, n) is not None:
        r.num_computed_tokens += n


def test_a_request_of_a_session_stores_its_blocks_under_it():
    """Exact values: a prompt of 2 full blocks of session "agent-1" (one event), then
    one of another session sharing its first block (it stores its second block only,
    under its own session), then one without a session (None)."""
    for s in _managers(16):
        m = s.m
        a = _session_request("a", list(range(9)), "agent-1")
        assert _admit(m, a, 9)
        assert _stored(m) == [((0, 1, 2, 3), "agent-1"), ((4, 5, 6, 7), "agent-1")]
        b = _session_request("b", [0, 1, 2, 3, 50, 51, 52, 53, 54], "agent-2")
        assert _admit(m, b, 9)
        assert _stored(m) == [((50, 51, 52, 53), "agent-2")]
        c = _session_request("c", [60, 61, 62, 63, 64], None)
        assert _admit(m, c, 5)
        assert _stored(m) == [((60, 61, 62, 63), None)]


@pytest.mark.parametrize("seed", range(6))
def test_prefixkv_and_vllm_announce_the_same_blocks_with_the_same_sessions(seed):
    rnd = random.Random(seed)
    ours, theirs = (s.m for s in _managers(24))
    live: dict[str, tuple[Any, Any]] = {}
    seen: set[Any] = set()
    for step in range(40):
        op = rnd.random()
        if live and op < 0.3:
            rid = rnd.choice(sorted(live))
            for m, r in zip((ours, theirs), live.pop(rid), strict=True):
                m.free(r)
        elif live and op < 0.6:
            rid, chunk = rnd.choice(sorted(live)), rnd.choice([1, 3, BS, 7])
            for m, r in zip((ours, theirs), live[rid], strict=True):
                _step(m, r, chunk)
        else:
            rid = f"r{step}"
            tokens = rnd.choice([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9]]) \
                + [rnd.randrange(50) for _ in range(rnd.randrange(1, 9))]
            session, chunk = rnd.choice([None, "s1", "s2"]), rnd.choice([2, BS, 6, 20])
            pair = (_session_request(rid, tokens, session), _session_request(rid, tokens, session))
            fits = [_admit(m, r, chunk) for m, r in zip((ours, theirs), pair, strict=True)]
            assert fits[0] == fits[1], f"step {step}: the admissions differ: {fits}"
            if fits[0]:
                live[rid] = pair
        _agree(_stored(ours), _stored(theirs), seen, f"seed {seed}, step {step}")
        ours.core.check_invariants()
    assert len(seen) > 5, "too few blocks stored to compare"


def _agree(ours: list[Any], theirs: list[Any], seen: set[Any], where: str) -> None:
    """The same blocks in the same order with the same sessions, but for vLLM's second
    announcement of content a block holds already (a request that computed the same
    prefix in its own block: vLLM caches and announces that block too, prefixkv keeps
    one block of a content), which must be one of content announced before."""
    i = 0
    for block in theirs:
        if i < len(ours) and ours[i] == block:
            i += 1
        else:
            assert block[0] in seen, f"{where}: {block} missing from {ours}"
        seen.add(block[0])
    assert i == len(ours), f"{where}: {ours[i:]} not announced by vLLM ({theirs})"


def test_the_calls_are_bracketed_only_once_a_session_shows_with_events_on():
    """sessions.py: no wrapper without events, nor before a request of a session shows
    (its lookup or its admission): the class's calls run, and no decode step pays."""
    from prefixkv.integrations.vllm import KVCacheManager

    quiet = _managers(16, enable_kv_cache_events=False)[0].m
    assert _admit(quiet, _session_request("a", list(range(9)), "s"), 9)
    assert "allocate_slots" not in vars(quiet) and "cache_blocks" not in vars(quiet)
    for first in ("lookup", "admission"):
        loud = _managers(16)[0].m
        assert _admit(loud, _session_request("a", list(range(9)), None), 9)
        assert "allocate_slots" not in vars(loud) and "cache_blocks" not in vars(loud)
        b = _session_request("b", [*range(8), 40, 41, 42, 43, 44], "s")
        if first == "lookup":
            loud.get_computed_blocks(b)
            assert vars(loud)["allocate_slots"].__name__ == KVCacheManager.allocate_slots.__name__
            assert vars(loud)["cache_blocks"].__name__ == KVCacheManager.cache_blocks.__name__
        else:
            assert loud.allocate_slots(b, 13) is not None  # (no lookup: vLLM's own test's way)
            assert "allocate_slots" in vars(loud) and "cache_blocks" in vars(loud)
        assert _admit(loud, b, 13) if first == "lookup" else True
        # (admitted without its hit, b computes the first two blocks again in blocks of
        # its own: prefixkv announces a content once)
        assert _stored(loud) == [((*range(4),), None), ((*range(4, 8),), None), ((40, 41, 42, 43), "s")]


def test_events_handed_off_to_the_publisher_carry_the_sessions_too():
    """With ``hands_off_events`` the events are built later (handoff.py), from the same
    log: the marks travel in it. A chunked prefill of session "s" stores its blocks
    over two calls (allocate_slots, then cache_blocks and allocate_slots): both are its."""
    from vllm.distributed.kv_events import BlockStored

    m = _managers(16)[0].m
    m.hands_off_events = True
    a = _session_request("a", list(range(13)), "s")
    assert _admit(m, a, 6)
    _step(m, a, 7)
    c = _session_request("c", [70, 71, 72, 73, 74], None)
    assert _admit(m, c, 5)
    built = [e for e in m.take_events().build() if isinstance(e, BlockStored)]
    assert [(list(e.token_ids), e.session_id) for e in built] == [
        (list(range(12)), "s"), ([70, 71, 72, 73], None)]


def test_a_manager_built_again_brackets_anew():
    """A retention interval set on an empty manager builds it again (retention_setter.py):
    the calls are the class's again until a session shows, then bracketed on the new log."""
    m = _managers(16)[0].m
    a = _session_request("a", list(range(9)), "s")
    assert _admit(m, a, 9)
    m.free(a)
    assert m.reset_prefix_cache() and "allocate_slots" in vars(m)
    _stored(m)
    m.coordinator.retention_interval = 0
    assert "allocate_slots" not in vars(m) and "cache_blocks" not in vars(m)
    b = _session_request("b", list(range(9)), "t")
    assert _admit(m, b, 9)
    assert _stored(m) == [((0, 1, 2, 3), "t"), ((4, 5, 6, 7), "t")]

"""SWA bounded replay (vLLM 0.33's ``SlidingWindowMLASpec(bounded_replay=True)``, not
``prefix_cacheable``) on prefixkv's plug-in beside vLLM's own manager: the calls vLLM's
scheduler makes while a request replays the window below its hit (its count of computed
tokens set back to ``replay_start``, the hit's blocks kept), and what the table of each
group holds. The scheduler's side runs in vLLM's own tests/v1/core/test_prefix_replay.py
(the suite). Needs vllm installed."""

from __future__ import annotations

import os
from typing import Any

import pytest

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")

from .test_vllm_hybrid_reference import _hybrid_pair, _replayed  # noqa: E402
from .test_vllm_plugin import full  # noqa: E402
from .test_vllm_reference import BS, NULL, _request  # noqa: E402

W = 8  # the window, and the tokens replayed below a hit
PROMPT = list(range(1, 21))  # 20 tokens: a hit of 16 (4 blocks), its replay from 8


def _ids(m: Any, rid: str) -> list[list[int]]:
    return [list(ids) for ids in m.get_block_ids(rid)]


def _prefilled(m: Any) -> None:
    from vllm.v1.request import RequestStatus

    a = _request("a", PROMPT, None)
    assert m.allocate_slots(a, 20) is not None
    a.status, a.num_computed_tokens = RequestStatus.RUNNING, 20
    m.cache_blocks(a, 20)
    m.free(a)


def test_layouts_with_a_replayed_window_are_read_as_uncached_windows():
    from prefixkv.groups import full_attention, sliding_window
    from prefixkv.integrations.vllm import KVCacheManager, UnsupportedByPrefixKV

    from .test_vllm_plugin import config

    m = KVCacheManager(config(full(BS), _replayed(W), num_blocks=40), max_model_len=40,
                       scheduler_block_size=BS, hash_block_size=BS)
    assert m.core.groups == (full_attention(), sliding_window(W, cached=False))
    assert m.replay_tokens == W and m.cached_groups == (True, False)
    with pytest.raises(UnsupportedByPrefixKV, match="uncached"):
        KVCacheManager(config(_replayed(W), num_blocks=40), max_model_len=40,
                       scheduler_block_size=BS, hash_block_size=BS)
    with pytest.raises(UnsupportedByPrefixKV, match="bounded replay"):
        KVCacheManager(config(full(BS), _replayed(W), num_blocks=40), max_model_len=40,
                       scheduler_block_size=BS, hash_block_size=BS, use_eagle=True)


@pytest.mark.parametrize("chunk", [0, 4])
def test_a_request_replaying_its_window_keeps_the_hit_and_so_does_its_free(chunk):
    # b hits a's 16 tokens; the scheduler replays 8..15 (replay_start 8): with ``chunk``
    # 0 the first step adopts the hit alone (a chunk inside the replay), with 4 it runs
    # the replay and 4 new tokens. b is then preempted mid-replay (computed 12): the
    # hit's blocks hold sound KV (only the window was rebuilt), so c finds all 16.
    # Before: refused at construction; without ``sound_tokens``, prefixkv took the
    # count set back as a failed load, rewound b and uncached the hit's block 3
    from vllm.v1.request import RequestStatus

    answers = []
    for m in _hybrid_pair(40, full(BS), _replayed(W)):
        _prefilled(m)
        b = _request("b", PROMPT, None)
        blocks, hit = m.get_computed_blocks(b)[:2]
        assert hit == 16 and blocks.get_block_ids()[1] == []  # (the window's slot: empty)
        new = m.allocate_slots(b, chunk, num_new_computed_tokens=hit, new_computed_blocks=blocks)
        assert new is not None
        b.status, b.num_computed_tokens, b.replay_start = RequestStatus.RUNNING, hit - W, hit - W
        steps = [_ids(m, "b"), new.get_block_ids()]
        if not chunk:  # a second replay chunk, 8..11
            assert m.allocate_slots(b, 4) is not None
            b.num_computed_tokens += 4
            steps.append(_ids(m, "b"))
        m.free(b)  # (preempted mid-replay)
        c = _request("c", PROMPT, None)
        answers.append((steps, m.get_computed_blocks(c)[1], m.block_pool.get_num_free_blocks()))
    assert answers[0] == answers[1]
    steps, hit, _ = answers[0]
    # the window below the replay: null (a query at 16 reads 9..16); blocks 2, 3 fresh
    assert hit == 16 and steps[0][1][:2] == [NULL, NULL] and NULL not in steps[0][1][2:]


def test_the_replay_runs_into_decode_as_vllms():
    # the replay then the prompt's last 4 tokens, then decode: every table and free
    # count as vLLM's, the window releasing its blocks as it moves
    from vllm.v1.request import RequestStatus

    answers = []
    for m in _hybrid_pair(40, full(BS), _replayed(W)):
        _prefilled(m)
        b = _request("b", PROMPT, None)
        blocks, hit = m.get_computed_blocks(b)[:2]
        assert m.allocate_slots(b, 4, num_new_computed_tokens=hit, new_computed_blocks=blocks) is not None
        b.status, b.num_computed_tokens, b.replay_start = RequestStatus.RUNNING, 20, hit - W
        m.cache_blocks(b, 20)
        steps = [_ids(m, "b")]
        for t in range(12):
            b.append_output_token_ids(100 + t)
            assert m.allocate_slots(b, 1) is not None
            b.num_computed_tokens += 1
            m.cache_blocks(b, b.num_computed_tokens)
            steps.append((_ids(m, "b"), m.block_pool.get_num_free_blocks(), m.estimate_cached_tokens(b)))
        answers.append(steps)
    assert answers[0] == answers[1]

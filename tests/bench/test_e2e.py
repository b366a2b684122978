"""The end-to-end run: exactness with and without the cache, and its skip without torch."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from prefixkv.bench.e2e import E2EConfig, run_e2e, turn_ttfts

TINY = E2EConfig(conversations=2, turns=2, system_tokens=40, message_tokens=8, max_tokens=4,
                 repeats=1, num_blocks=64, block_size=8)


def test_tokens_identical_and_prefill_saved():
    pytest.importorskip("torch")
    r = run_e2e(seed=1, cfg=TINY)
    assert r["identical"] is True
    first, second = r["turns"]
    assert first["prompt_tokens"] == 2 * 48
    assert first["prefill_tokens_nocache"] == 96
    assert first["cached_tokens"] == 40  # the second chat shares 5 system-prompt blocks
    assert second["prefill_tokens_cache"] < second["prefill_tokens_nocache"]
    # turn 1 computed KV for 48 prompt + 3 reply tokens (the last reply token has none
    # yet): 6 full blocks per chat
    assert second["cached_tokens"] == 2 * 48
    assert {"ttft_cpu_ms_cache", "ttft_cpu_ms_nocache", "ttft_wall_ms_cache",
            "ttft_wall_ms_nocache"} <= set(first)
    assert "1 torch thread" in r["device"] or "cuda" in r["device"]


def test_turn_ttfts_by_hand():
    # turn 1: steps [prefill, prefill, decode]; turn 2: [prefill, decode, decode]
    step = SimpleNamespace
    turns = [SimpleNamespace(steps=[step(num_prefill_tokens=9), step(num_prefill_tokens=3),
                                    step(num_prefill_tokens=0)]),
             SimpleNamespace(steps=[step(num_prefill_tokens=5), step(num_prefill_tokens=0),
                                    step(num_prefill_tokens=0)])]
    marks = [10.0, 11.0, 13.0, 14.0, 20.0, 21.0, 22.0]
    # turn 1: start 10, its last prefill step ends at 13; turn 2: start 14, ends at 20
    assert turn_ttfts(turns, marks) == [3.0, 6.0]


def test_skipped_without_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    assert "needs torch" in run_e2e(cfg=TINY)["skipped"]

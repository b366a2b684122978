"""The end-to-end run: exactness with and without the cache, and its skip without torch."""

from __future__ import annotations

import sys

import pytest

from prefixkv.bench.e2e import E2EConfig, run_e2e

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
    assert {"ttft_ms_cache", "ttft_ms_nocache", "prefill_ms_cache"} <= set(first)


def test_skipped_without_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    assert "needs torch" in run_e2e(cfg=TINY)["skipped"]

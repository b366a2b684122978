"""benchmarks/peers_hits.py: its vLLM and SGLang sides run the replay and count as the
allocators do (the reference tests check the allocators; this checks the benchmark's
drivers of them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from . import skip_module_without_vllm

skip_module_without_vllm()
pytest.importorskip("torch")
BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_the_three_sides_replay_one_workload_under_pressure_and_prefixkv_hits_most(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # (its sides import vllm_side from there)
    import peers_hits
    from prefixkv.bench.workloads import builtin

    w = builtin("pressure", 0.05, 1)
    [row] = peers_hits.rows([(1, w)], [0.5])
    assert row["pool_blocks"] < w.pool_tokens // peers_hits.BS  # (under pressure)
    ours, vllm, sglang = (row[s] for s in ("prefixkv", "vllm", "sglang"))
    assert ours == vllm, row  # the same hits, the same preemptions
    assert ours[0] >= sglang[0] > 0, row
    assert "| pressure (seed 1) |" in peers_hits.table([row])

"""The host-tier sweep of the bench: counts from the plan, rising hit rates, the estimate's
arithmetic, the report section and --no-host-tiers."""

from __future__ import annotations

import pytest

from prefixkv.bench import hosttier, suite
from prefixkv.bench.cost import PrefillCost
from prefixkv.bench.hosttier import HOST_FACTORS, TransferCost, device_pool, host_tier_sweep, tier_point
from prefixkv.bench.report import markdown, terminal
from prefixkv.bench.workloads import builtin, pressure


def test_transfer_cost_of_a_llama_8b_block():
    t = TransferCost(PrefillCost(), dtype_bytes=2, pcie_gbs=25.0)
    assert t.block_bytes(16) == 2 * 32 * 16 * 8 * 128 * 2 == 2 * 2**20
    assert t.seconds(25 * 10**9) == pytest.approx(1.0)
    assert "2 MiB" in t.describe(16) and "25 GB/s" in t.describe(16)


def test_tier_point_splits_hits_by_source_and_adds_transfers():
    t = TransferCost(PrefillCost(tflops=1e-3), pcie_gbs=1.0)   # 1 GFLOP/s, 1 GB/s
    r = {"prefill_saved": 64, "prefill_computed": 36, "prefill_computed_pairs": 100,
         "loaded_blocks": 2, "offloaded_blocks": 3, "admissions": 6, "requests": 4,
         "hit_rate": 0.64, "readmitted_tokens": 0, "readmitted_hit_rate": 0.0}
    # (two re-admissions: the averages are per request, not admission)
    p = tier_point(r, 10, 16, t)
    assert (p["device_hit_rate"], p["host_hit_rate"]) == (0.32, 0.32)
    assert p["bytes_moved"] == 5 * t.block_bytes(16)
    want = t.model.seconds(36, 100) + 5 * t.block_bytes(16) / 1e9
    assert p["est_prefill_ms_per_request"] == pytest.approx(1e3 * want / 4)
    assert (p["offloads_per_request"], p["loads_per_request"]) == (0.75, 0.5)


def test_pressure_hit_rate_rises_with_the_host_tier():
    wl = pressure(scale=0.25)
    sweep = host_tier_sweep(wl, 16)
    points = sweep["points"]
    assert [p["factor"] for p in points] == list(HOST_FACTORS)
    assert sweep["pool_blocks"] == device_pool(wl, 16) == 512
    assert points[0]["host_hit_rate"] == 0 and points[0]["bytes_moved"] == 0
    rates = [p["hit_rate"] for p in points]
    assert rates == sorted(rates) and rates[-1] > rates[0] + 0.2
    assert all(p["host_hit_rate"] > 0 and p["replay"]["loaded_blocks"] > 0 for p in points[1:])
    # the device's share does not depend on the tier below it
    assert len({round(p["device_hit_rate"], 6) for p in points}) == 1


def test_chat_and_document_run_in_an_eighth_of_their_pool():
    assert device_pool(builtin("chat", 0.1), 16) == 4096 // 8
    document = builtin("document", 0.02)
    assert device_pool(document, 16) == -(-document.max_tokens() // 16) > 4096 // 8  # one request


def test_report_section_and_opting_out():
    cfg = suite.BenchConfig(workloads=("pressure", "system-prompt"), scale=0.05, e2e=False,
                            store_replicas=False, groups=())  # (the layer-groups section: not checked)
    data = suite.run_bench(cfg)
    assert [s["name"] for s in data["host_tiers"]] == ["pressure"]
    assert "from host" in terminal(data) and "## Host tier (L2)" in markdown(data, [])
    assert "ESTIMATE" in hosttier.host_note(data)
    cfg.host_tiers = False
    data = suite.run_bench(cfg)
    assert "host_tiers" not in data and "from host" not in terminal(data)


def test_the_bounds_close_the_sweep_and_split_off_readmissions():
    wl = pressure(scale=0.25)
    sweep = host_tier_sweep(wl, 16)
    never, whole = sweep["bounds"]["host never evicts"], sweep["bounds"]["device holds all"]
    every = sum(-(-(len(r.prompt) + len(r.output)) // 16) for r in wl.requests)
    assert never["pool_blocks"] == sweep["pool_blocks"] and never["host_blocks"] == every
    assert whole["host_blocks"] == 0 and whole["replay"]["preemptions"] == 0
    assert whole["readmitted_tokens"] == 0
    # the headline is the first admissions' hit rate: no tier size beats a tier that never
    # evicts, nor a pool holding everything (a first admission finds only what others
    # computed)
    for p in sweep["points"]:
        assert p["hit_rate"] <= never["hit_rate"] + 1e-12 <= whole["hit_rate"] + 2e-12
    assert never["hit_rate"] == pytest.approx(whole["hit_rate"])
    assert never["replay"]["preemptions"] > 0 and never["readmitted_tokens"] > 0
    assert never["readmitted_hit_rate"] > never["hit_rate"]  # (why they are apart)
    assert "bound: host never evicts" in [r[1] for r in hosttier.host_rows([sweep])]

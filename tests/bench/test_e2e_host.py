"""The end-to-end run with a host tier: same tokens in the three set-ups, and the host
tier serves the prefixes that device-only caching lost."""

import pytest

pytest.importorskip("torch", reason="the end-to-end run needs torch")

from prefixkv.bench.e2e_host import E2EHostConfig, run_e2e_host  # noqa: E402


def test_host_tier_run_is_identical_and_computes_less():
    cfg = E2EHostConfig(prefixes=3, rounds=2, prefix_tokens=64, suffix_tokens=4, max_tokens=2,
                        num_blocks=6, host_factor=4, repeats=1)
    out = run_e2e_host(0, cfg)
    assert out["identical"] is True
    rows = {r["setup"]: r for r in out["rows"]}
    assert rows["no cache"]["prefill_tokens"] == 6 * 68
    assert rows["device only"]["cached_tokens"] == 0            # every prefix was evicted
    assert rows["host tier 4x"]["cached_tokens"] == 3 * 64      # round 2 from the host
    assert rows["host tier 4x"]["prefill_tokens"] == 6 * 68 - 3 * 64
    assert all(r["ttft_cpu_ms"] > 0 for r in out["rows"])

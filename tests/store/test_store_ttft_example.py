"""The shared-store example's TTFT mode: a slow store is not asked, a fast one serves
the shared prompts (the figures themselves are the bench's, not asserted here).

Whether a store is asked is measured (``FetchCost``): a fetch must beat computing its
prompt, 512 tokens at the stated throughput. The bench's figures (20,000 tokens/s: 26 ms;
a slow store +50 ms a round trip) leave a local store 26 ms, which a busy machine's
fetches have come near. Here the prompt is worth 128 ms (4,000 tokens/s) and the slow
store adds 250 ms: the fast store stays far below, the slow one far above, on any machine."""

import importlib.util
import pathlib

from prefixkv.bench import store_ttft

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "examples" / "shared_store.py"


def test_the_example_shows_a_slow_store_unasked_and_a_fast_one_serving(monkeypatch, capsys):
    monkeypatch.delenv("PREFIXKV_REDIS_URL", raising=False)
    monkeypatch.setattr(store_ttft, "PREFILL_TPS", 4_000.0)
    monkeypatch.setattr(store_ttft, "SLOW", 0.25)
    spec = importlib.util.spec_from_file_location("shared_store_example", SCRIPT)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--ttft"]) == 0
    out = capsys.readouterr().out
    assert "slow store (+250 ms)" in out and "fetches waited on 0" in out

"""The shared-store example's TTFT mode: a slow store is not asked, a fast one serves
the shared prompts (the figures themselves are the bench's, not asserted here)."""

import importlib.util
import pathlib

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "examples" / "shared_store.py"


def test_the_example_shows_a_slow_store_unasked_and_a_fast_one_serving(monkeypatch, capsys):
    monkeypatch.delenv("PREFIXKV_REDIS_URL", raising=False)
    spec = importlib.util.spec_from_file_location("shared_store_example", SCRIPT)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--ttft"]) == 0
    out = capsys.readouterr().out
    assert "slow store (+50 ms)" in out and "fetches waited on 0" in out

"""examples/vllm_connector.py runs: the second replica loads the first one's blocks."""

import pytest

from .replica import _EXAMPLE

pytest.importorskip("vllm", reason="vllm==0.33.0 is installed by make test (--no-deps)")


def test_vllm_connector_example(capsys):
    _EXAMPLE["main"](["--prompt-len", "100"])
    out = capsys.readouterr().out
    assert "replica B loaded 6 of 6 full blocks (96 tokens) and computed 4 tokens" in out
    assert "loaded KV equals A's: True" in out

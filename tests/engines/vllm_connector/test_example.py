"""examples/vllm_connector.py runs: the second replica loads the first one's blocks."""


from .. import skip_module_without_vllm
from .replica import _EXAMPLE

skip_module_without_vllm()


def test_vllm_connector_example(capsys):
    _EXAMPLE["main"](["--prompt-len", "100"])
    out = capsys.readouterr().out
    assert "replica B loaded 6 of 6 full blocks (96 tokens) and computed 4 tokens" in out
    assert "loaded KV equals A's: True" in out

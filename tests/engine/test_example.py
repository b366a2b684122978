"""The example script runs and finds identical replies with caching on and off."""

import pathlib
import runpy

import pytest

pytest.importorskip("torch", reason="the example engine needs torch")

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "examples" / "chat_engine.py"


def test_chat_example_runs(capsys):
    main = runpy.run_path(str(SCRIPT))["main"]
    main(["--conversations", "2", "--turns", "2", "--max-tokens", "4", "--system-len", "20"])
    out = capsys.readouterr().out
    assert "replies identical: True" in out

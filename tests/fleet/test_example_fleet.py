"""examples/fleet.py: replica processes behind the router, replies equal a no-cache run."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="the example engine needs torch")

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_fleet_example_runs():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "fleet.py"), "--replicas", "2",
         "--conversations", "3", "--turns", "3", "--max-tokens", "4", "--system-len", "48"],
        capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    rates = dict(re.findall(r"fleet, (\S+)\s*: hit rate ([\d.]+)%", out.stdout))
    assert set(rates) == {"prefix", "round-robin"}
    assert float(rates["prefix"]) > float(rates["round-robin"])
    assert out.stdout.count("replies identical to no-cache run: True") == 2

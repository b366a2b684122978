"""benchmarks/bench_kernels.py runs: refuses without CUDA, and its --smoke mode works."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import HAS_CUDA, triton_skip_reason

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_kernels.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ})


@pytest.mark.skipif(HAS_CUDA, reason="refusal is for machines without CUDA")
def test_refuses_without_cuda():
    run = _run()
    assert run.returncode == 2 and "needs a CUDA GPU" in run.stderr


@pytest.mark.skipif(triton_skip_reason() is not None, reason=str(triton_skip_reason()))
def test_smoke_run_writes_json_and_markdown(tmp_path):
    run = _run("--smoke", "--out-dir", str(tmp_path))
    assert run.returncode == 0, run.stderr
    result = json.loads((tmp_path / "kernels-smoke.json").read_text())
    assert {"device", "commit", "torch", "triton", "spec_shape", "sweep", "decode"} <= result.keys()
    assert result["spec_shape"]["max_abs_err_vs_reference"] < 1e-2
    assert len(result["sweep"]) == 4 and result["decode"]["gbps"] > 0
    assert [r["unsplit"]["gbps"] > 0 for r in result["split_decode"]] == [True]
    assert {"## SPEC shape", "## Split-KV decode"} <= set((tmp_path / "kernels-smoke.md").read_text().splitlines())

"""benchmarks/bench_kernels.py, tune_kernels.py and gpu_session.sh: refusals and smoke runs."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import HAS_CUDA, torch, triton_skip_reason

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_kernels.py"


def _run(*args: str, script: Path = SCRIPT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=900,
                          env={**os.environ})


def _benchmark(name: str):
    """A module of benchmarks/ (the scripts import their helpers from there), imported here."""
    sys.path.insert(0, str(SCRIPT.parent))
    return importlib.import_module(name)


@pytest.mark.skipif(HAS_CUDA, reason="refusal is for machines without CUDA")
def test_refuses_without_cuda(capsys):
    # In this process (torch is imported already): each script's main is the whole refusal.
    for name in ("bench_kernels", "tune_kernels"):
        assert _benchmark(name).main([]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err


SESSION = SCRIPT.parent / "gpu_session.sh"


SESSION_SETTINGS = frozenset({"SESSION_S", "TESTS_S", "BENCH_S", "CASCADE_S", "PROFILE_S", "GLUON_S",
                              "TUNE_S", "PROFILE_TILES", "TUNE_SHAPES", "TEST_JOBS", "TUNE_JOBS",
                              "PREFIXKV_COMMIT"})


def _session(*args: str, out: Path, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    # The session's own settings (PROFILE_TILES, TESTS_S...) stay out: a test run from inside a
    # gpu_session.sh started with some of them set must check the script's defaults.
    inherited = {k: v for k, v in os.environ.items() if k not in SESSION_SETTINGS}
    return subprocess.run(["bash", str(SESSION), *args], capture_output=True, text=True, timeout=timeout,
                          env={**inherited, "OUT": str(out), "PYTHON": sys.executable, **env})


# The tests of the smoke session on one xdist worker (gpu_session.sh: --dist loadgroup):
# its fixture is per module and per worker, and each run is the whole session's smoke.
SMOKE_GROUP = pytest.mark.xdist_group("gpu-session-smoke")


@pytest.fixture(scope="module")
def smoke_session(tmp_path_factory, warm_python) -> tuple[subprocess.CompletedProcess, Path]:
    """One ``gpu_session.sh --smoke`` run, every step, and its $OUT: the session runs
    bench_kernels.py --smoke and tune_kernels.py --smoke there, so the smoke tests of both
    scripts read what it wrote rather than run them a second time. The tune gets 2 compile
    processes and a budget that never cuts the precompile short: on the H100 machine under
    xdist 8, the default's pool share (0.45 x 330 s) ended before the 8th compile (7 of 8
    finished). The gluon step (an sm_90a compile on the CPU) gets 300 s: its default 60 s
    passed in quiet CI runs but not in one beside other work (rc 124 after 61 s, load ~8).
    Its ``$PYTHON`` is the warm interpreter (tests/warm_python.py): each of the
    session's 8 Python processes (a step each, the tune's 2 compile processes) is a fork
    that has imported torch and triton, instead of importing them again."""
    if shutil.which("bash") is None or shutil.which("timeout") is None:
        pytest.skip("needs bash and coreutils timeout")
    if triton_skip_reason() is not None:
        pytest.skip(str(triton_skip_reason()))
    out = tmp_path_factory.mktemp("gpu-session")
    run = _session("--smoke", out=out, timeout=600, TUNE_JOBS="2", TUNE_S="3040", GLUON_S="300",
                   SESSION_S="3600", PYTHON=warm_python)
    return run, out


def _step_ok(session: tuple[subprocess.CompletedProcess, Path], step: str) -> None:
    """The session's summary says ``step`` exited 0."""
    run, out = session
    log = (out / "gpu-session.log").read_text()
    assert f"\n{step}: rc 0," in log, run.stdout[-3000:] + run.stderr[-3000:]


@SMOKE_GROUP
def test_smoke_run_writes_json_and_markdown(smoke_session):
    _step_ok(smoke_session, "bench")
    _, out = smoke_session
    result = json.loads((out / "kernels-smoke.json").read_text())
    assert {"device", "commit", "torch", "triton", "spec_shape", "sweep", "decode"} <= result.keys()
    assert result["spec_shape"]["max_abs_err_vs_reference"] < 1e-2
    assert len(result["sweep"]) == 4 and result["decode"]["gbps"] > 0
    assert [r["unsplit"]["gbps"] > 0 for r in result["split_decode"]] == [True]
    headings = set((out / "kernels-smoke.md").read_text().splitlines())
    assert {"## SPEC shape", "## Split-KV decode"} <= headings


@SMOKE_GROUP
def test_smoke_tune_compiles_ahead_and_checks_every_candidate(smoke_session):
    _step_ok(smoke_session, "tune")
    run, out = smoke_session
    result = json.loads((out / "tune-smoke.json").read_text())
    assert {"device", "commit", "torch", "triton", "budget_s", "elapsed_s"} <= result.keys()
    assert result["budget_s"] == 3000 and result["jobs"] == 2
    assert result["precompile"]["finished"] == result["precompile"]["tasks"] == 8
    assert [s["name"] for s in result["shapes"]] == ["prefill", "decode", "split_decode"]
    for shape in result["shapes"]:
        rows = shape["rows"]
        assert 2 <= len(rows) <= 3 and rows[0]["is_heuristic"] and shape["heuristic_matches_default"]
        assert all(r["ok"] and r["max_abs_diff"] <= shape["tolerance"] for r in rows)
        assert sorted(shape["ranking"]) == list(range(len(rows))) and "best" in shape
    headings = set((out / "tune-smoke.md").read_text().splitlines())
    assert {"## prefill", "## decode", "## split_decode"} <= headings
    assert "[tune" in run.stdout  # progress lines
    # The prefill candidates time the loop with QK^T a tile ahead too (triton 3.7+'s tile).
    assert any(r["qk_ahead"] for r in result["shapes"][0]["rows"])


def test_candidate_grid_starts_at_the_heuristic_and_widens():
    from prefixkv.kernels.tiling import TileConfig

    tune = _benchmark("tune_kernels")
    prefill, decode, split = tune.tune_shapes(False, "cuda", torch)
    heur = TileConfig(block_m=128, block_n=64, num_warps=8, num_stages=3, num_splits=1)
    grid = tune.candidate_grid(heur, prefill.axes, prefill.max_distance, group_p2=4)
    assert grid[0] == heur and len(grid) == len(set(grid)) == 77
    distance = [sum(getattr(c, f) != getattr(heur, f) for f in tune.FIELDS) for c in grid]
    assert distance == sorted(distance) and distance[1] == 1
    assert not [c for c in grid if c.block_m == 256 and c.num_warps == 4]  # over the register cap
    # QK^T a tile ahead: 32 more, never on 256 rows (three 256-row fp32 tiles spill)
    assert sum(c.qk_ahead for c in grid) == 32 and not [c for c in grid if c.block_m == 256 and c.qk_ahead]
    # The deep-ring tiles (num_stages 5) come right after the heuristic, whatever their
    # distance, once each, and the rest of the grid keeps its order without them.
    deep = tune.candidate_grid(heur, prefill.axes, prefill.max_distance, group_p2=4, extra=prefill.extra)
    extras = [dataclasses.replace(heur, **e) for e in prefill.extra]
    assert len(extras) == 4 and {c.num_stages for c in extras} == {5}
    assert deep[:5] == [heur, *extras] and deep[5:] == [c for c in grid[1:] if c not in extras]
    same = tune.candidate_grid(heur, prefill.axes, 4, group_p2=4,
                               extra=(dict(num_stages=3), prefill.extra[0]))  # the heuristic's own: dropped
    assert same[:2] == [heur, extras[0]] and len(same) == len(grid) + 1
    heur = TileConfig(block_m=16, block_n=64, num_warps=4, num_stages=3, num_splits=17)
    grid = tune.candidate_grid(heur, split.axes, split.max_distance, group_p2=4)
    assert {c.num_splits for c in grid} == {8, 17, 34, 68}
    assert max(sum(getattr(c, f) != getattr(heur, f) for f in tune.FIELDS) for c in grid) == 2
    # block_m below the group's rows is raised to them by the launcher: one candidate, not two
    small = TileConfig(block_m=16, block_n=32)
    assert tune.candidate_grid(small, {"block_m": (16, 32)}, 1, group_p2=32) == [small]
    assert len(tune.candidate_grid(heur, decode.axes, 2, limit=3)) == 3


def test_a_fast_wrong_or_failed_config_never_ranks():
    tune = _benchmark("tune_kernels")
    cfg = dict(block_m=64, block_n=64, num_warps=4, num_stages=2, num_splits=1, qk_ahead=False)
    rows = [dict(cfg, is_heuristic=True, ok=True, ms=2.0, confirm_ms=2.0, max_abs_diff=0.0),
            dict(cfg, block_n=32, is_heuristic=False, ok=False, max_abs_diff=float("nan")),
            dict(cfg, block_n=128, is_heuristic=False, ok=False, ms=0.5, max_abs_diff=0.3),
            dict(cfg, num_warps=8, is_heuristic=False, error="OutOfResources: shared memory"),
            dict(cfg, num_stages=3, is_heuristic=False, ok=True, ms=1.0, confirm_ms=1.6, max_abs_diff=1e-4),
            dict(cfg, num_stages=4, is_heuristic=False, skipped="time budget")]
    result = tune.rank({"rows": rows})
    assert result["ranking"] == [4, 0] and result["best"]["num_stages"] == 3
    assert result["speedup_vs_heuristic"] == pytest.approx(2.0 / 1.6)
    assert result["counts"] == {"candidates": 6, "timed": 2, "wrong": 2, "failed": 1, "skipped": 1}


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_gpu_session_script_parses_and_rejects_unknown_steps(tmp_path):
    assert subprocess.run(["bash", "-n", str(SESSION)]).returncode == 0
    run = _session("benchmark", out=tmp_path)
    assert run.returncode == 2 and "unknown argument 'benchmark'" in run.stderr


@pytest.mark.skipif(HAS_CUDA, reason="the refusal is for machines without CUDA")
def test_gpu_session_refuses_without_cuda(tmp_path, warm_python):
    run = _session(out=tmp_path, PYTHON=warm_python)  # its CUDA check imports torch
    assert run.returncode == 2 and "no CUDA device" in run.stdout  # the script tees stderr into its log
    assert "no CUDA device" in (tmp_path / "gpu-session.log").read_text()


@SMOKE_GROUP
def test_gpu_session_smoke_runs_every_step_into_out(smoke_session):
    run, out = smoke_session
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    names = {p.name for p in out.iterdir()}
    assert names == {"gpu-session.log", "kernels-smoke.json", "kernels-smoke.md", "tune-smoke.json",
                     "tune-smoke.md", "cascade-smoke.json", "cascade-smoke.md"}
    log = (out / "gpu-session.log").read_text()
    for step in ("env", "tests", "bench", "cascade", "profile", "gluon", "tune"):
        assert f"=== {step} (limit" in log and f"\n{step}: rc 0," in log
    # the gluon step's smoke: the ping-pong probe compiled for sm_90a and its static model
    assert '"layout": "paged"' in log and '"n_spills": 0' in log
    cascade = json.loads((out / "cascade-smoke.json").read_text())
    assert [c["name"] for c in cascade["cases"]] == ["decode", "chunked prefill"]
    assert all(c["max_abs_diff"] < 1e-2 and c["cascade_mb"] < c["plain_mb"] for c in cascade["cases"])
    assert "tile 256x128" in log  # the profile step's one smoke tile, timed without ncu
    # tests/kernels/test_tiling.py, the smoke's test step: its 14 tests pass, or a few skip where
    # they compare with a committed report of another triton version (an H100 with triton 3.6).
    summary = re.search(r"\n(\d+) passed(?:, (\d+) skipped)? in ", log)
    assert summary is not None and "failed" not in summary.group(0), log[-2000:]
    passed, skipped = int(summary.group(1)), int(summary.group(2) or 0)
    assert passed + skipped == 14 and passed >= 10


def test_kernel_benchmarks_import_only_the_shared_helpers():
    """Two benchmarks never import each other; the SPEC shape is defined once (kernel_problems)."""
    import ast

    scripts = {p.stem: p for p in SCRIPT.parent.glob("*.py")}
    helpers = {"kernel_problems", "kernel_static", "kernel_timing", "kernel_versus", "kernel_pingpong",
               "gluon_pingpong_kernel",
               "alloc_ab", "alloc_ab_report", "alloc_replay", "alloc_worker", "vllm_side", "events_steps",
               "store_setup", "tree_import"}
    for name, path in scripts.items():
        tree = ast.parse(path.read_text())
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                    for a in n.names}
        imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                     and n.module}
        assert not (imported & set(scripts)) - helpers, f"{name} imports {imported & set(scripts)}"
        if name in helpers:
            assert not (imported & set(scripts)) - helpers, f"helper {name} imports a benchmark"
    defined = [p.stem for p in scripts.values() if "prefix=8192, q_len=2048" in p.read_text()]
    assert defined == ["kernel_problems"]


def test_fp8_capacity_doubles_blocks_and_replays_pressure(tmp_path):
    run = _run("--scale", "0.1", "--out-dir", str(tmp_path), script=SCRIPT.parent / "fp8_capacity.py")
    assert run.returncode == 0, run.stderr
    result = json.loads((tmp_path / "fp8-capacity.json").read_text())
    cap = result["capacity"]
    assert cap["bfloat16"]["blocks_per_gib"] == 512 and cap["float8_e4m3fn"]["blocks_per_gib"] == 1024
    runs = result["pressure"]["runs"]
    assert runs["float8_e4m3fn"]["pool_blocks"] == 2 * runs["bfloat16"]["pool_blocks"]
    # A small sample need not gain (the committed full-scale run does: 44.6% -> 57.2%).
    assert all(0.0 < r["hit_rate"] < 1.0 and r["requests"] == result["pressure"]["requests"]
               for r in runs.values())
    assert "## Blocks per GiB" in (tmp_path / "fp8-capacity.md").read_text()

"""benchmarks/bench_allocator.py --against: the worker protocol, the A/B rows and the
report, on a tiny plan with the working tree on both sides (no timings are checked)."""

from __future__ import annotations

import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
SRC = BENCH.parent / "src"
sys.path.insert(0, str(BENCH))

from alloc_ab import Plan, Worker, compare, workload_rows  # noqa: E402
from alloc_ab_report import markdown  # noqa: E402

# No timing is checked here, so the workers skip their 2 s warm-up (one admission each).
TINY = Plan(pools=(5000,), rounds=2, admits_2k=3, admits_32k=2, decode_tokens=256,
            step_requests=8, scale=0.02, warm_up_s=0)


def test_rows_of_both_sides_replay_the_same_work():
    rows, sides = compare(SRC, SRC, TINY)
    assert {s["prefixkv"] for s in sides.values()} == {str(SRC / "prefixkv" / "__init__.py")}
    assert {s["clock"] for s in sides.values()} == {"wall"}
    micro = [r for r in rows if r["section"] == "micro"]
    assert [(r["mode"], r["row"]) for r in micro] == [
        (mode, name) for mode in ("xxhash", "sha256") for name in (
            "admit 2k, 0% hit", "admit 2k, 100% hit", "admit 32k, 0% hit", "admit 32k, 100% hit",
            "decode, 1 running, per request", "decode, 8 running, per step")]
    assert [r["new_call"] for r in micro if r["row"].startswith("decode")] == [
        "append_tokens", "append_step"] * 2
    work = [r for r in rows if r["section"] == "workload"]
    assert [r["row"] for r in work] == [f"{w}: {what}"
                                        for w in ("system-prompt", "chat", "document", "pressure")
                                        for what in ("admit", "decode", "free")]
    for r in rows:
        assert len(r["old_rounds_ns"]) == len(r["new_rounds_ns"]) == 2
        assert min(r["old_rounds_ns"] + r["new_rounds_ns"]) > 0
        # (the ratio of the medians, rounded to 0.01; old_us/new_us are rounded to 1 ns,
        # which moves the ratio of two sub-microsecond medians by more than that)
        ratio = statistics.median(r["old_rounds_ns"]) / statistics.median(r["new_rounds_ns"])
        assert r["ratio"] == pytest.approx(ratio, abs=0.006)
        assert r["ratio_paired"] > 0
        assert r["old_best_us"] <= r["old_us"] and r["new_best_us"] <= r["new_us"]
    for r in work:
        assert r["same_counts"] and r["counts"]["old"] == r["counts"]["new"]
        assert r["counts"]["new"]["admissions"] >= r["counts"]["new"]["preemptions"] > -1
        assert r["counts"]["new"]["decoded_tokens"] > 0
        assert r["counts"]["new"]["prompt_tokens"] >= r["counts"]["new"]["cached_tokens"]
    pressure = [r for r in work if r["row"] == "pressure: admit"][0]
    assert pressure["counts"]["new"]["cached_tokens"] > 0
    md = markdown(rows, dict(old_commit="A", new_commit="B", machine="m", python="3", command="c",
                             elapsed_s=1, plan=dict(rounds=2)))
    assert md.count("\n| 5,000 |") == len(rows) + 4  # and one line of counts per workload
    assert "| 2x met |" in md or "| 2x NOT met |" in md


def test_the_cpu_clock_times_each_worker_thread():
    rows, sides = compare(SRC, SRC, replace(TINY, modes=("xxhash",), workloads=(), clock="cpu"))
    assert {s["clock"] for s in sides.values()} == {"cpu"}
    assert all(min(r["old_rounds_ns"] + r["new_rounds_ns"]) > 0 for r in rows)
    md = markdown(rows, dict(old_commit="A", new_commit="B", machine="m", python="3", command="c",
                             elapsed_s=1, plan=dict(rounds=2, clock="cpu")))
    assert "Clock: each worker thread's CPU time" in md


def test_rounds_split_over_fresh_worker_pairs_are_pooled():
    one_pair = replace(TINY, modes=("xxhash",), workloads=("pressure",))
    rows, _ = compare(SRC, SRC, replace(one_pair, rounds=4, sessions=2))
    one, _ = compare(SRC, SRC, one_pair)
    assert [r["row"] for r in rows] == [r["row"] for r in one]
    for r in rows:
        assert len(r["old_rounds_ns"]) == len(r["new_rounds_ns"]) == 4
        # (the ratio of the medians, rounded to 0.01; old_us/new_us are rounded to 1 ns,
        # which moves the ratio of two sub-microsecond medians by more than that)
        ratio = statistics.median(r["old_rounds_ns"]) / statistics.median(r["new_rounds_ns"])
        assert r["ratio"] == pytest.approx(ratio, abs=0.006)
    admit = [r for r in rows if r["row"] == "pressure: admit"][0]
    first = [r for r in one if r["row"] == "pressure: admit"][0]  # seeds 0-1 of the 4
    assert admit["same_counts"]
    assert admit["counts"]["new"]["admissions"] > first["counts"]["new"]["admissions"]
    with pytest.raises(ValueError):
        compare(SRC, SRC, replace(TINY, rounds=6, sessions=2))  # 3 a session: not even


def test_worker_reports_errors_and_keeps_serving():
    w = Worker("new", SRC, warm_up_s=0)
    try:
        assert w.info["append_step"] is True
        with pytest.raises(RuntimeError, match="unknown command 'nope'"):
            w.call(dict(cmd="nope"))
        with pytest.raises(RuntimeError, match="TypeError"):
            w.call(dict(cmd="setup", pool=100))
        assert w.call(dict(cmd="setup", pool=300, mode="xxhash"))["cached"] == 300
        assert w.call(dict(cmd="hold", free=40)) == dict(held=260)
        with pytest.raises(RuntimeError, match="outgrew the pool"):
            w.call(dict(cmd="replay", max_running=4, requests=[
                dict(rid="a", prompt=list(range(600)), output=list(range(100)), after=None)]))
        with pytest.raises(RuntimeError, match="none fits an empty pool"):
            w.call(dict(cmd="replay", max_running=4, requests=[
                dict(rid="b", prompt=list(range(1000)), output=[1], after=None)]))
        assert w.call(dict(cmd="release")) == dict(free=260)  # "a" still holds its 40 blocks
    finally:
        w.close()
    assert w.proc.returncode == 0


def test_a_dead_worker_is_an_error():
    w = Worker("old", SRC, warm_up_s=0)
    w.proc.kill()
    w.proc.wait()
    with pytest.raises(RuntimeError, match="old worker exited"):
        w.call(dict(cmd="hello"))


def test_worker_refuses_a_tree_it_did_not_import(tmp_path):
    (tmp_path / "prefixkv").mkdir()
    with pytest.raises(RuntimeError, match="worker (imported|failed)"):
        Worker("old", tmp_path, warm_up_s=0)


def test_against_needs_a_commit(tmp_path):
    run = subprocess.run([sys.executable, str(BENCH / "bench_allocator.py"), "--against", "no-such-rev",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "no-such-rev" in run.stderr
    assert "unknown revision 'no-such-rev'" in run.stderr.splitlines()[-1]
    assert not list(tmp_path.iterdir())


def test_workloads_need_their_room_in_the_pool():
    with pytest.raises(ValueError, match="need up to 4096 free blocks.*the pool has 4000"):
        workload_rows([], TINY, 4000, print)


def test_bench_tier_pools_runs_both_pools_and_writes_its_report(tmp_path):
    """benchmarks/bench_tier_pools.py on the smallest pool it takes, one round: every row
    for both pools, in the report and the JSON (no timings are checked)."""
    done = subprocess.run([sys.executable, str(BENCH / "bench_tier_pools.py"), "--pools", "4096",
                           "--rounds", "1", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    text = (tmp_path / "tier-pools-cpu.md").read_text()
    for row in ("2k miss", "2k hit", "32k miss", "32k hit", "decode"):
        assert f"| 4,096 | {row} |" in text
    bad = subprocess.run([sys.executable, str(BENCH / "bench_tier_pools.py"), "--pools", "512"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "4096" in bad.stderr


def test_events_rows_publish_every_step_to_a_live_publisher(capsys):
    """--events: the hand-off row exists on both sides with its on/off ratios, and each
    side's publisher sent every step's events (none dropped) before the workers closed."""
    from alloc_ab import EVENTS

    plan = replace(EVENTS, pools=(5000,), rounds=2, sessions=1, admits_2k=4, admits_32k=4,
                   forward_ms=0.5, warm_up_s=0)
    rows, _ = compare(SRC, SRC, plan)
    hand_off = [r for r in rows if r["row"].endswith("events on + hand-off")]
    assert len(hand_off) == 4 and all(r["on_off_old"] > 0 and r["on_off_new"] > 0
                                      for r in hand_off)
    sent = [line for line in capsys.readouterr().err.splitlines() if "publisher" in line]
    assert len(sent) == 2 and all("'dropped_batches': 0" in line and "'send_errors': 0" in line
                                  for line in sent)
    assert all("'published_batches': 0" not in line for line in sent)

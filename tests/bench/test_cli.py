"""The command line: --help, argument errors, and a tiny end-to-end smoke run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from prefixkv.bench.report import write_all
from prefixkv.cli import main

FLAGS = ("--workload", "--trace", "--scale", "--pool-blocks", "--block-size", "--seed",
         "--no-e2e", "--no-host-tiers", "--no-store-replicas", "--groups", "--no-plots", "--out",
         "--progress")


def test_bench_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for flag in FLAGS:
        assert flag in text
    assert "system-prompt" in text and "pressure" in text
    # a switch says what it does; "(default: True)" after --no-e2e reads as skipping
    assert "(default: True)" not in text and "(default: False)" not in text
    assert "(default: None)" not in text and "(default: 1.0)" in text


def test_an_unknown_bench_option_points_at_the_bench_help(capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "--frobnicate"])
    assert info.value.code == 2
    assert capsys.readouterr().err == ("prefixkv bench: error: unrecognized arguments: "
                                       "--frobnicate (see prefixkv bench --help)\n")


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "bench" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--workload", "trace"], "--workload trace needs --trace FILE"),
    (["--workload", "chat", "--trace", "x.jsonl"], "--trace replays a trace"),
    (["--scale", "0"], "must be a finite number > 0"),
    (["--pool-blocks", "0"], "must be >= 1"),
    (["--workload", "nope"], "invalid choice"),
    (["--groups", "gemma4"], "argument --groups: unknown layer mix 'gemma4'; choose from "
     "gemma3-like, gpt-oss-like, or none"),
    (["--groups", "gpt-oss-like,gpt-oss-like"], "argument --groups: a layer mix named twice"),
    (["--groups", "none,gemma3-like"], "unknown layer mix 'none'"),
    (["--groups", ""], "unknown layer mix ''"),
    (["--replicas", "2", "--groups", "none"], "--groups is a section of the report, not of "
     "the --replicas run"),
])
def test_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_smoke_run_writes_reports(tmp_path, capsys):
    out = tmp_path / "res"
    assert main(["bench", "--scale", "0.02", "--no-e2e", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "prefixkv" in text and "wall time" in text and "hit rate" in text
    assert "alloc/saved" in text and "ESTIMATE for Llama-3-8B-like" in text
    assert {p.name for p in out.iterdir()} == {"report.md", "report.json", "capacity.png",
                                               "allocators.png", "host_tier.png"}
    assert "from host" in text and "est. prefill ms/req" in text
    data = json.loads((out / "report.json").read_text())
    assert [s["name"] for s in data["host_tiers"]] == ["chat", "document", "pressure"]
    assert [w["name"] for w in data["workloads"]] == ["system-prompt", "chat", "document",
                                                      "pressure"]
    for wl in data["workloads"]:
        assert set(wl["results"]) == {"contiguous", "paged", "prefixkv"}
        assert wl["results"]["paged"]["prefill_saved"] == 0
        assert wl["results"]["paged"]["alloc_share"] is None
        assert 0 < wl["results"]["prefixkv"]["alloc_share"] < 1
        assert wl["sweep"]
    md = (out / "report.md").read_text()
    assert "| system-prompt" in md and "![capacity.png](capacity.png)" in md
    assert [r["mix"] for r in data["groups"]["rows"]] == ["gemma3-like"] * 2 + ["gpt-oss-like"] * 2
    assert "## Layer groups (hybrid models)" in md and "| gemma3-like  | hybrid" in md
    assert "layer groups: gemma3-like = 5 sliding-window (W=1024) : 1 full" in text


def test_groups_flag_alone_means_both_mixes():
    from prefixkv.cli import build_parser
    args = build_parser().parse_args(["bench", "--groups"])
    assert args.groups == ("gemma3-like", "gpt-oss-like")
    assert build_parser().parse_args(["bench"]).groups is None  # the run's default: both


@pytest.mark.parametrize("groups", ["gpt-oss-like", "none"])
def test_groups_section_one_mix_or_none(tmp_path, capsys, groups):
    out = tmp_path / "res"
    assert main(["bench", "--workload", "chat", "--scale", "0.02", "--no-e2e", "--no-plots",
                 "--no-host-tiers", "--no-store-replicas", "--groups", groups,
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    data = json.loads((out / "report.json").read_text())
    md = (out / "report.md").read_text()
    if groups == "none":
        assert "groups" not in data and "Layer groups" not in md and "layer groups" not in text
        assert data["config"]["groups"] == []
    else:
        rows = data["groups"]["rows"]
        assert [(r["mix"], r["tables"]) for r in rows] == [("gpt-oss-like", "hybrid"),
                                                            ("gpt-oss-like", "all full")]
        assert rows[0]["blocks_per_req_4096"] == 266.0  # 257 full + 9 in the W=128 window
        assert "| gpt-oss-like | hybrid" in md and "gpt-oss-like  hybrid" in text


def test_trace_run_and_trace_error(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"id": 1, "segments": [{"share": "s", "len": 64}, {"len": 3}], '
                     '"output_len": 4}\n{"id": 2, "continues": 1, "segments": [{"len": 5}], '
                     '"output_len": 2}\n')
    out = tmp_path / "res"
    assert main(["bench", "--trace", str(trace), "--no-e2e", "--no-plots", "--out", str(out),
                 "--block-size", "8"]) == 0
    data = json.loads((out / "report.json").read_text())
    # 71 tokens of turn 1: 8 full blocks
    assert data["workloads"][0]["results"]["prefixkv"]["prefill_saved"] == 64
    assert not list(out.glob("*.png"))
    # the trace alone: no built-in sections unless asked for (end to end, layer groups)
    assert main(["bench", "--trace", str(trace), "--no-plots", "--out", str(out),
                 "--block-size", "8"]) == 0
    data = json.loads((out / "report.json").read_text())
    assert [w["name"] for w in data["workloads"]] == ["t"]  # (named after the file)
    assert "e2e" not in data and "groups" not in data and "host_tiers" not in data
    trace.write_text('{"id": 1, "prompt": [1], "output_len": -1}\n')
    assert main(["bench", "--trace", str(trace), "--out", str(out)]) == 2
    assert "line 1, field 'output_len'" in capsys.readouterr().err


def test_missing_matplotlib_still_writes_md_and_json(tmp_path, monkeypatch):
    data = json.loads('{"machine": {"platform": "p", "cpu_cores": 2, "python": "3", '
                      '"prefixkv": "0"}, "config": {"scale": 1, "block_size": 16, "seed": 0, '
                      '"pool_blocks": null}, "workloads": [], "wall_s": 0.5, "prefill_cost": "m"}')
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    notes = write_all(data, tmp_path)
    assert any("matplotlib is not installed" in n for n in notes)
    assert {p.name for p in tmp_path.iterdir()} == {"report.md", "report.json"}


def test_python_dash_m_and_no_torch_at_import():
    code = ("import sys, prefixkv.cli, prefixkv.bench.suite, prefixkv.bench.report; "
            "assert 'torch' not in sys.modules and 'matplotlib' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
    res = subprocess.run([sys.executable, "-m", "prefixkv", "bench", "--help"],
                         capture_output=True, text=True, check=True)
    assert "--pool-blocks" in res.stdout
    res = subprocess.run([sys.executable, "-m", "prefixkv", "--version"],
                         capture_output=True, text=True, check=True)
    assert res.stdout.startswith("prefixkv ")

"""`prefixkv bench` from the command line: help, a tiny run, a trace, a bad trace."""

import json
import subprocess
import sys

import pytest

from prefixkv.cli import main


def test_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--workload", "--trace", "--scale", "--pool-blocks", "--block-size", "--seed",
                 "--no-e2e", "--no-plots", "--out"):
        assert flag in text


def test_a_tiny_run_writes_the_report(tmp_path, capsys):
    assert main(["bench", "--scale", "0.05", "--no-e2e", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "report.json").read_text())
    assert [w["name"] for w in data["workloads"]] == ["system-prompt", "chat", "document", "pressure"]
    for wl in data["workloads"]:
        assert set(wl["results"]) == {"contiguous", "paged", "prefixkv"}
        assert wl["results"]["prefixkv"]["prefill_saved"] > 0
        assert wl["results"]["paged"]["prefill_saved"] == 0
    assert "| workload " in (tmp_path / "report.md").read_text()
    pytest.importorskip("matplotlib")
    assert (tmp_path / "capacity.png").stat().st_size > 1000


def test_trace_replay_and_its_errors(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"id": "a", "segments": [{"share": "s", "len": 64}], "output_len": 4}\n'
                     '{"id": "b", "segments": [{"share": "s", "len": 64}, {"len": 3}], "output_len": 4}\n')
    assert main(["bench", "--trace", str(trace), "--no-e2e", "--no-plots", "--out", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "report.json").read_text())["workloads"][0]["results"]["prefixkv"]
    assert saved["prefill_saved"] == 64
    trace.write_text('{"id": "a", "prompt": [1], "output_len": 1}\n{"id": "a"}\n')
    assert main(["bench", "--trace", str(trace), "--no-e2e", "--out", str(tmp_path)]) == 2
    assert "line 2" in capsys.readouterr().err


def test_python_dash_m_runs_the_cli():
    out = subprocess.run([sys.executable, "-m", "prefixkv", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and "prefixkv" in out.stdout

"""`prefixkv bench`'s cascade-attention section: in the console summary, report.md and
report.json; --no-cascade leaves it out; a trace run has none; its scale is checked."""

from __future__ import annotations

import json
import sys

import pytest

from prefixkv.bench.cascade_bytes import run_cascade
from prefixkv.bench.errors import BenchError
from prefixkv.bench.report import cascade_parts
from prefixkv.bench.suite import BenchConfig, check_config
from prefixkv.cli import main

QUICK = ["--workload", "chat", "--scale", "0.02", "--no-e2e", "--no-plots", "--no-host-tiers",
         "--no-store-replicas", "--groups", "none"]


def test_the_section_is_in_the_summary_and_the_reports(tmp_path, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    from prefixkv.bench.cascade_bytes import count_workload
    from prefixkv.bench.workloads import document, system_prompt

    out = tmp_path / "res"
    assert main(["bench", *QUICK, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    data = json.loads((out / "report.json").read_text())
    assert data["config"]["cascade"] is True
    rows = data["cascade"]["rows"]
    # the run's scale and seed, blocks of 16: the same count as the module's own
    assert rows == [count_workload(system_prompt(0.02)), count_workload(document(0.02))]
    assert all(r["cascade_bytes_per_step"] < r["plain_bytes_per_step"] for r in rows)
    assert "cascade attention: KV bytes the attention kernel reads per step, a COUNT" in text
    assert "Llama-3-8B-like (32 query / 8 KV heads, head_dim 128, 16-bit KV, one layer)" in text
    assert "decode plain / cascade" in text and "\nsystem-prompt " in text and "\ndocument " in text
    md = (out / "report.md").read_text()
    assert "## Cascade attention: KV read per step" in md and "| document " in md


def test_no_cascade_leaves_it_out(tmp_path, capsys):
    out = tmp_path / "res"
    assert main(["bench", *QUICK, "--no-cascade", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    data = json.loads((out / "report.json").read_text())
    assert "cascade" not in data and data["config"]["cascade"] is False
    assert "cascade attention" not in text
    assert "Cascade attention" not in (out / "report.md").read_text()


def test_help_names_the_flag(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    assert "--no-cascade" in capsys.readouterr().out


def test_a_trace_run_has_no_cascade_section(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"id": 1, "segments": [{"len": 40}], "output_len": 2}\n')
    out = tmp_path / "res"
    assert main(["bench", "--trace", str(trace), "--no-plots", "--out", str(out)]) == 0
    data = json.loads((out / "report.json").read_text())
    assert "cascade" not in data and data["config"]["cascade"] is False


def test_its_workloads_scale_is_checked_before_any_work(tmp_path, capsys):
    """--workload chat fits --scale 10; the section's document workload does not (it
    would hold 32.9M tokens): refused up front unless the section is left out."""
    out = tmp_path / "res"
    assert main(["bench", "--workload", "chat", "--scale", "10", "--out", str(out)]) == 2
    assert not out.exists()
    assert "the document workload would hold up to" in capsys.readouterr().err
    check_config(BenchConfig(workloads=("chat",), scale=10, cascade=False))
    with pytest.raises(BenchError, match="document"):
        check_config(BenchConfig(workloads=("chat",), scale=10))


def test_without_torch_the_section_says_it_was_skipped(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    data = run_cascade(0.02)
    assert data["skipped"].startswith("needs torch and triton (pip install 'prefixkv[kernels]')")
    assert cascade_parts({"cascade": data}) == [f"cascade attention skipped: {data['skipped']}"]

"""The output folder: checked before the run, replaced as a whole after it, never a mix
of an old report and new files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from prefixkv.bench import report, suite
from prefixkv.bench.errors import BenchError
from prefixkv.bench.outdir import ReportDir
from prefixkv.cli import main

# What these tests check is the folder, not the report: the sections with no file of their
# own stay off (the layer-groups section alone is most of a run's CPU time).
FOLDER_ONLY = ["--scale", "0.02", "--no-e2e", "--groups", "none", "--no-store-replicas"]


def _names(path):
    return sorted(p.name for p in path.iterdir())


def test_a_new_run_replaces_every_file_of_the_old_report(tmp_path, capsys):
    out = tmp_path / "res"
    assert main(["bench", *FOLDER_ONLY, "--out", str(out)]) == 0
    assert _names(out) == ["allocators.png", "capacity.png", "host_tier.png", "report.json", "report.md"]
    assert main(["bench", *FOLDER_ONLY, "--no-plots", "--seed", "3", "--out", str(out)]) == 0
    assert _names(out) == ["report.json", "report.md"]  # no old plot beside the new report
    assert json.loads((out / "report.json").read_text())["config"]["seed"] == 3
    assert _names(tmp_path) == ["res"]
    capsys.readouterr()


@pytest.mark.parametrize("failure", [KeyboardInterrupt, RuntimeError])
def test_a_run_that_fails_leaves_the_old_report_whole(failure, tmp_path, capsys, monkeypatch):
    out = tmp_path / "res"
    out.mkdir()
    (out / "report.md").write_text("old md")
    (out / "capacity.png").write_bytes(b"old png")

    def half_written(data, folder, plots=True):  # the JSON is out, then the markdown fails
        (folder / "report.json").write_text("{}")
        raise failure("while writing")
    monkeypatch.setattr(report, "write_all", half_written)
    if failure is KeyboardInterrupt:
        assert main(["bench", *FOLDER_ONLY, "--out", str(out)]) == 130
        assert capsys.readouterr().err == "prefixkv bench: interrupted\n"
    else:
        with pytest.raises(RuntimeError):
            main(["bench", *FOLDER_ONLY, "--out", str(out)])
    assert _names(out) == ["capacity.png", "report.md"]
    assert (out / "report.md").read_text() == "old md"
    assert _names(tmp_path) == ["res"]


def test_report_dir_checks_and_publishes(tmp_path):
    out = tmp_path / "a" / "b"
    rd = ReportDir(out)  # creates the parents and a staging folder beside ``out``
    assert rd.staging.parent == tmp_path / "a" and rd.staging.name.startswith(".b.")
    (rd.staging / "report.md").write_text("new")
    rd.publish()
    rd.discard()  # no-op once published
    assert _names(out) == ["report.md"] and _names(tmp_path / "a") == ["b"]
    again = ReportDir(out)
    again.discard()
    assert _names(tmp_path / "a") == ["b"]
    with pytest.raises(BenchError, match=r"holds files that are not a bench report \(x\)"):
        (out / "x").mkdir()
        ReportDir(out)


def test_files_added_during_the_run_are_never_deleted(tmp_path):
    out = tmp_path / "res"
    rd = ReportDir(out)
    out.mkdir()
    (out / "mine.txt").write_text("x")
    (rd.staging / "report.md").write_text("new")
    with pytest.raises(BenchError, match=r"gained files .*mine.txt.*report is in .*\.res\."):
        rd.publish()
    rd.discard()
    assert (out / "mine.txt").exists() and rd.staging.exists()


def test_every_file_the_report_writes_is_known(tmp_path):
    # Every section with a file of its own (host tiers here, e2e below); the groups and
    # store-replica sections have none (tests/bench/test_cli.py's smoke run writes the same
    # files with both on).
    data = suite.run_bench(suite.BenchConfig(workloads=("chat",), scale=0.02, e2e=False, groups=(),
                                             store_replicas=False))
    data["e2e"] = {"device": "d", "model": "m", "identical": True, "config": {"repeats": 1}, "turns": [
        {"turn": 1, "prompt_tokens": 4, "cached_tokens": 0, "prefill_tokens_nocache": 4,
         "prefill_tokens_cache": 4, "ttft_cpu_ms_nocache": 1.0, "ttft_cpu_ms_cache": 1.0,
         "ttft_wall_ms_nocache": 1.0, "ttft_wall_ms_cache": 1.0}]}
    report.write_all(data, tmp_path)
    assert set(_names(tmp_path)) == set(report.FILES)


def test_a_symlink_is_refused(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(BenchError, match="is a symbolic link"):
        ReportDir(tmp_path / "link")


def test_a_failed_rename_puts_the_old_report_back(tmp_path, monkeypatch):
    out = tmp_path / "res"
    out.mkdir()
    (out / "report.md").write_text("old")
    rd = ReportDir(out)
    (rd.staging / "report.md").write_text("new")
    real_rename = os.rename
    calls = []

    def rename(src, dst):
        calls.append(src)
        if len(calls) == 2:  # staging -> out
            raise OSError("disk gone")
        real_rename(src, dst)
    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="disk gone"):
        rd.publish()
    rd.discard()
    assert (out / "report.md").read_text() == "old" and _names(tmp_path) == ["res"]


@pytest.mark.parametrize("out", ["", ".", "..", "{cwd}", "{cwd}/../{name}"])
def test_the_current_folder_or_one_holding_it_is_refused(out, tmp_path, monkeypatch):
    """Replacing the working folder (``--out .``, ``--out ''``) or a folder above it
    renamed it away under the shell that ran the bench: its working folder was gone
    (``getcwd`` failed) and the report sat in a new folder of the same name. Refused
    before anything is created, even when the folder is empty or holds a report."""
    cwd = tmp_path / "work"
    cwd.mkdir()
    (cwd / "report.md").write_text("an earlier report\n")
    monkeypatch.chdir(cwd)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(BenchError, match="working folder"):
        ReportDir(Path(out.format(cwd=cwd, name=cwd.name)))
    assert sorted(p.name for p in tmp_path.iterdir()) == before   # no staging folder
    assert os.getcwd() == str(cwd)

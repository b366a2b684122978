"""Bad input to ``prefixkv bench``: exit 2 (130 on Ctrl-C) with one line on stderr, no
traceback, checked before any work starts where the input allows it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from prefixkv.bench import suite
from prefixkv.cli import main


def _fails(argv: list[str], capsys) -> str:
    """Run the command, check exit 2 and a single ``error:`` line; return that line."""
    try:
        code = main(["bench", *argv])
    except SystemExit as exc:  # argparse
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("prefixkv bench: error: ") and err.count("\n") == 1, err
    return err


def _no_run(monkeypatch) -> None:
    """Make any replay or workload construction fail the test: the error must come first."""
    def forbidden(*args, **kwargs):
        raise AssertionError("work started before the input was checked")
    monkeypatch.setattr(suite, "builtin", forbidden)
    monkeypatch.setattr(suite, "run_workload", forbidden)


def _trace(tmp_path: Path, *lines: str) -> str:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def _chain(n: int, k: int) -> list[str]:
    """n chat turns, each continuing the previous one with k new tokens."""
    lines = [json.dumps({"id": 0, "segments": [{"len": k}], "output_len": 1})]
    lines += [json.dumps({"id": i, "continues": i - 1, "segments": [{"len": k}], "output_len": 1})
              for i in range(1, n)]
    return lines


@pytest.mark.parametrize("lines,message", [
    (["[" * 100_000], "line 1: nested too deeply"),
    (['{"id": 1, "segments": [{"len": 1' + "0" * 40 + '}], "output_len": 1}'],
     "over the cap of 1,048,576 tokens per request"),
    (['{"id": 1, "segments": [{"len": 1000000000}], "output_len": 1}'],
     "1,000,000,001 tokens (prompt with its history, and output), over the cap of 1,048,576"),
    (['{"id": 1, "prompt": [1], "output_len": 1000000000}'], "over the cap of 1,048,576"),
    (['{"id": 1, "prompt": [1], "output_len": 1' + "1" * 5000 + "}"], "line 1: not valid JSON"),
    (_chain(2000, 1000), "over the cap of 16,777,216 tokens for the whole trace"),
    (['{"id": 1, "prompt": [1], "output_len": ' + json.dumps("x" * 10**6) + "}"],
     "must be an int >= 1, got 'xxxxxxxx"),
    (['{"id": 1, "prompt": [1], "output_len": 1, "cache_salt": ' + json.dumps("a\udc00") + "}"],
     "line 1, field 'cache_salt': ExtraKeys.cache_salt cannot be encoded as UTF-8"),
    (['{"id": 1, "prompt": [1], "output_len": 1, "lora": ' + json.dumps("\ud800") + "}"],
     "line 1, field 'lora': ExtraKeys.lora cannot be encoded as UTF-8"),
], ids=["deep", "len-1e40", "len-1e9", "output-1e9", "5000-digits", "quadratic-chain", "huge-value",
        "surrogate-salt", "surrogate-lora"])
def test_bad_trace(lines, message, tmp_path, capsys):
    err = _fails(["--trace", _trace(tmp_path, *lines), "--no-e2e", "--out",
                  str(tmp_path / "out")], capsys)
    assert message in err and len(err) < 400
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl"]  # no staging folder left


@pytest.mark.parametrize("argv,message", [
    (["--scale", "inf"], "argument --scale: must be a finite number > 0, got inf"),
    (["--scale", "nan"], "must be a finite number > 0, got nan"),
    (["--scale", "1e6"], "--scale 1e+06: the system-prompt workload would hold up to"),
    (["--scale", "1e308"], "--scale 1e+308: the system-prompt workload would hold up to 1e+308 "
     "times its 486,400 tokens, over the cap of 16,777,216 (limits.MAX_TRACE_TOKENS); it fits "
     "up to --scale 34.5"),
    (["--workload", "chat", "--scale", "57"], "--scale 57: the chat workload would hold up to"),
    (["--pool-blocks", "99999999999"], "argument --pool-blocks: at most 524,288, got 99,999,999,999"),
    (["--block-size", "0"], "argument --block-size: must be >= 1, got 0"),
    (["--workload", "trace"], "--workload trace needs --trace FILE"),
    (["--groups", "gemma3"], "argument --groups: unknown layer mix 'gemma3'"),
    (["--groups", "x" * 10_000], "argument --groups: unknown layer mix 'xxxxxxxx"),
])
def test_bad_flags_fail_before_any_work(argv, message, tmp_path, capsys, monkeypatch):
    _no_run(monkeypatch)
    err = _fails([*argv, "--out", str(tmp_path / "out")], capsys)
    assert message in err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("scale", ["1e308", "1e6"])
def test_a_fleet_run_checks_the_scale_before_any_work(scale, tmp_path, capsys, monkeypatch):
    from prefixkv.bench import fleet_report
    monkeypatch.setattr(fleet_report, "builtin", lambda *a: pytest.fail("built a workload"))
    err = _fails(["--replicas", "2", "--scale", scale, "--out", str(tmp_path / "out")], capsys)
    assert "the system-prompt workload would hold up to" in err and "it fits up to" in err
    assert not list(tmp_path.iterdir())


def test_pool_over_the_cap_after_parsing_a_trace(tmp_path, capsys, monkeypatch):
    # block size 1: a 600,000-token request needs 600,000 blocks, the sweep twice that
    trace = _trace(tmp_path, '{"id": 1, "segments": [{"len": 600000}], "output_len": 1}')
    monkeypatch.setattr(suite, "run_workload", lambda *a: pytest.fail("replayed"))
    err = _fails(["--trace", trace, "--block-size", "1", "--no-e2e", "--out",
                  str(tmp_path / "out")], capsys)
    assert "pools up to 1,200,002 blocks, over the cap of 1,048,576" in err


def _a_file(d: Path) -> Path:
    (d / "f").write_text("x")
    return d / "f"


def _under_a_file(d: Path) -> Path:
    return _a_file(d) / "sub"


def _foreign_files(d: Path) -> Path:
    (d / "mine").mkdir()
    (d / "mine" / "report.md").write_text("old")
    (d / "mine" / "notes.txt").write_text("x")
    return d / "mine"


@pytest.mark.parametrize("make,message", [
    (_a_file, "is a file, not a folder"),
    (_under_a_file, "cannot create the output folder"),
    (_foreign_files, "holds files that are not a bench report (notes.txt)"),
])
def test_bad_out_fails_before_the_run(make, message, tmp_path, capsys, monkeypatch):
    _no_run(monkeypatch)
    out = make(tmp_path)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    err = _fails(["--out", str(out), "--no-e2e"], capsys)
    assert message in err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
def test_unwritable_out_fails_before_the_run(capsys, monkeypatch):
    _no_run(monkeypatch)  # /proc refuses new entries even to root
    assert "cannot create the output folder" in _fails(["--out", "/proc/prefixkv-bench"], capsys)


def test_ctrl_c_exits_130_with_one_line_and_keeps_the_old_report(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.md").write_text("old")
    env = {**os.environ, "PYTHONPATH": str(Path(suite.__file__).parents[2])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefixkv", "bench", "--no-e2e", "--no-plots", "--progress",
         "--out", str(out)], stderr=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    assert proc.stderr.read(1) == b"\r"  # the progress bar: the run has started
    proc.send_signal(signal.SIGINT)
    stdout, rest = proc.communicate(timeout=120)
    err = rest.decode()
    assert proc.returncode == 130
    assert "Traceback" not in err and err.endswith("\nprefixkv bench: interrupted\n")
    assert [p.name for p in out.iterdir()] == ["report.md"] and (out / "report.md").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.fixture
def python_sigint():
    """SIGINT as Python installs it at start-up: a run launched in the background (nohup,
    ``cmd &`` in a script) starts with SIGINT ignored, and Python then leaves it so."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_whose_exception_was_lost_still_exits_130_and_publishes_nothing(
        tmp_path, monkeypatch, capsys, python_sigint):
    """Python drops an exception raised while a finalizer runs; the signal is remembered,
    so the run still ends interrupted before anything is published."""
    import prefixkv.cli as cli

    out = tmp_path / "out"
    out.mkdir()
    (out / "report.md").write_text("old")
    real = suite.run_bench

    def run_then_lose_the_interrupt(cfg):
        data = real(cfg)
        try:
            cli._on_sigint(signal.SIGINT, None)
        except KeyboardInterrupt:
            pass  # as a finalizer would drop it
        return data

    monkeypatch.setattr(suite, "run_bench", run_then_lose_the_interrupt)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    code = main(["bench", "--workload", "chat", "--scale", "0.05", "--no-e2e", "--no-plots",
                 "--no-host-tiers", "--no-store-replicas", "--groups", "none",
                 "--out", str(out)])
    assert code == 130
    assert capsys.readouterr().err.endswith("prefixkv bench: interrupted\n")
    assert [p.name for p in out.iterdir()] == ["report.md"] and (out / "report.md").read_text() == "old"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


@pytest.mark.parametrize(("argv", "shown"), [
    (["--pool-blocks", "1.5"], "'1.5'"), (["--block-size", "3.0"], "'3.0'"),
    (["--replicas", "1,,2"], "''"), (["--replicas", "2,x"], "'x'"), (["--pool-blocks", ""], "''")])
def test_a_count_that_is_not_an_int_says_so(argv, shown, capsys, monkeypatch):
    """argparse named our parser in the message ("invalid parse value: '1.5'", "invalid
    _int_list value: '1,,2'"): the reader learnt a function's name, not what to give."""
    _no_run(monkeypatch)
    err = _fails(argv, capsys)
    assert f"must be an int, got {shown}" in err and "parse" not in err and "_int" not in err, err

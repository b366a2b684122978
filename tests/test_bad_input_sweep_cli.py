"""The sweep, at the command line: ``prefixkv bench`` given a bad value of each argument
exits 2 with one ``error:`` line that names the argument, never a traceback (exit 1) and
never a message that names prefixkv's own helpers instead of the argument."""

from __future__ import annotations

import pytest

from prefixkv.cli import main

QUICK = ["--workload", "chat", "--scale", "0.05", "--no-e2e", "--no-host-tiers", "--no-cascade",
         "--groups", "none", "--no-plots"]


def _refused(argv: list[str], capsys, tmp_path) -> str:
    try:
        code = main(["bench", *argv, "--out", str(tmp_path / "out")])
    except SystemExit as exc:  # argparse
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert err.startswith("prefixkv bench: error: ") and err.count("\n") == 1, err[-2000:]
    return err


@pytest.mark.parametrize("argv", [
    # a block of 2**32 tokens or more: the store's name of a layout holds the size in 4
    # bytes (OverflowError, exit 1, from the store section of the report)
    ["--block-size", str(2**32), *QUICK],
    ["--block-size", str(2**70), *QUICK],
    # the fleet: a pool of one block that cannot hold a request (BenchError, exit 1), and a
    # block size that leaves each replica's pool 0 blocks (ConfigError, exit 1)
    ["--replicas", "2", "--route", "prefix", "--workload", "chat", "--scale", "0.05", "--pool-blocks", "1"],
    ["--replicas", "2", "--route", "prefix", "--workload", "chat", "--scale", "0.05",
     "--block-size", str(2**40)],
], ids=["block-size-2^32", "block-size-2^70", "fleet-pool-of-one", "fleet-block-size-2^40"])
def test_a_bad_bench_argument_is_one_error_line_not_a_traceback(argv, capsys, tmp_path):
    err = _refused(argv, capsys, tmp_path)
    assert "--block-size" in err or "pool" in err, err


@pytest.mark.parametrize("flag,value", [("--scale", "abc"), ("--scale", "1e400x"), ("--scale", "")])
def test_a_number_that_does_not_parse_names_the_argument_not_a_helper(flag, value, capsys, tmp_path):
    """argparse names the type function of a ValueError ("invalid _positive_float value"):
    the parser says what was wanted instead."""
    err = _refused([flag, value], capsys, tmp_path)
    assert "_positive_float" not in err and "must be a finite number > 0" in err, err


def test_a_replica_count_named_twice_is_refused_as_a_layer_mix_named_twice_is(capsys, tmp_path):
    """``--replicas 2,2`` ran the same fleet twice and printed its rows twice."""
    err = _refused(["--replicas", "2,2", "--route", "prefix", "--workload", "chat", "--scale", "0.05"],
                   capsys, tmp_path)
    assert "--replicas" in err and "twice" in err, err


@pytest.mark.parametrize(("argv", "named"), [
    # the fleet runs built-in workloads: a trace given beside --replicas was dropped unsaid
    (["--replicas", "2", "--route", "prefix", "--scale", "0.05", "--trace", "my.jsonl"], "--trace"),
    # --route picks the fleet's routes: without --replicas it was dropped unsaid
    (["--route", "prefix", *QUICK], "--route"),
    (["--route", "all", *QUICK], "--route"),
])
def test_an_option_the_run_would_ignore_is_refused(argv, named, capsys, tmp_path, monkeypatch):
    """An option that the run asked for does not use is an error, as ``--groups`` beside
    ``--replicas`` is, never silently dropped; refused before any work."""
    from prefixkv.bench import fleet_report, suite

    def forbidden(*args, **kwargs):
        raise AssertionError("work started before the options were checked")
    monkeypatch.setattr(suite, "run_bench", forbidden)
    monkeypatch.setattr(fleet_report, "run_fleet", forbidden)
    err = _refused(argv, capsys, tmp_path)
    assert named in err, err

"""``prefixkv bench --replicas ... --route ...``."""

import pytest

from prefixkv.cli import main


def test_replicas_and_route(tmp_path, capsys):
    assert main(["bench", "--replicas", "1,2", "--route", "prefix", "--workload", "chat",
                 "--scale", "0.2", "--no-plots", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| chat | 2 | prefix |" in out and (tmp_path / "fleet.md").exists()


def test_bad_values(tmp_path):
    with pytest.raises(SystemExit):
        main(["bench", "--replicas", "0"])
    with pytest.raises(SystemExit):
        main(["bench", "--replicas", "2", "--route", "random"])
    with pytest.raises(SystemExit):
        main(["bench", "--replicas", "2", "--workload", "trace", "--trace", str(tmp_path / "t")])


def test_skewed_and_the_cost_routes(tmp_path, capsys):
    assert main(["bench", "--replicas", "2", "--route", "cost-approx", "--workload", "skewed",
                 "--scale", "0.05", "--no-plots", "--out", str(tmp_path)]) == 0
    assert "| skewed | 2 | cost-approx |" in capsys.readouterr().out


def test_skewed_is_a_fleet_workload(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--workload", "skewed", "--out", str(tmp_path)])
    assert "add --replicas" in capsys.readouterr().err

"""A pytest plugin that names the tests a run did not finish (registered by conftest).

A run cut short (``timeout -s INT`` in ``benchmarks/gpu_session.sh``) prints only the
count of tests that finished; the H100 runs of session 12 lost 9 of 686 that way in both
tries, with no name. At the end of the run this lists, under "tests that did not finish",
each test that started and never reported its teardown (the ones that hang, or ran when
the run was cut) and, when the run was interrupted, how many collected tests never
started, the first by name. Silent when every test finished or ``-x`` stopped the run.
Works in one process and on the xdist controller (workers report their starts to it);
imports neither torch nor triton.
"""

from __future__ import annotations

from typing import Any

import pytest

SHOWN = 20  # tests never started listed by name; the rest are counted


class Unfinished:
    """The starts and finishes of one run (on the controller when under xdist)."""

    def __init__(self) -> None:
        self.started: list[str] = []  # in start order
        self.finished: set[str] = set()
        self.interrupted = False
        self.collected: list[str] = []  # this process's collection, or the first xdist worker's

    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
        self.started.append(nodeid)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        # A worker that crashes mid-test sends no teardown; xdist then reports the test
        # failed in its "???" call: that is an end too (named in its failure already).
        if report.when in ("teardown", "???"):
            self.finished.add(report.nodeid)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        if session.items:  # an xdist controller collects nothing itself
            self.collected = [item.nodeid for item in session.items]

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: Any, ids: list[str]) -> None:
        if not self.collected:
            self.collected = list(ids)

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        self.interrupted = exitstatus == pytest.ExitCode.INTERRUPTED  # (before the summary is written)

    def lines(self) -> list[str]:
        """What the summary prints: the tests started and not finished, and, when the run
        was interrupted, those never started (``-x`` stops a run without either)."""
        hung = [nodeid for nodeid in self.started if nodeid not in self.finished]
        began = set(self.started)
        never = [nodeid for nodeid in self.collected if nodeid not in began] if self.interrupted else []
        out = [f"started, never finished ({len(hung)}):", *(f"  {h}" for h in hung)] if hung else []
        if never:
            first = f", the first {SHOWN}" if len(never) > SHOWN else ""
            out += [f"never started ({len(never)}){first}:", *(f"  {n}" for n in never[:SHOWN])]
        return out

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        lines = self.lines()
        if lines:
            terminalreporter.write_sep("=", "tests that did not finish")
            for line in lines:
                terminalreporter.write_line(line)


def register(config: pytest.Config) -> None:
    """Register the plugin once, on the process that prints the summary (not on xdist workers)."""
    if not hasattr(config, "workerinput") and not config.pluginmanager.has_plugin("prefixkv-unfinished"):
        config.pluginmanager.register(Unfinished(), "prefixkv-unfinished")


def pytest_configure(config: pytest.Config) -> None:
    """As a plugin of its own (``-p unfinished``): register the tracker."""
    register(config)

"""tests/kernels/unfinished.py: a pytest run interrupted mid-test names that test and the
ones that never started; one that finishes says nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
CASES = '''
import time

def test_quick():
    pass

def test_hangs():
    open("STARTED", "w").close()
    time.sleep(600)

def test_after():
    pass
'''


def _pytest(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    (tmp_path / "test_cases.py").write_text(CASES)
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "unfinished", "-p",
           "no:randomly", *args, "test_cases.py"]
    return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _interrupted(tmp_path: Path, *args: str) -> str:
    proc = _pytest(tmp_path, *args)
    deadline = time.monotonic() + 60
    while not (tmp_path / "STARTED").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.05)
    time.sleep(0.5)  # under xdist: the worker's start report reaches the controller
    proc.send_signal(signal.SIGINT)  # as gpu_session.sh's `timeout -s INT` does
    return proc.communicate(timeout=60)[0]


def test_names_the_test_that_hung_and_those_never_started(tmp_path):
    out = _interrupted(tmp_path)
    assert "tests that did not finish" in out, out
    assert "started, never finished (1):\n  test_cases.py::test_hangs\n" in out, out
    assert "never started (1):\n  test_cases.py::test_after\n" in out, out


def test_under_xdist_names_the_hung_test_and_counts_the_rest(tmp_path):
    pytest.importorskip("xdist")
    out = _interrupted(tmp_path, "-n", "1")
    assert "started, never finished (1):\n  test_cases.py::test_hangs\n" in out, out
    assert "never started (1):\n  test_cases.py::test_after\n" in out, out


def test_a_run_that_finishes_or_stops_at_a_failure_prints_nothing_more(tmp_path):
    (tmp_path / "STARTED").mkdir()  # test_hangs's open() then fails at once
    out = _pytest(tmp_path).communicate(timeout=60)[0]
    assert "1 failed, 2 passed" in out and "did not finish" not in out, out
    out = _pytest(tmp_path, "-x").communicate(timeout=60)[0]  # test_after never starts: not a hang
    assert "1 failed, 1 passed" in out and "did not finish" not in out, out


def test_a_worker_that_crashed_is_named_by_xdist_not_listed_again(tmp_path):
    pytest.importorskip("xdist")
    (tmp_path / "test_cases.py").write_text("import os\n\ndef test_crashes():\n    os._exit(3)\n")
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "unfinished", "-n", "1",
           "test_cases.py"]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120).stdout
    assert "crashed while running 'test_cases.py::test_crashes'" in out and "did not finish" not in out, out

"""Settings for the whole suite, applied before any test module imports torch.

One intra-op thread for torch (OpenMP): the suite's tensors are tiny, and a second thread
spends its time spin-waiting rather than computing, against the other pytest-xdist worker
(`make test` runs two) and against the machine's other work. Measured on the 2-core VM at a
load average under 1: tests/engine/test_engine.py took 24.4 s (33 s of CPU) with torch's
default two threads, 9.9 s (11.3 s of CPU) with one. Subprocesses (examples, benchmarks)
inherit it. Set OMP_NUM_THREADS yourself to override.

torch's JIT extension builds (SGLang's native page hash, tests/engines/sglang_hicache) go
to this checkout's ``.cache/torch-extensions``. torch's default, ~/.cache/torch_extensions,
is one folder for every checkout and venv of the user, and the build names the venv's
torch headers: two checkouts with their own venvs rebuilt it for each other on every run
(about 20 s of CPU each time). Set TORCH_EXTENSIONS_DIR yourself to override.

Hypothesis runs without its per-example deadline (200 ms) and without the health check
that fails a test whose examples are slow to generate: on CI's two busy cores (two
pytest-xdist workers, the Triton interpreter, replica subprocesses) an example may take
ten times as long as on a quiet machine, which says nothing about the code. Every other
setting is the active profile's (``--hypothesis-profile`` still chooses another).
tests/waiting.py holds the same rule for servers and threads: wait for a condition,
never for a fixed time.
"""

import gc
import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from triton_interpreter import apply_shortcuts

settings.register_profile(
    "prefixkv-busy-machine", deadline=None,
    suppress_health_check=[*settings.default.suppress_health_check, HealthCheck.too_slow])
settings.load_profile("prefixkv-busy-machine")

os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules:  # a plugin imported it first: the variable came too late
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
os.environ.setdefault("TORCH_EXTENSIONS_DIR",
                      str(Path(__file__).resolve().parents[1] / ".cache" / "torch-extensions"))
# The subprocesses the tests start install the same interpreter shortcuts as this process
# (tests/triton_interpreter.py) through interpreter_site/sitecustomize.py, which does
# nothing unless TRITON_INTERPRET is set and triton imported.
_SITE = str(Path(__file__).resolve().parent / "interpreter_site")
os.environ["PYTHONPATH"] = os.pathsep.join([_SITE, *filter(None, [os.environ.get("PYTHONPATH")])])

# The files that take longest, in the order `make test` starts them (CPU seconds of each
# file, children included, measured under `make test`'s two workers on the 2-core VM with
# the interpreter shortcuts). Each pytest-xdist worker takes whole files in collection
# order (--dist loadfile --no-loadscope-reorder), so the run ends on short files on both
# workers, not on one long file while the other idles. xdist hands the first file to one
# worker, the second to the other, and the third at once to the first (it holds only the
# suite's two tests): that worker runs it after the suite. The other worker is then the
# one asking for files while the suite runs, so the four files after the third, which
# import vLLM in-process (13 s of CPU), go to it and it alone imports vLLM.
LONGEST_FIRST = (
    # ~60 (measured alone) before skips-r17's three more of vLLM's files, which took its
    # subprocesses' CPU from 43.7 to 67.2 s (one run each, load 9-12): vLLM's own tests,
    # two subprocesses side by side
    "engines/test_vllm_suite.py",
    "engines/test_vllm_plugin.py",  # ~12, the vLLM import
    "kernels/test_compile_sm90.py",  # ~46
    "engines/vllm_connector/test_connector.py",
    "engines/vllm_connector/test_scheduler_side.py",
    "engines/vllm_connector/test_example.py",
    "engines/test_vllm_prepare.py",  # 15-43 alone, the vLLM import
    "kernels/test_bench_kernels.py",  # ~28 alone (52 before the warm interpreter, tests/warm_python.py)
    "test_state_machine.py",  # ~30
    "fleet/test_example_fleet.py",  # ~12 alone (31 before the warm interpreter)
    "engine/test_hybrid_engine.py",  # ~19
    "engines/sglang_hicache/test_storage.py",  # ~17
    "router/test_subscriber_machine.py",  # 16-21 alone, most of it waiting on ZeroMQ reconnections
    "engine/test_backends.py",  # ~15
)


def pytest_collection_modifyitems(items) -> None:
    """``LONGEST_FIRST`` first; the other files after them, in the tree's order."""
    here = Path(__file__).resolve().parent
    rank = {here / name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path, len(rank)))


def pytest_collection_finish(session) -> None:
    """Freeze what collection built (torch, triton, hypothesis, every test module: about
    200,000 objects that live as long as the worker), so that Python's full collections
    during the tests walk only what the tests made: they took 3.2-4.9 s of a ~40 s run of
    the kernel and vLLM plugin tests, 2.0-2.8 s frozen. Unfrozen at the end, where the
    interpreter's last collection frees them as before (frozen, the Triton bindings
    report them as leaks at exit)."""
    gc.freeze()


def pytest_unconfigure(config) -> None:
    gc.unfreeze()


def pytest_runtest_setup(item) -> None:
    """The Triton interpreter's shortcuts that cannot change a result (tests/triton_interpreter.py),
    once a test module or an earlier test has imported triton."""
    apply_shortcuts()


@pytest.fixture(scope="session")
def warm_python():
    """The path of a ``python`` that runs each command in a fork of one process that has
    imported torch and triton (tests/warm_python.py), for the tests that run a script or an
    example end to end with several Python processes: each saves torch's import (about
    3.5 s of CPU). One server per pytest-xdist worker that asks for it, stopped at the end.
    Where it cannot run (not Linux, no pidfd; a server that does not start, or one whose
    imports initialized CUDA, which a fork cannot use) this is ``sys.executable``: the same
    tests, at the price of the imports (tests/test_warm_python.py then fails or skips)."""
    import shlex
    import shutil
    import subprocess
    import tempfile

    import warm_python as warm

    if not warm.supported():
        yield sys.executable
        return
    script = Path(warm.__file__).resolve()
    _WARM_SERVER_ENV.clear()  # (what the server starts with: _warm_env restores it for tests)
    _WARM_SERVER_ENV.update({k: v for k, v in os.environ.items() if _warm_pinned(k)})
    folder = Path(tempfile.mkdtemp(prefix="warm-python-"))  # short: a socket path has 107 bytes
    sock, wrapper = folder / "socket", folder / "python"
    server = subprocess.Popen([sys.executable, str(script), "serve", str(sock), str(os.getpid())],
                              stdout=subprocess.PIPE, text=True)
    try:
        if server.stdout.readline() != "ready\n":
            yield sys.executable
            return
        command = [sys.executable, "-S", "-E", str(script), "client", str(sock), sys.executable,
                   str(wrapper)]
        wrapper.write_text(f'#!/bin/sh\nexec {shlex.join(command)} "$@"\n')
        wrapper.chmod(0o755)
        yield str(wrapper)
    finally:
        server.terminate()  # its children's process groups first, then itself
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()  # its children die with it (PR_SET_PDEATHSIG)
            server.wait()
        server.stdout.close()
        shutil.rmtree(folder, ignore_errors=True)


_WARM_SERVER_ENV: dict[str, str] = {}


def _warm_pinned(name: str) -> bool:
    import warm_python as warm

    return name.startswith(warm._PINNED) or name in warm._STARTUP


@pytest.fixture(autouse=True)
def _warm_env(request, monkeypatch):
    """For a test that uses ``warm_python``: the variables the server pins (TORCH*, TRITON*,
    ...) as they were when it started. Importing vLLM in a worker sets some of them
    (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_AUTOTUNING, PYTORCH_NVML_BASED_CUDA_CHECK...);
    a test after such an import in the same worker got the real interpreter, and
    test_warm_python.py failed in CI when pytest-xdist put a vLLM file on its worker
    between the server's start and it."""
    if "warm_python" in request.fixturenames and request.getfixturevalue("warm_python") != sys.executable:
        for name in [k for k in os.environ if _warm_pinned(k) and k not in _WARM_SERVER_ENV]:
            monkeypatch.delenv(name)
        for name, value in _WARM_SERVER_ENV.items():
            monkeypatch.setenv(name, value)
    yield


@pytest.fixture(autouse=True)
def store_mistakes():
    """The records of prefixkv's own mistakes in a store call (src/prefixkv/store/
    mistakes.py: a backend refused the arguments prefixkv passed it) logged during the
    test, which fails if any is left: counted as the store's failure and logged once in
    production, each is a bug here. A test that makes one on purpose takes this fixture
    and clears the list. (By logger name: nothing of prefixkv is imported here.)"""
    import logging

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler, logger = Keep(logging.ERROR), logging.getLogger("prefixkv.store.mistakes")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
    if records:
        pytest.fail("prefixkv passed a store arguments it refuses: "
                    + "; ".join(r.getMessage() for r in records)[:2000])


@pytest.fixture
def calling_threads(monkeypatch):
    """``calling_threads(owner, name)``: replace ``owner.name`` (a function, or a method
    of a class) by one that records the calling thread's id, then calls it; returns the
    list the ids go into (to show a build ran off the scheduler's thread)."""
    import threading

    def wrap(owner, name):
        seen = []
        real = getattr(owner, name)

        def spy(*args, **kwargs):
            seen.append(threading.get_ident())
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, spy)
        return seen

    return wrap

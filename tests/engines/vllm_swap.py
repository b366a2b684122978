"""Run every vLLM test twice in one process: on vLLM's own manager and on prefixkv's.

Loaded as a pytest plugin (``-p vllm_swap``, with tests/engines and src on ``sys.path``)
in the runs of vLLM's test files (tests/engines/vllm_suite.py). Each test function gets
one more parameter, ``kv_manager`` (``vllm`` or ``prefixkv``), which pytest puts first
in its id: ``[vllm-...]`` / ``[prefixkv-...]`` (``[vllm]`` / ``[prefixkv]`` when it had
none).

With ``prefixkv``, the test's module and vLLM's test helpers (``HELPERS``: the
``create_scheduler`` modules of tests/v1/core and tests/v1/kv_connector/unit) see
prefixkv's classes under vLLM's names, for the duration of the test:

- ``Scheduler`` -> ``prefixkv.integrations.vllm.Scheduler`` and ``AsyncScheduler`` ->
  ``prefixkv.integrations.vllm.AsyncScheduler``: what ``--scheduler-cls`` would select;
  ``create_scheduler`` builds them, and so does a test that constructs a scheduler
  itself;
- ``KVCacheManager`` -> ``prefixkv.integrations.vllm.KVCacheManager``, for the tests
  that build a manager directly (test_prefix_caching.py).

Nothing of vLLM is patched: its scheduler, request, configs and connectors are the
installed wheel's. With ``vllm`` nothing is swapped (the baseline).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

MANAGERS = tuple(os.environ.get("VLLM_SUITE_MANAGERS", "vllm,prefixkv").split(","))
"""Which runs this process makes (``VLLM_SUITE_MANAGERS``; the suite runs both in each
process, one process per group of files)."""
HELPERS = ("tests.v1.core.utils", "tests.v1.kv_connector.unit.utils",
           "tests.v1.kv_connector.unit.offloading_connector.utils")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "kv_manager" in metafunc.fixturenames:
        metafunc.parametrize("kv_manager", MANAGERS, indirect=True)


def _swaps() -> dict[str, Any]:
    """vLLM's classes (by identity) and what stands for each under prefixkv."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    import prefixkv.integrations.vllm as plugin

    return {"Scheduler": (Scheduler, plugin.Scheduler),
            "AsyncScheduler": (AsyncScheduler, plugin.AsyncScheduler),
            "KVCacheManager": (KVCacheManager, plugin.KVCacheManager)}


@pytest.fixture(autouse=True)
def kv_manager(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Which manager this run of the test uses; swaps the names for ``prefixkv``."""
    which: str = getattr(request, "param", "vllm")
    if which == "prefixkv":
        import importlib

        modules = [request.module]
        for name in HELPERS:
            try:
                modules.append(importlib.import_module(name))
            except ImportError:
                pass
        for name, (theirs, ours) in _swaps().items():
            for mod in modules:
                if getattr(mod, name, None) is theirs:
                    monkeypatch.setattr(mod, name, ours)
    yield which

"""Run every vLLM test twice in one process: on vLLM's own manager and on prefixkv's.

Loaded as a pytest plugin (``-p vllm_swap``, with tests/engines and src on ``sys.path``)
in the runs of vLLM's test files (tests/engines/vllm_suite.py). Each test function gets
one more parameter, ``kv_manager`` (``vllm`` or ``prefixkv``), which pytest puts first
in its id: ``[vllm-...]`` / ``[prefixkv-...]`` (``[vllm]`` / ``[prefixkv]`` when it had
none).

With ``prefixkv``, the test's module and every other module of vLLM's test tree imported
by then (the ``tests`` package: the test helpers of ``HELPERS``, the ``create_scheduler``
modules of tests/v1/core and tests/v1/kv_connector/unit, imported first, and test files
whose helpers other files import, such as test_prefix_caching.py's
``make_kv_cache_manager``) see prefixkv's classes under vLLM's names, for the duration of
the test:

- ``Scheduler`` -> ``prefixkv.integrations.vllm.Scheduler`` and ``AsyncScheduler`` ->
  ``prefixkv.integrations.vllm.AsyncScheduler``: what ``--scheduler-cls`` would select;
  ``create_scheduler`` builds them, and so does a test that constructs a scheduler
  itself;
- ``KVCacheManager`` -> ``prefixkv.integrations.vllm.KVCacheManager``, for the tests
  that build a manager directly (test_prefix_caching.py);
- ``get_request_block_hasher`` -> one whose hashers also prepare each ``Request`` they
  build for the prefixkv manager the test built last (its ``prepared_prompts``), as the
  hasher vLLM's ``EngineCore`` gives its requests does under prefixkv's scheduler
  (prefixkv/integrations/vllm/input_thread.py). So the requests these tests build reach
  prefixkv's admission with a prepared ``Prompt`` wherever a manager existed when they
  were built, and their ids otherwise. Each test records how many admissions took a
  Prompt (the junit property ``prepared_prompts_taken``; vllm_suite.py sums them).

Each ``prefixkv`` run also records how many prefixkv managers it began to build
(``prefixkv_managers``, refused ones included) and how many of vLLM's own
(``vllm_managers``: a construction the swap did not reach, such as vLLM's
``DiffusionScheduler``, a class prefixkv does not offer); vllm_suite.py reports both.

A ``unittest.TestCase`` class of vLLM's is collected as a plain class whose methods run
the TestCase's (``pytest_pycollect_makeitem``), so that its tests get the parameter too;
and the tests that ask for vLLM's ``caplog_vllm`` fixture (from vLLM's tests/conftest.py,
which ``--confcutdir=tests/v1`` leaves out) get this module's.

Nothing of vLLM is patched: its scheduler, request, configs and connectors are the
installed wheel's (its ``KVCacheManager.__init__`` is wrapped, in ``prefixkv`` runs, by
one that counts and calls it). With ``vllm`` nothing is swapped (the baseline).
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


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(collector: pytest.Collector, name: str, obj: object) -> pytest.Class | None:
    """A ``unittest.TestCase`` class of vLLM's tests is collected as a plain class whose
    methods run the TestCase's (``_parametrizable``): pytest parametrizes no TestCase
    method, so ``kv_manager`` could not reach them, and they ran on vLLM's manager only
    (test_scheduler_streaming.py's ``TestStreamingScheduler``)."""
    import unittest

    if isinstance(obj, type) and issubclass(obj, unittest.TestCase) and obj is not unittest.TestCase:
        node = pytest.Class.from_parent(collector, name=name)
        node.obj = _parametrizable(obj)  # (from_parent takes the module's attribute otherwise)
        return node
    return None


def _parametrizable(case: type) -> type:
    """A class of the same name and module with one ``test_*`` method per test of the
    TestCase ``case``: each runs that test (``setUp``, subtests and ``tearDown``
    included) on a fresh instance, and fails with its tracebacks, or skips with its
    reason."""
    import unittest

    def method(name: str) -> Any:
        def test(self: object) -> None:
            result = unittest.TestResult()
            case(name).run(result)
            problems = [tb for _, tb in result.errors + result.failures]
            problems += [f"unexpected success: {t}" for t in result.unexpectedSuccesses]
            if problems:
                raise AssertionError("\n".join(problems))
            if result.skipped:
                pytest.skip(result.skipped[0][1])

        test.__name__ = test.__qualname__ = name
        return test

    names = unittest.TestLoader().getTestCaseNames(case)
    return type(case.__name__, (), {"__module__": case.__module__, "__doc__": case.__doc__,
                                    **{n: method(n) for n in names}})


@pytest.fixture()
def caplog_vllm(caplog: pytest.LogCaptureFixture,
                monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.LogCaptureFixture]:
    """``caplog`` that sees vLLM's log records, for the tests that ask for vLLM's fixture of
    that name: it lives in vLLM's tests/conftest.py, which the suite's ``--confcutdir=tests/v1``
    leaves out (that conftest imports vLLM's whole engine and GPU test helpers). vLLM's
    logger does not propagate to the root logger, where ``caplog`` listens: here it does, for
    the test, with records from INFO up, as vLLM's own fixture gives. vLLM's ``*_once``
    messages are logged again: the suite runs each test twice in one process, and the
    ``[prefixkv-...]`` run saw none of those its ``[vllm-...]`` twin had logged
    (test_dynamic_sd.py::test_dynamic_sd_is_disabled_with_data_parallel failed on prefixkv
    for a ``warning_once`` logged on vLLM's run)."""
    import logging

    import vllm.logger
    from vllm.logger import DEFAULT_LOGGING_CONFIG

    for level in ("debug", "info", "warning", "error"):
        once = getattr(vllm.logger, f"_print_{level}_once", None)
        if once is not None:
            once.cache_clear()

    # (a logging configuration vLLM applies during the test would turn propagation off again)
    monkeypatch.setitem(DEFAULT_LOGGING_CONFIG["loggers"]["vllm"], "propagate", True)
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)
    with caplog.at_level(logging.INFO):
        yield caplog


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


def _test_modules(module: Any) -> list[Any]:
    """The test's module and every module of vLLM's test tree imported so far (the
    ``tests`` package: helpers such as ``create_scheduler``, and test files whose
    helpers other test files import, as test_worker_slot_overflow.py imports
    ``create_scheduler_with_priority`` from test_scheduler.py)."""
    import sys

    return [module, *(m for name, m in list(sys.modules.items())
                      if m is not None and m is not module and name.startswith("tests."))]


def _count_constructions(cls: type, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the constructions of ``cls`` begun from now on, refused ones included
    (a one-item list)."""
    count = [0]
    init = cls.__init__

    def counting_init(self: Any, *args: Any, **kwargs: Any) -> None:
        count[0] += 1
        init(self, *args, **kwargs)

    monkeypatch.setattr(cls, "__init__", counting_init)
    return count


def _prepare_for_the_latest_manager(modules: list[Any], monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Swap ``get_request_block_hasher`` in ``modules`` (module doc); returns the list of
    prefixkv managers built from now on, in order."""
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher as vllms

    from prefixkv.integrations.vllm.manager import KVCacheManager

    built: list[Any] = []
    init = KVCacheManager.__init__

    def recording_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        built.append(self)

    def get_request_block_hasher(*args: Any, **kwargs: Any) -> Any:
        vllm_hasher = vllms(*args, **kwargs)

        def hasher(request: Any) -> Any:
            if built:  # (the plug-in's PreparingHasher, with its manager found late)
                built[-1].prepared_prompts.hasher(None)(request)
            return vllm_hasher(request)

        return hasher

    monkeypatch.setattr(KVCacheManager, "__init__", recording_init)
    for mod in modules:
        if getattr(mod, "get_request_block_hasher", None) is vllms:
            monkeypatch.setattr(mod, "get_request_block_hasher", get_request_block_hasher)
    return built


@pytest.fixture(autouse=True)
def kv_manager(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Which manager this run of the test uses; swaps the names for ``prefixkv``."""
    which: str = getattr(request, "param", "vllm")
    built: list[Any] = []
    ours, missed = [0], [0]
    if which == "prefixkv":
        import importlib

        for name in HELPERS:
            try:
                importlib.import_module(name)
            except ImportError:
                pass
        modules = _test_modules(request.module)
        swaps = _swaps()
        for name, (vllms, plugins) in swaps.items():
            for mod in modules:
                if getattr(mod, name, None) is vllms:
                    monkeypatch.setattr(mod, name, plugins)
        built = _prepare_for_the_latest_manager(modules, monkeypatch)
        vllm_manager, prefixkv_manager = swaps["KVCacheManager"]
        ours = _count_constructions(prefixkv_manager, monkeypatch)
        missed = _count_constructions(vllm_manager, monkeypatch)
    yield which
    if which == "prefixkv":
        taken = sum(m.prepared_prompts.taken for m in built)
        request.node.user_properties.append(("prepared_prompts_taken", taken))
        request.node.user_properties.append(("prefixkv_managers", ours[0]))
        request.node.user_properties.append(("vllm_managers", missed[0]))

"""The vLLM entry points docs/api.md lists (docs/api_sources.py's ``ENTRY_POINTS``) name
themselves when built with a keyword they do not take: vLLM builds its scheduler class
by keyword (``vllm/v1/engine/core.py``), so a wrong one must fail at construction, naming
the class ``--scheduler-cls`` gave. Needs vllm installed."""

from __future__ import annotations

import importlib
import os
import pathlib
import re
import sys

import pytest

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"


def _vllm_entry_points() -> list[tuple[str, str]]:
    sys.path.insert(0, str(DOCS))
    try:
        import api_sources
    finally:
        sys.path.remove(str(DOCS))
    return [(q, m) for q, m in api_sources.ENTRY_POINTS if ".vllm" in m]


@pytest.mark.parametrize(("qual", "module"), _vllm_entry_points())
def test_a_vllm_entry_point_names_itself_in_an_unknown_keywords_error(qual, module):
    """``AsyncScheduler(..., foo=1)`` named vLLM's ``Scheduler.__init__`` (the plug-in
    forwarded ``*args, **kwargs`` to vLLM's class)."""
    import vllm.v1.core.sched.scheduler as where

    name = qual.rsplit(".", 1)[1]
    cls = getattr(importlib.import_module(module), name)
    vllms = where.KVCacheManager
    with pytest.raises(TypeError) as raised:
        cls(no_such_keyword=1)
    assert re.match(rf"^{name}(\.__init__)?\(\) ", str(raised.value)), str(raised.value)
    assert where.KVCacheManager is vllms  # (nothing swapped, or swapped back)


@pytest.mark.parametrize("name", ["Scheduler", "AsyncScheduler"])
def test_a_scheduler_missing_an_argument_names_the_plugin(name):
    from prefixkv.integrations import vllm as plugin

    with pytest.raises(TypeError, match=rf"^{name}\.__init__\(\) missing 1 required positional "
                                        r"argument: 'block_size'$"):
        getattr(plugin, name)(vllm_config=None, kv_cache_config=None, structured_output_manager=None)

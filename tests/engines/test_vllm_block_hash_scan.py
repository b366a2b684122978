"""The plug-in's block objects (block_hash_view.py) read a block of a request the view's
scan reaches after another: ``_scan`` goes on past a request that does not hold it.
Needs vllm."""

from __future__ import annotations

import os

import pytest

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")

from . import test_vllm_reference as ref  # noqa: E402
from .test_vllm_block_hash_objects import _admit, _noted, _table  # noqa: E402

BS = ref.BS


def test_a_later_requests_block_reads_its_hash_first():
    """Two live requests of different prompts, each with a full block: the second's
    table read first (nothing noted yet), then the first's; both as vLLM's."""
    tables = []
    for s in ref._managers(12):
        a = _noted(s, "a", [*range(BS), 1])
        b = _noted(s, "b", [*range(100, 100 + BS), 1])
        _admit(s.m, a)
        _admit(s.m, b)
        tables.append((_table(s.m, "b"), _table(s.m, "a")))
    assert tables[0] == tables[1]
    assert all(t[0][0][0] is not None for t in tables[0]), tables[0]

"""vLLM's ``prefix_cache_retention_interval`` with every group at ONE block size (a pure
sliding-window model, vLLM's ``UnitaryKVCacheCoordinator``; full attention beside
windows of the same size): tests/sized_model.py's reference, whose sizes are then all
equal (hash block = alignment = the one size), driven beside vLLM 0.33's own manager by
test_vllm_sized_model.py's random streams (``Pair``): the same block ids, free queue,
keys cached and hits after every call. This checks the reference that
tests/test_groups_one_size_retention.py holds prefixkv's manager to. Needs vllm
installed."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from . import skip_module_without_vllm

skip_module_without_vllm()
pytest.importorskip("torch")

from .test_vllm_sized_model import OP, PROMPT, Pair, _drive, _pool  # noqa: E402

# (groups: (block size, window or None), retention interval)
ONE_SIZE = {
    "window8@8, retention 0": (((8, 8),), 0),
    "window12@8, retention 32": (((8, 12),), 32),
    "window20@8, retention 32": (((8, 20),), 32),
    "full8+window8@8, retention 0": (((8, None), (8, 8)), 0),
    "full8+window12@8, retention 24": (((8, None), (8, 12)), 24),
    "window20@16+full16, retention 32": (((16, 20), (16, None)), 32),
    "full8+window4@8+window30@8, retention 16": (((8, None), (8, 4), (8, 30)), 16),
}


@pytest.mark.parametrize("layout", list(ONE_SIZE))
@settings(max_examples=30, deadline=None)
@given(extra=st.integers(0, 6), ops=st.lists(OP, min_size=4, max_size=30), probe=PROMPT)
def test_the_one_size_reference_retains_as_vllms_manager(layout, extra, ops, probe):
    groups, retention = ONE_SIZE[layout]
    _drive(Pair(groups, _pool(groups, extra), retention=retention), ops, probe)

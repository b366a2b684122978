"""vLLM's ``coordinator.retention_interval`` set after construction
(integrations/vllm/retention_setter.py): on a manager holding nothing, the plug-in is
built again with it and then answers as vLLM's manager with the same interval set the
same way (test_vllm_mamba_checkpoint_plugin.py's ``CheckpointSides``: tables, free
count, hits with their junctions, copies, after every call); elsewhere it is refused by
name, nothing changed. Needs vllm installed."""

from __future__ import annotations

import math
import os
from functools import reduce

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")

from .test_vllm_block_sizes_reference import _request, _spec  # noqa: E402
from .test_vllm_mamba_checkpoint_plugin import CheckpointSides, checkpoint_plugin  # noqa: E402
from .test_vllm_mamba_sizes import OP  # noqa: E402
from .test_vllm_plugin import config  # noqa: E402
from .test_vllm_sized_model import PARTIAL, PROMPT  # noqa: E402

LAYOUT = ((16, None), (32, "mamba"))  # (vLLM's test_internal_checkpoint_publication_respects_retention)


@pytest.mark.parametrize("layout", list(PARTIAL))
@pytest.mark.parametrize(("built", "segments"), [(None, 0), (None, 2), (0, None), (0, 2)])
@settings(max_examples=25, deadline=None)
@given(ops=st.lists(OP, min_size=4, max_size=25), probe=PROMPT)
def test_an_interval_set_after_construction_is_followed_as_vllms(layout, built, segments, ops, probe):
    # built with ``built``, then set to ``segments`` scheduler blocks (None: dense) on
    # both sides, as vLLM's tests set it; the same answers after every call
    groups = PARTIAL[layout]
    h, lcm = reduce(math.gcd, (b for b, _ in groups)), reduce(math.lcm, (b for b, _ in groups))
    sides = CheckpointSides(groups, 400, h, retention=built)
    interval = None if segments is None else segments * lcm
    for m in sides.ms:
        m.coordinator.retention_interval = interval
    assert sides.ms[1].retention_interval == sides.ms[1].coordinator.retention_interval == interval
    for op, a, b in ops:
        sides.do(op, a, b)
        sides.compare(probe)
        if any(sides.ms[1].core._index.twins):
            return


@pytest.mark.parametrize("interval", [0, 64, 256])
def test_a_prompts_first_chunk_publishes_what_a_manager_built_with_the_interval_does(interval):
    # full16+mamba32 (hash 16), a prompt of 240 whose first chunk of 128 checkpoints at
    # 112 into Mamba's entry 2 (transient; none under 0: below vLLM's prefill_end) and
    # ends at 128 (entry 3, offered under 64 only): set after construction, as built
    # with it
    set_after = checkpoint_plugin(LAYOUT, 16, 40)
    set_after.coordinator.retention_interval = interval
    built = checkpoint_plugin(LAYOUT, 16, 40, retention=interval)
    got = []
    for m in (set_after, built):
        r = _request("p", list(range(240)), 16)
        blocks, hit, _ = m.get_computed_blocks(r)
        assert m.allocate_slots(r, 128, hit, blocks) is not None
        offers = m.take_boundary_state_offloads().get("p", [])
        got.append(([list(g) for g in m.get_block_ids("p")], sorted(pos for _, _, pos in offers)))
    assert got[0] == got[1]
    mamba = [0, 0, 0, 9] if interval == 0 else [0, 0, 9, 10]  # (0: no checkpoint below prefill_end)
    assert got[0] == ([list(range(1, 9)), mamba], [128] if interval == 64 else [])


def test_set_while_the_manager_holds_a_block_is_refused_and_changes_nothing():
    from prefixkv.integrations.vllm import UnsupportedByPrefixKV

    m = checkpoint_plugin(LAYOUT, 16, 40)
    core = m.core
    r = _request("p", list(range(40)), 16)
    assert m.allocate_slots(r, 40) is not None
    with pytest.raises(UnsupportedByPrefixKV, match=r"set after construction \(None to 0\)"):
        m.coordinator.retention_interval = 0
    assert m.retention_interval is None and m.core is core and m.live_request_ids() == ["p"]
    r.num_computed_tokens = 40
    m.free(r)  # (no request now, but cached blocks: refused too, a new build would lose them)
    assert m.core.num_cached_blocks
    with pytest.raises(UnsupportedByPrefixKV, match="cached contents"):
        m.coordinator.retention_interval = 0
    assert m.retention_interval is None and m.core is core
    assert m.reset_prefix_cache()
    m.coordinator.retention_interval = 0  # (holding nothing: followed)
    assert m.retention_interval == 0 and m.core is not core


def test_an_interval_construction_refuses_is_refused_and_changes_nothing():
    from prefixkv.errors import ConfigError
    from prefixkv.integrations.vllm import UnsupportedByPrefixKV

    m = checkpoint_plugin(LAYOUT, 16, 40)
    core = m.core
    with pytest.raises(ConfigError, match="non-negative and a multiple of scheduler_block_size"):
        m.coordinator.retention_interval = 48
    with pytest.raises(ConfigError, match="must be an int or None"):
        m.coordinator.retention_interval = 32.0
    assert m.retention_interval is None and m.core is core
    # a positive interval beside Mamba at one block size: not applied there (retention.py)
    from prefixkv.integrations.vllm import KVCacheManager

    one = KVCacheManager(config(_spec(16, None), _spec(16, "mamba"), num_blocks=40), max_model_len=256,
                         scheduler_block_size=16, hash_block_size=16)
    with pytest.raises(UnsupportedByPrefixKV, match="does not apply prefix_cache_retention_interval=32"):
        one.coordinator.retention_interval = 32
    assert one.retention_interval is None


def test_the_same_interval_builds_nothing_and_a_new_build_keeps_the_schedulers_flag():
    m = checkpoint_plugin(LAYOUT, 16, 40)
    core, coordinator = m.core, m.coordinator
    coordinator.retention_interval = None
    assert m.core is core
    m.hands_off_events = True  # (set by prefixkv's Scheduler: handoff.py)
    coordinator.retention_interval = 64
    assert m.core is not core and m.hands_off_events
    assert coordinator.retention_interval == m.coordinator.retention_interval == 64
    assert m.kv_cache_config.prefix_cache_retention_interval == 64


def test_a_manager_built_with_positional_arguments_is_built_again_with_them():
    # KVCacheManager(config, max_model_len, scheduler_block_size, hash_block_size): the
    # new build keeps each argument but the config (mutants-r29: args[1:])
    from prefixkv.integrations.vllm import KVCacheManager

    cfg = config(_spec(16, None), _spec(16, "mamba"), num_blocks=40)
    m = KVCacheManager(cfg, 256, 16, 16)
    m.coordinator.retention_interval = 0
    assert (m.retention_interval, m.max_model_len, m.block_size) == (0, 256, 16)
    assert m.kv_cache_config.prefix_cache_retention_interval == 0

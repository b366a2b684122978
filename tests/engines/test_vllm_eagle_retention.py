"""vLLM's ``prefix_cache_retention_interval`` beside EAGLE (``use_eagle``) and Mamba
groups with vLLM's fine-grained partial hits (integrations/vllm/retention.py
``_beside_eagle``; groups/eagle_retention.py ``eagle_marks``): vLLM keeps a Mamba state at each
segment's end, at EAGLE's replay boundaries (one scheduler block below the prompt's last
aligned boundaries), at its prompt checkpoint (one hash block below the prompt's last
hash boundary) and at a junction and one Mamba block below it; prefixkv keeps the same.
test_vllm_eagle_mamba.py's random side-by-side streams with the interval on both sides
(hits, tables, free counts and copies equal after every call; every hit's blocks holding
what it says: ``check_holds``), with and without one checkpoint block per Mamba group,
an exact scenario, and the refusals. Needs vllm installed."""

from __future__ import annotations

import math
import os
from dataclasses import replace
from functools import reduce
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")

from .test_vllm_block_sizes_reference import _request, _spec  # noqa: E402
from .test_vllm_eagle_mamba import EagleSides, _noting_copies, check_holds  # noqa: E402
from .test_vllm_eagle_mamba_checkpoints import CheckpointEagleSides  # noqa: E402
from .test_vllm_mamba_sizes import OP  # noqa: E402
from .test_vllm_plugin import config  # noqa: E402
from .test_vllm_sized_model import MAX_LEN, PARTIAL, PARTIAL_FULL, PROMPT  # noqa: E402

LAYOUTS = {**{k: (v, None) for k, v in PARTIAL.items()}, **PARTIAL_FULL}


def _config(groups: Any, num_blocks: int, flag: int | None, retention: int | None,
            checkpoints: int = 0) -> Any:
    """The ``KVCacheConfig`` of ``groups`` with the interval, ``is_eagle_group`` on group
    ``flag`` (None: none), ``checkpoints`` checkpoint blocks per Mamba group (their
    alignment the hash block, ``h``)."""
    specs = [replace(_spec(b, w), num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=checkpoints)
             if w == "mamba" and checkpoints else _spec(b, w) for b, w in groups]
    c = config(*specs, num_blocks=num_blocks, prefix_cache_retention_interval=retention)
    if flag is None:
        return c
    kv = list(c.kv_cache_groups)
    kv[flag] = replace(kv[flag], is_eagle_group=True)
    return replace(c, kv_cache_groups=kv)


def sides(layout: str, small: bool, flag: int | None, retention: int | None,
          checkpoints: bool = False) -> EagleSides:
    """Both managers over ``LAYOUTS[layout]`` with EAGLE and the interval (a pool a little
    over one longest request when ``small``), ready for ``check_holds``."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager
    from vllm.v1.core.kv_cache_utils import init_none_hash

    from prefixkv.integrations.vllm import KVCacheManager

    groups, h = LAYOUTS[layout]
    num_blocks = sum(-(-MAX_LEN // b) for b, _ in groups) + 3 + 2 * checkpoints if small else 400
    s = (CheckpointEagleSides if checkpoints else EagleSides)(groups, num_blocks, partial=True, hash_size=h)
    s.groups, s.written, s.copied, s.checked = groups, {}, [], 0  # (check_holds)
    init_none_hash(sha256)
    c = _config(groups, num_blocks, flag, retention, s.h if checkpoints else 0)
    s.ms = [make(c, max_model_len=256, scheduler_block_size=s.lcm, hash_block_size=s.h, use_eagle=True)
            for make in (VllmManager, KVCacheManager)]
    assert all(g.retention == retention for g in s.ms[1].core.groups if g.sparse)
    _noting_copies(s)
    return s


def checked(s: EagleSides, probe: list[int]) -> None:
    """After each op: ``check_holds``, and both sides offered a connector the same Mamba
    states in the step (vLLM's ``take_boundary_state_offloads``: group, block, position)."""
    check_holds(s, probe)
    offers = [{rid: sorted(got) for rid, got in m.take_boundary_state_offloads().items()} for m in s.ms]
    assert offers[0] == offers[1], offers
    s.offers = getattr(s, "offers", 0) + sum(map(len, offers[0].values()))


def _mamba_flag(layout: str) -> int:
    return next(g for g, (_, w) in enumerate(LAYOUTS[layout][0]) if w == "mamba")


@pytest.mark.parametrize("flag", ["none", "mamba"])
@pytest.mark.parametrize("small", [False, True])
@pytest.mark.parametrize("segments", [0, 2])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@settings(max_examples=25, deadline=None)
@given(ops=st.lists(OP, min_size=4, max_size=30), probe=PROMPT)
def test_the_plugin_retains_vllms_mamba_states_beside_eagle(layout, segments, small, flag, ops, probe):
    lcm = reduce(math.lcm, (b for b, _ in LAYOUTS[layout][0]))
    s = sides(layout, small, None if flag == "none" else _mamba_flag(layout), segments * lcm)
    s.drive(ops, probe, lambda s: checked(s, probe))


@pytest.mark.parametrize("segments", [0, 1, 2])
@pytest.mark.parametrize("layout", list(PARTIAL))
@settings(max_examples=25, deadline=None)
@given(ops=st.lists(OP, min_size=4, max_size=30), probe=PROMPT)
def test_the_plugin_retains_vllms_checkpoints_beside_eagle(layout, segments, ops, probe):
    # (one checkpoint block per Mamba group, chunks cut by vLLM's scheduler: a checkpoint
    # ending its entry is kept at a segment's end, the prompt's checkpoint or the junction)
    lcm = reduce(math.lcm, (b for b, _ in LAYOUTS[layout][0]))
    s = sides(layout, False, None, segments * lcm, checkpoints=True)
    s.drive(ops, probe, lambda s: checked(s, probe))


def _producer(m: Any) -> tuple[list[int], list[int], list[int]]:
    """vLLM's test's producer (test_partial_prefix_cache_hits.py
    ``test_internal_checkpoint_publication_respects_retention`` with EAGLE, hash 16): 240
    tokens over full attention at 16 and Mamba at 32 with one checkpoint block, computed
    in steps of 128 and 112, then freed: the Mamba positions offered to a connector
    after each step, and a replay's hit."""
    offered = []
    r = _request("p", list(range(240)), 16)
    blocks, hit, _ = m.get_computed_blocks(r)
    for n in (128, 112):
        m.new_step_starts()
        assert m.allocate_slots(r, n, hit, blocks) is not None if n == 128 else m.allocate_slots(r, n)
        r.num_computed_tokens += n
        offered.append(sorted(p for _, _, p in m.take_boundary_state_offloads().get("p", [])))
    m.free(r)
    m.new_step_starts()
    return offered[0], offered[1], [m.get_computed_blocks(_request("q", list(range(n)) + [999], 16))[1]
                                    for n in (144, 160, 240)]


@pytest.mark.parametrize(("retention", "want"), [
    # (the first step's checkpoint, 112, lies inside a block and is no prompt's: transient;
    # its end, 128, a segment's end but for 0 and 256 (EAGLE's replay boundaries, 192, and
    # the prompt's checkpoint, 224, where the second step's checkpoint lies, are kept at
    # every interval); a replay of 144 or 160 tokens and one more resumes at 128 then, of
    # 240 at 224 always)
    (None, ([128], [224], [128, 128, 224])),
    (0, ([], [224], [0, 0, 224])),
    (32, ([128], [224], [128, 128, 224])),
    (64, ([128], [224], [128, 128, 224])),
    (256, ([], [224], [0, 0, 224])),
])
def test_eagles_retained_mamba_states_are_vllms(retention, want):
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager
    from vllm.v1.core.kv_cache_utils import init_none_hash

    from prefixkv.integrations.vllm import KVCacheManager

    init_none_hash(sha256)
    c = _config(((16, None), (32, "mamba")), 40, None, retention, checkpoints=16)
    for make in (VllmManager, KVCacheManager):
        m = make(c, max_model_len=8192, scheduler_block_size=32, hash_block_size=16, use_eagle=True)
        assert _producer(m) == want, make


@pytest.mark.parametrize("retention", [0, 32])
def test_retention_beside_eagle_flagged_on_full_attention_only_is_not_applied(retention):
    # vLLM's Mamba manager is then no EAGLE group: it keeps no state one block below a
    # junction; prefixkv applies the interval where its Mamba groups are EAGLE's only
    # (0, the engines' default, is taken dense; a positive one refused by name)
    from prefixkv.integrations.vllm import KVCacheManager, UnsupportedByPrefixKV

    c = _config(((16, None), (32, "mamba")), 40, 0, retention)
    kw = dict(max_model_len=8192, scheduler_block_size=32, hash_block_size=16, use_eagle=True)
    if retention:
        with pytest.raises(UnsupportedByPrefixKV, match="prefix_cache_retention_interval=32"):
            KVCacheManager(c, **kw)
        return
    m = KVCacheManager(c, **kw)
    assert m.retention_interval == 0 and [g.retention for g in m.core.groups] == [None, None]

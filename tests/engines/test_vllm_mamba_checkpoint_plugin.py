"""prefixkv's vLLM plug-in beside vLLM 0.33's own ``KVCacheManager`` with Mamba's chunk-end
checkpoint blocks (``num_prefill_checkpoint_blocks=1``, vLLM's fine-grained partial hits
on; integrations/vllm/checkpoints.py): test_vllm_mamba_sizes.py's random streams
(``Sides``: the same answers and returned blocks, tables, free count, hits with their
junctions, copies on write, and with events the same entries announced), each new
request carrying vLLM's junction as its scheduler sets it, chunks cut by vLLM's
scheduler with checkpoints on but without its stop at the junction (so that checkpoints
land there: test_vllm_mamba_checkpoints.py's ``CheckpointPair``). Also what the plug-in
refuses of checkpoint blocks, by name. Needs vllm installed."""

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

from .test_vllm_block_sizes_reference import _spec  # noqa: E402
from .test_vllm_fine_full import same_block_hashes  # noqa: E402
from .test_vllm_mamba_checkpoints import checkpoint_vllm, scheduler_chunk  # noqa: E402
from .test_vllm_mamba_sizes import OP, Sides  # noqa: E402
from .test_vllm_plugin import config  # noqa: E402
from .test_vllm_sized_model import MAX_LEN, PARTIAL, PROMPT  # noqa: E402


def _specs(groups: Any, align: int) -> list[Any]:
    return [replace(_spec(b, w), num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=align)
            if w == "mamba" else _spec(b, w) for b, w in groups]


def checkpoint_plugin(groups: Any, hash_size: int, num_blocks: int, align: int = 0, events: bool = False,
                      retention: int | None = None) -> Any:
    """prefixkv's plug-in over ``checkpoint_vllm``'s layout."""
    from prefixkv.integrations.vllm import KVCacheManager

    lcm = reduce(math.lcm, (b for b, _ in groups))
    return KVCacheManager(config(*_specs(groups, align or hash_size), num_blocks=num_blocks,
                                 prefix_cache_retention_interval=retention),
                          max_model_len=256, scheduler_block_size=lcm, hash_block_size=hash_size,
                          enable_kv_cache_events=events)


class CheckpointSides(Sides):
    def __init__(self, groups: Any, num_blocks: int, align: int, events: bool = False,
                 retention: int | None = None) -> None:
        super().__init__(groups, num_blocks, partial=True, events=events)
        self.align = align
        self.reserved = 0  # (checkpoints the views showed: same_views)
        self.refused: set[str] = set()  # (live requests whose last step was refused)
        self.ms = [checkpoint_vllm(groups, self.h, num_blocks, align, retention),
                   checkpoint_plugin(groups, self.h, num_blocks, align, events, retention)]
        take, allocate = self.ms[0].take_events, self.ms[0].allocate_slots
        self.ms[0].take_events = lambda: _net(take())

        def allocate_slots(request: Any, *args: Any, **kwargs: Any) -> Any:  # (refusals noted)
            out = allocate(request, *args, **kwargs)
            (self.refused.add if out is None else self.refused.discard)(request.request_id)
            return out

        self.ms[0].allocate_slots = allocate_slots

    def _chunk(self, start: int, n: int, total: int, prompt: int) -> int:
        # (as CheckpointPair's: a chunk starting inside a Mamba block ends at its end)
        n = max(1, scheduler_chunk(self.step, self.h, start, n, total, prompt, self.align))
        return min(n, self.step - start % self.step) if start % self.step else n


def _net(events: list[Any]) -> list[Any]:
    """vLLM's events less each key it stored and then removed in the same step: a
    transient checkpoint's block, cached under its whole-block key by the step's caching
    and evicted by the same call (``_cache_partial_tail_block``), which prefixkv never
    announces (docs/groups.md "Chunk-end checkpoints")."""
    from msgspec import structs
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    stored: dict[Any, list[tuple[int, int]]] = {}
    gone: set[tuple[int, int]] = set()  # (event, hash index) cancelled
    for i, e in enumerate(events):
        for k, h in enumerate(getattr(e, "block_hashes", [])):
            key = (getattr(e, "group_idx", None), h)
            if isinstance(e, BlockStored):
                stored.setdefault(key, []).append((i, k))
            elif isinstance(e, BlockRemoved) and stored.get(key):
                gone |= {stored[key].pop(), (i, k)}
    out = []
    for i, e in enumerate(events):
        if not isinstance(e, BlockStored | BlockRemoved):
            out.append(e)
            continue
        kept = [h for k, h in enumerate(e.block_hashes) if (i, k) not in gone]
        if kept:
            out.append(structs.replace(e, block_hashes=kept))
    return out


@pytest.mark.parametrize("small", [False, True])
@pytest.mark.parametrize("layout", list(PARTIAL))
@settings(max_examples=30, deadline=None)
@given(ops=st.lists(OP, min_size=4, max_size=30), probe=PROMPT, scale=st.sampled_from([1, 1, 2, 4]),
       events=st.booleans())
def test_the_plugin_checkpoints_as_vllms_manager(layout, small, ops, probe, scale, events):
    # (checkpoints aligned to the hash block or to ``scale`` of them; small: a pool a
    # little over one longest request: refusals and evictions; up to the first spare, as
    # test_vllm_mamba_sizes.py)
    _run(PARTIAL[layout], small, ops, probe, scale, events, None)


@pytest.mark.parametrize("small", [False, True])
@pytest.mark.parametrize("layout", list(PARTIAL))
@pytest.mark.parametrize("segments", [0, 2])
@settings(max_examples=20, deadline=None)
@given(ops=st.lists(OP, min_size=4, max_size=30), probe=PROMPT, scale=st.sampled_from([1, 2]),
       events=st.booleans())
def test_the_plugin_checkpoints_as_vllms_manager_under_retention(layout, segments, small, ops, probe, scale,
                                                                 events):
    # vLLM's prefix_cache_retention_interval: 0 (CacheConfig's default: a prompt's last
    # chunk checkpoints only, Mamba keeps the states at the marks) or 2 scheduler blocks
    groups = PARTIAL[layout]
    _run(groups, small, ops, probe, scale, events, segments * reduce(math.lcm, (b for b, _ in groups)))


def _run(groups: Any, small: bool, ops: Any, probe: list[int], scale: int, events: bool,
         retention: int | None) -> None:
    h = reduce(math.gcd, (b for b, _ in groups))
    sides = CheckpointSides(groups, sum(-(-MAX_LEN // b) for b, _ in groups) + 4 if small else 400,
                            scale * h, events, retention)
    drive(sides, groups, ops, probe, events)


def drive(sides: CheckpointSides, groups: Any, ops: Any, probe: list[int], events: bool,
          hashes: bool = False) -> None:
    """``ops`` on both ``sides``, compared after each (their events too, with
    ``events``; the live requests' blocks' hashes, with ``hashes``), up to the first spare."""
    for op, a, b in ops:
        sides.do(op, a, b)
        sides.compare(probe)
        same_views(sides)
        if hashes:
            same_block_hashes(sides)
        if any(sides.ms[1].core._index.twins):
            return
        if events:
            sides.same_events(groups)


def same_views(sides: CheckpointSides) -> None:
    """What vLLM's per-group managers show of the checkpoints, the same on both sides:
    ``cache_hit_alignment_tokens`` and a Mamba manager's ``_checkpoints`` (live request
    id -> the step's checkpoint position and table entry; read-only on prefixkv's). vLLM
    notes a step's checkpoint before it finds the step's blocks, and keeps the note of a
    refused step (a refused admission's too) until the request's next step or its end;
    prefixkv's view shows the checkpoints of steps that took their blocks, so the
    requests compared are the live ones whose last step was not refused."""
    views = [m.coordinator.single_type_managers for m in sides.ms]
    for theirs, ours in zip(*views, strict=True):
        assert theirs.cache_hit_alignment_tokens == ours.cache_hit_alignment_tokens
        mine = dict(ours._checkpoints)
        assert set(mine) <= set(sides.reqs[1])
        vllm = {rid: ck for rid, ck in getattr(theirs, "_checkpoints", {}).items()
                if rid in sides.reqs[0] and rid not in sides.refused}
        assert vllm == {rid: ck for rid, ck in mine.items() if rid not in sides.refused}
        sides.reserved += len(mine)


def test_checkpoint_blocks_are_refused_where_not_served():
    from prefixkv.integrations.vllm import UnsupportedByPrefixKV

    # without vLLM's partial hits (a Mamba block of the hash block's size) and not at one
    # size (full attention at 16; at one size they are served: test_vllm_one_size_checkpoints.py)
    with pytest.raises(UnsupportedByPrefixKV, match="num_prefill_checkpoint_blocks.*partial hits"):
        checkpoint_plugin(((16, None), (8, "mamba")), 8, 40)
    # different in two Mamba groups
    specs = _specs(((8, None), (16, "mamba")), 8) + [_spec(16, "mamba")]
    from prefixkv.integrations.vllm import KVCacheManager
    with pytest.raises(UnsupportedByPrefixKV, match="alike in every Mamba group"):
        KVCacheManager(config(*specs, num_blocks=40), max_model_len=256, scheduler_block_size=16,
                       hash_block_size=8)


def test_checkpoint_blocks_without_an_alignment_take_none():
    # (vLLM's is_mamba_prefill_checkpoint_valid is never true without one)
    from prefixkv.integrations.vllm import KVCacheManager

    specs = [_spec(8, None), replace(_spec(16, "mamba"), num_prefill_checkpoint_blocks=1)]
    m = KVCacheManager(config(*specs, num_blocks=40), max_model_len=256, scheduler_block_size=16,
                       hash_block_size=8)
    assert not m.core.sizes.checkpoints and m.core.sizes.partial


def test_a_hit_on_a_checkpoint_recorded_in_the_same_step_waits_as_in_vllm():
    # full8+mamba16: a's 30 tokens checkpoint at 24 (its prompt's last hash boundary,
    # inside a Mamba block): an entry of the prefix of 24, recorded in this step; b, in
    # the same step, hits it and waits for the next (vLLM's cached_blocks_this_step)
    from .test_vllm_block_sizes_reference import _request

    groups = ((8, None), (16, "mamba"))
    a, b = list(range(30)), list(range(24)) + [99] * 10
    for m in (checkpoint_vllm(groups, 8, 40), checkpoint_plugin(groups, 8, 40)):
        m.new_step_starts()
        r = _request("a", a, 8)
        assert m.allocate_slots(r, 30) is not None
        r = _request("b", b, 8)
        blocks, hit, _ = m.get_computed_blocks(r)
        assert hit == 24 and m.allocate_slots(r, 10, hit, blocks) is None, m
        m.new_step_starts()
        blocks, hit, _ = m.get_computed_blocks(r)
        assert hit == 24 and m.allocate_slots(r, 10, hit, blocks) is not None, m


@pytest.mark.parametrize("start,end", [(0, 30), (0, 16), (0, 40), (8, 40), (16, 50), (24, 30)])
def test_a_new_requests_block_count_is_vllms(start, end):
    # (the coordinator's get_num_blocks_to_allocate for a request without a hit: one
    # more Mamba block where its step checkpoints)
    groups = ((8, None), (16, "mamba"))
    got = []
    for m in (checkpoint_vllm(groups, 8, 40), checkpoint_plugin(groups, 8, 40)):
        got.append(m.coordinator.get_num_blocks_to_allocate(
            request_id="x", num_tokens=end, new_computed_blocks=([], []), num_encoder_tokens=0,
            total_computed_tokens=start, num_local_computed_tokens=start, num_tokens_main_model=end))
    assert got[0] == got[1]


@pytest.mark.parametrize("retention", [None, 0, 32])
@pytest.mark.parametrize("start,end", [(0, 30), (0, 40), (16, 50)])
def test_a_new_requests_block_count_beside_retention_is_vllms(retention, start, end):
    # (as above, vLLM's prefill_end 48 passed: under retention 0 a step ending below it
    # takes no checkpoint block; else vLLM's coordinator drops it)
    groups = ((8, None), (16, "mamba"))
    got = []
    for m in (checkpoint_vllm(groups, 8, 40, retention=retention),
              checkpoint_plugin(groups, 8, 40, retention=retention)):
        got.append(m.coordinator.get_num_blocks_to_allocate(
            request_id="x", num_tokens=end, new_computed_blocks=([], []), num_encoder_tokens=0,
            total_computed_tokens=start, num_local_computed_tokens=start, num_tokens_main_model=end,
            prefill_end=48))
    assert got[0] == got[1]


def test_a_checkpoint_at_the_junction_is_found_as_in_vllm():
    # full8+mamba16: a's 80 tokens leave Mamba states at 72 and 80 only; b shares its
    # first 56 tokens: hit 0, junction 56 (full attention's own hit). b's first chunk of
    # 60 checkpoints at 56: kept at the junction (else transient), found by c
    from .test_vllm_block_sizes_reference import _request

    groups = ((8, None), (16, "mamba"))
    a = list(range(1, 81))
    for m in (checkpoint_vllm(groups, 8, 60), checkpoint_plugin(groups, 8, 60)):
        m.new_step_starts()
        r = _request("a", a, 8)
        assert m.allocate_slots(r, 80) is not None
        m.free(r)
        m.new_step_starts()
        r = _request("b", a[:56] + [99] * 30, 8)
        blocks, hit, r.shared_prefix_boundary = m.get_computed_blocks(r)
        assert (hit, r.shared_prefix_boundary) == (0, 56)
        assert m.allocate_slots(r, 60, hit, blocks) is not None
        m.new_step_starts()
        assert m.get_computed_blocks(_request("c", a[:56] + [5] * 4, 8))[1] == 56, m


@pytest.mark.parametrize("num_blocks", [11, 12])
def test_a_running_requests_checkpoint_block_counts_as_in_vllm(num_blocks):
    # full8+mamba16: a's second chunk, 16 to 46, checkpoints at 40: 4 full-attention
    # blocks and 2 Mamba (its end's and the checkpoint's); 5 free (11 blocks: the null
    # one, pad's 2 and a's first 3 taken) is short on both, 6 is not
    assert _second_chunk_short(num_blocks, 46, 30, None) == [num_blocks == 11] * 2


def _second_chunk_short(num_blocks: int, prompt: int, n: int, retention: int | None) -> list[bool]:
    """On full8+mamba16 of ``num_blocks`` blocks (vLLM's manager, prefixkv's), a pad of 8
    tokens, then a prompt of ``prompt``'s first chunk of 16: whether its second, of
    ``n``, is refused."""
    from .test_vllm_block_sizes_reference import _request

    groups = ((8, None), (16, "mamba"))
    got = []
    for m in (checkpoint_vllm(groups, 8, num_blocks, retention=retention),
              checkpoint_plugin(groups, 8, num_blocks, retention=retention)):
        assert m.allocate_slots(_request("pad", list(range(100, 108)), 8), 8) is not None
        r = _request("a", list(range(prompt)), 8)
        assert m.allocate_slots(r, 16) is not None
        r.num_computed_tokens = 16
        m.new_step_starts()
        got.append(m.allocate_slots(r, n) is None)
    return got


@pytest.mark.parametrize("retention", [None, 0])
def test_a_running_requests_chunk_below_prefill_end_counts_as_in_vllm(retention):
    # full8+mamba16, 11 blocks: a's second chunk, 16 to 48, of a 60-token prompt would
    # checkpoint at 40 (dense retention: 4 full-attention blocks and 2 Mamba, one short of
    # the 5 free); under retention 0 it ends below vLLM's prefill_end (60): no
    # checkpoint, 5 blocks, it fits
    assert _second_chunk_short(11, 60, 32, retention) == [retention is None] * 2


def test_a_state_sparse_retention_leaves_uncached_defers_no_hit():
    # full8+mamba16, retention 0: b (90 tokens) computes 16 to 48 in the step c is
    # admitted in; b's state at 48 is not at its marks (89 -> 88: the block ending at
    # 64), so vLLM caches and notes none there. c hits a's state at 48 (a's prompt's
    # checkpoint, cached a step before) and is not deferred
    from .test_vllm_block_sizes_reference import _request

    groups = ((8, None), (16, "mamba"))
    stem = list(range(1, 49))
    got = []
    for m in (checkpoint_vllm(groups, 8, 60, retention=0), checkpoint_plugin(groups, 8, 60, retention=0)):
        m.new_step_starts()
        b = _request("b", stem + [7] * 42, 8)
        assert m.allocate_slots(b, 16) is not None
        b.num_computed_tokens = 16
        m.new_step_starts()
        a = _request("a", stem + [5], 8)
        assert m.allocate_slots(a, 49) is not None
        m.new_step_starts()
        assert m.allocate_slots(b, 32) is not None
        c = _request("c", stem + [9] * 5, 8)
        blocks, hit, _ = m.get_computed_blocks(c)
        got.append((hit, m.allocate_slots(c, 5, hit, blocks) is None))
    assert got == [(48, False)] * 2

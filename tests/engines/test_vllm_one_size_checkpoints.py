"""Mamba's chunk-end checkpoint blocks (``num_prefill_checkpoint_blocks=1``) where every
group, the hash block and the scheduler's block are of ONE size (vLLM's fine-grained
partial hits off: a Mamba block of the hash block's size; integrations/vllm/
checkpoints.py): prefixkv's plug-in beside vLLM 0.33's own ``KVCacheManager`` on random
streams (test_vllm_mamba_checkpoint_plugin.py's ``CheckpointSides``: the same answers
and returned blocks, tables, free count, hits with their junctions, after every call),
under each ``prefix_cache_retention_interval``, chunks cut by vLLM's scheduler with
partial hits off. A checkpoint there always ends its block (``c = (e - 1) // b * b``,
entry ``cdiv(e, b) - 2``), so the state served is the state after exactly the block's
tokens. Needs vllm installed."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")

from .test_vllm_block_sizes_reference import _request  # noqa: E402
from .test_vllm_mamba_checkpoint_plugin import CheckpointSides, drive  # noqa: E402
from .test_vllm_mamba_sizes import OP  # noqa: E402
from .test_vllm_sized_model import MAX_LEN, PROMPT  # noqa: E402

ONE_SIZE = {
    "full8+mamba8": ((8, None), (8, "mamba")),
    "mamba8+full8": ((8, "mamba"), (8, None)),
    "full8+mamba8+mamba8": ((8, None), (8, "mamba"), (8, "mamba")),
}


class OneSizeSides(CheckpointSides):
    """``CheckpointSides`` at one size: chunks as vLLM's scheduler cuts them with
    checkpoint blocks on and partial hits off (its ``_mamba_block_aligned_split``)."""

    def _chunk(self, start: int, n: int, total: int, prompt: int) -> int:
        from vllm.v1.core.sched.scheduler import Scheduler

        sched = SimpleNamespace(
            cache_config=SimpleNamespace(block_size=self.step), block_size=self.step, hash_block_size=self.h,
            mamba_partial_cache_hit=False, use_eagle_block_drop=False, num_hash_lookahead_tokens=0,
            mamba_has_prefill_checkpoint_blocks=True, mamba_prefill_checkpoint_alignment=self.align,
            mamba_shared_prefix_checkpoint=False, max_num_scheduled_tokens=8192,
            scheduler_config=SimpleNamespace(long_prefill_token_threshold=0))
        req = SimpleNamespace(num_computed_tokens=start, num_prompt_tokens=prompt, num_tokens=total,
                              shared_prefix_boundary=0)
        return max(1, Scheduler._mamba_block_aligned_split(sched, req, n))  # type: ignore[arg-type]


def _run(groups: Any, small: bool, ops: Any, probe: list[int], align: int, retention: int | None,
         events: bool = False) -> OneSizeSides:
    sides = OneSizeSides(groups, len(groups) * -(-MAX_LEN // 8) + 4 if small else 400, align, events,
                         retention)
    assert not sides.ms[0].coordinator.enable_partial_hash_hits and sides.ms[1].core.sizes.checkpoints
    drive(sides, groups, ops, probe, events, hashes=True)  # (Mamba's blocks read vLLM's hashes)
    return sides


@pytest.mark.parametrize("small", [False, True])
@pytest.mark.parametrize("layout", list(ONE_SIZE))
@pytest.mark.parametrize("retention", [None, 0, 16])
@settings(max_examples=30, deadline=None)
@given(ops=st.lists(OP, min_size=4, max_size=30), probe=PROMPT, align=st.sampled_from([8, 4, 16]),
       events=st.booleans())
def test_the_plugin_checkpoints_at_one_size_as_vllms_manager(layout, small, retention, ops, probe, align,
                                                             events):
    # (checkpoints aligned to the block, half of it, or two; small: a pool a little over
    # one longest request per group: refusals and evictions; up to the first spare)
    _run(ONE_SIZE[layout], small, ops, probe, align, retention, events)


@pytest.mark.parametrize(("retention", "tables", "states", "hits"), [
    # a prompt of 60 cut 40 + 20: the first chunk checkpoints at 32 into entry 3 (block
    # 6, the state at its end), its own end at 40 in entry 4, but for retention 0 (below
    # vLLM's prefill_end: no checkpoint); the second chunk at 56 into entry 6 (the
    # prompt's replay boundary, 59 -> 56), its end at 60 in entry 7. Kept: retention 0
    # the state at 56 only, 16 those at each 16 tokens too, None all; entry 3 released
    # (cached). Hits of a[:40] + [x], a[:33] + [x] and a + [x] on both sides
    (None, ([1, 2, 3, 4, 5, 8, 9, 10], [0, 0, 0, 0, 7, 0, 11, 12]), {(6, 32), (7, 40), (11, 56)},
     [40, 32, 56]),
    (0, ([1, 2, 3, 4, 5, 7, 8, 9], [0, 0, 0, 0, 6, 0, 10, 11]), {(10, 56)}, [0, 0, 56]),
    (16, ([1, 2, 3, 4, 5, 8, 9, 10], [0, 0, 0, 0, 7, 0, 11, 12]), {(6, 32), (11, 56)}, [32, 32, 56]),
])
def test_a_prompts_chunks_checkpoint_and_cache_as_vllms(retention, tables, states, hits):
    sides = OneSizeSides(ONE_SIZE["full8+mamba8"], 40, 8, retention=retention)
    a = list(range(60))
    offers, views = [], []
    for op, n in [("add", a), ("extend", 0)]:
        sides.do(op, n, 40 if op == "add" else 20)
        sides.compare(a)
        got = [{r: sorted(pos for _, _, pos in x) for r, x in m.take_boundary_state_offloads().items()}
               for m in sides.ms]
        assert got[0] == got[1]  # (the states offered to a connector, as vLLM's)
        offers.append(got[0].get("r1", []))
        views.append(dict(sides.ms[1].coordinator.single_type_managers[1]._checkpoints))
    assert offers[1] == [56]
    # (the Mamba manager's view of the step's checkpoint (c, j), vLLM's: same_views)
    assert views == [{} if retention == 0 else {"r1": (32, 3)}, {"r1": (56, 6)}]
    assert [v.cache_hit_alignment_tokens for v in sides.ms[1].coordinator.single_type_managers] == [8, 8]
    with pytest.raises(TypeError):  # (read-only)
        sides.ms[1].coordinator.single_type_managers[1]._checkpoints["r1"] = (0, 0)  # type: ignore[index]
    for m in sides.ms:
        assert tuple(list(g) for g in m.get_block_ids("r1")) == tables
    for r in sides.reqs[1].values():  # (as if built with the plug-in's block hasher)
        sides.ms[1].prepared_prompts.note(r)
    for m in sides.ms:  # (vLLM's Mamba states, and the hashes the plug-in's block objects read)
        assert {(b.block_id, b.block_hash_num_tokens) for b in m.block_pool.blocks
                if b.block_hash is not None and b.block_id not in tables[0]} == states
    for tokens, hit in zip([a[:40], a[:33], a], hits, strict=True):
        probe = _request(f"p{len(tokens)}", tokens + [99], 8)
        assert [m.get_computed_blocks(probe)[1] for m in sides.ms] == [hit, hit]


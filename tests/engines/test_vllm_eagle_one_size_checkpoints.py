"""EAGLE (``use_eagle``) beside Mamba's chunk-end checkpoint blocks where every group,
the hash block and the scheduler's block are of ONE size (``BlockSizes.eagle`` without
``partial``; groups/checkpoints.py ``_kept``): a step ending at ``e`` checkpoints at
vLLM's ``c = e // b * b - b`` into entry ``j = cdiv(e, b) - 2``; when ``e`` ends inside
a block, ``c == j * b`` is the state ending entry ``j - 1``, kept in block ``j`` under
entry ``j - 1``'s key (vLLM's ``cache_partial_block(replace_existing_hashes=True)``).
Random side-by-side streams against vLLM 0.33's own ``KVCacheManager`` (hits, tables,
free counts after every call; the states offered to a connector; every hit's blocks
holding what the request's tokens computed: ``check_holds``), chunks cut by vLLM's own
scheduler, under each retention interval; and vLLM's row shape with exact values.
Needs vllm installed."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")

from .test_vllm_block_sizes_reference import _request  # noqa: E402
from .test_vllm_eagle_mamba import _noting_copies  # noqa: E402
from .test_vllm_eagle_mamba_checkpoints import CheckpointEagleSides  # noqa: E402
from .test_vllm_eagle_retention import _config, checked  # noqa: E402
from .test_vllm_mamba_sizes import OP  # noqa: E402
from .test_vllm_one_size_checkpoints import ONE_SIZE  # noqa: E402
from .test_vllm_sized_model import MAX_LEN, PROMPT  # noqa: E402


class OneSizeEagleSides(CheckpointEagleSides):
    """``CheckpointEagleSides`` at one size: chunks as vLLM's scheduler cuts them with
    EAGLE's block drop, checkpoint blocks on and partial hits off."""

    def _chunk(self, start: int, n: int, total: int, prompt: int) -> int:
        from vllm.v1.core.sched.scheduler import Scheduler

        sched = SimpleNamespace(
            cache_config=SimpleNamespace(block_size=self.step), block_size=self.step, hash_block_size=self.h,
            mamba_partial_cache_hit=False, use_eagle=True, use_eagle_block_drop=True,
            num_hash_lookahead_tokens=0, mamba_has_prefill_checkpoint_blocks=True,
            mamba_prefill_checkpoint_alignment=self.align, mamba_shared_prefix_checkpoint=False,
            max_num_scheduled_tokens=8192, scheduler_config=SimpleNamespace(long_prefill_token_threshold=0))
        req = SimpleNamespace(num_computed_tokens=start, num_prompt_tokens=prompt, num_tokens=total,
                              shared_prefix_boundary=0)
        got = max(1, Scheduler._mamba_block_aligned_split(sched, req, n))  # type: ignore[arg-type]
        self.last = (self.last[0], (start, start + got))
        return int(got)


def sides(layout: str, small: bool, flag: int | None, retention: int | None,
          align: int = 8) -> OneSizeEagleSides:
    """Both managers over ``ONE_SIZE[layout]`` with EAGLE, one checkpoint block per Mamba
    group aligned to ``align`` tokens and the interval (a pool a little over one longest
    request when ``small``)."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager
    from vllm.v1.core.kv_cache_utils import init_none_hash

    from prefixkv.integrations.vllm import KVCacheManager

    groups = ONE_SIZE[layout]
    num_blocks = len(groups) * -(-MAX_LEN // 8) + 5 if small else 400
    s = OneSizeEagleSides(groups, num_blocks, partial=False)
    s.align = align
    s.groups, s.written, s.copied, s.checked = groups, {}, [], 0  # (check_holds)
    init_none_hash(sha256)
    c = _config(groups, num_blocks, flag, retention, align)
    s.ms = [make(c, max_model_len=256, scheduler_block_size=s.lcm, hash_block_size=s.h, use_eagle=True)
            for make in (VllmManager, KVCacheManager)]
    core = s.ms[1].core
    assert core.sizes.eagle and core.sizes.checkpoints and not core.sizes.partial
    _noting_copies(s)
    return s


def _mamba_flag(layout: str) -> int:
    return next(g for g, (_, w) in enumerate(ONE_SIZE[layout]) if w == "mamba")


@pytest.mark.parametrize(("small", "flag"), [(False, "none"), (True, "mamba")])
@pytest.mark.parametrize("retention", [None, 0, 16])
@pytest.mark.parametrize("layout", list(ONE_SIZE))
@settings(max_examples=25, deadline=None)
@given(ops=st.lists(OP, min_size=4, max_size=30), probe=PROMPT, align=st.sampled_from([8, 4, 16]))
def test_the_plugin_checkpoints_beside_eagle_at_one_size_as_vllms(layout, retention, small, flag, ops,
                                                                  probe, align):
    # (checkpoints aligned to the block, half of it, or two)
    s = sides(layout, small, None if flag == "none" else _mamba_flag(layout), retention, align)
    s.drive(ops, probe, lambda s: checked(s, probe))


@pytest.mark.parametrize(("retention", "offers", "hits"), [
    # vLLM's row shape at 8: a prompt of 60 cut 32 + 28 (vLLM's scheduler ends a chunk
    # but the last on a block). The first step checkpoints at 32 // 8 * 8 - 8 = 24 into
    # entry 2, ending it (the state at its end), its own end 32 in entry 3; the second at
    # 60 // 8 * 8 - 8 = 48 into entry 6: the state ending entry 5, kept in block 6 under
    # entry 5's key (the prompt's checkpoint, EAGLE's replay boundary: at every interval).
    # Offered per step; hits of a[:k] + [x] for k 20, 30, 52, 60 (EAGLE drops a block).
    (None, ([24, 32], [48]), [0, 0, 32, 48]),
    (0, ([], [48]), [0, 0, 0, 48]),
    (16, ([32], [48]), [0, 0, 32, 48]),
])
def test_a_prompts_eagle_checkpoints_at_one_size_as_vllms(retention, offers, hits):
    s = sides("full8+mamba8", False, None, retention)
    a = list(range(60))
    got = []
    for m in s.ms:
        r = _request("p", a, 8)
        blocks, hit = m.get_computed_blocks(r)[:2]
        assert m.allocate_slots(r, 32, hit, blocks) is not None
        r.num_computed_tokens = 32
        first = sorted(p for _, _, p in m.take_boundary_state_offloads().get("p", []))
        m.new_step_starts()
        assert m.allocate_slots(r, 28) is not None
        r.num_computed_tokens = 60
        second = sorted(p for _, _, p in m.take_boundary_state_offloads().get("p", []))
        m.free(r)
        m.new_step_starts()
        got.append(((first, second), [m.get_computed_blocks(_request(f"q{k}", a[:k] + [999], 8))[1]
                                      for k in (20, 30, 52, 60)]))
    assert got[0] == got[1] == (offers, hits)

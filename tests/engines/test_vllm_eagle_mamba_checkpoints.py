"""test_vllm_eagle_mamba.py's side-by-side runs with one checkpoint block per Mamba group
(vLLM's ``num_prefill_checkpoint_blocks=1``) beside EAGLE: with EAGLE a step's checkpoint
sits one hash block below its end's last hash boundary, recorded as an entry at the
prompt's replay boundary (``BlockSizes.replay_at``); chunks cut by vLLM's own scheduler.
Needs vllm installed."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")

from .test_vllm_block_sizes_reference import _spec  # noqa: E402
from .test_vllm_eagle_mamba import EagleSides, _noting_copies, check_holds  # noqa: E402
from .test_vllm_mamba_sizes import OP  # noqa: E402
from .test_vllm_plugin import config  # noqa: E402
from .test_vllm_sized_model import PARTIAL, PROMPT  # noqa: E402
from .vllm_split import vllm_mamba_chunk  # noqa: E402


def eagle_checkpoint_chunk(step: int, h: int, start: int, n: int, total: int, prompt: int) -> int:
    """``n`` tokens from ``start`` as vLLM's own scheduler cuts them with EAGLE and one
    checkpoint block per Mamba group (``Scheduler._mamba_block_aligned_split`` on these
    settings, the junction 0), but a chunk starting inside a Mamba block ends at its end
    (test_vllm_mamba_checkpoints.py's ``CheckpointPair._chunk``: vLLM then caches that
    block as the state at its end, which prefixkv never does)."""
    return vllm_mamba_chunk(step, h, start, n, total, prompt, eagle=True, align=h)


class CheckpointEagleSides(EagleSides):
    """``EagleSides`` with one checkpoint block per Mamba group, chunks cut by vLLM's
    scheduler (``eagle_checkpoint_chunk``); ``last``: the request the op stepped and
    its step's start and end (None: no step), for ``_write_checkpoint``."""

    last: Any = None

    def do(self, op: str, a: Any, b: Any) -> None:
        live = sorted(self.reqs[0])
        rid = f"r{self.serial + 1}" if op == "add" else live[a % len(live)] if live else None
        self.last = (rid, None)
        super().do(op, a, b)

    def _chunk(self, start: int, n: int, total: int, prompt: int) -> int:
        got = eagle_checkpoint_chunk(self.step, self.h, start, n, total, prompt)
        self.last = (self.last[0], (start, start + got))
        return got

    def write_checkpoint(self) -> None:
        """For ``check_holds``' model: ``_write_checkpoint``."""
        _write_checkpoint(self)


def _write_checkpoint(s: Any) -> None:
    """The step ``s.last`` names wrote, in each Mamba group, the state at its checkpoint
    into its checkpoint block (vLLM's rule, with EAGLE: ``c = e // h * h - h`` for a step
    from ``st`` to ``e``, in entry ``j = cdiv(e, b) - 2``, when ``st`` is a multiple of
    ``h``, ``st + h <= c < e``, ``j`` past the entry of the step's initial state; the
    alignment, the hash block)."""
    rid, step = s.last if s.last is not None else (None, None)
    r = s.reqs[1].get(rid) if step is not None else None
    if r is None or r.num_computed_tokens != step[1]:
        return
    (st, e), h, tokens = step, s.h, tuple(r.all_token_ids)
    c = e // h * h - h
    for g, ids in enumerate(s.ms[1].get_block_ids(rid)):
        b = s.groups[g][0]
        j = -(-e // b) - 2
        if s.groups[g][1] == "mamba" and not st % h and st + h <= c < e and j > (st - 1) // b \
                and 0 <= j < len(ids) and ids[j]:
            s.written[ids[j]] = tokens[:c]


@pytest.mark.parametrize("flag", [None, 0])
@pytest.mark.parametrize("layout", list(PARTIAL))
@settings(max_examples=30, deadline=None)
@given(ops=st.lists(OP, min_size=4, max_size=30), probe=PROMPT)
def test_the_plugin_gives_vllms_eagle_hits_beside_mamba_checkpoint_blocks(layout, flag, ops, probe):
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager
    from vllm.v1.core.kv_cache_utils import init_none_hash

    from prefixkv.integrations.vllm import KVCacheManager

    groups = PARTIAL[layout]
    s = CheckpointEagleSides(groups, 400, partial=True)
    s.groups, s.written, s.copied, s.checked = groups, {}, [], 0  # (check_holds)
    c = config(*(replace(_spec(b, w), num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=s.h)
                 if w == "mamba" else _spec(b, w) for b, w in groups), num_blocks=400)
    if flag is not None:
        kv = list(c.kv_cache_groups)
        kv[flag] = replace(kv[flag], is_eagle_group=True)
        c = replace(c, kv_cache_groups=kv)
    init_none_hash(sha256)
    s.ms = [make(c, max_model_len=256, scheduler_block_size=s.lcm, hash_block_size=s.h, use_eagle=True)
            for make in (VllmManager, KVCacheManager)]
    _noting_copies(s)
    s.drive(ops, probe, lambda s: check_holds(s, probe))

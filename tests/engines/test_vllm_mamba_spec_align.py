"""prefixkv's vLLM plug-in beside vLLM 0.33's own ``KVCacheManager`` with Mamba's speculative
state blocks in ``mamba_cache_mode="align"`` (``num_speculative_blocks``: a Mamba group
with blocks ahead, groups/spec_states.py): test_vllm_mamba_sizes.py's random streams
(``Sides``: the same answers and returned blocks, tables, free count, hits with their
junctions, copies on write) and test_vllm_mamba_checkpoint_plugin.py's (chunk-end
checkpoint blocks too, with the views of the Mamba manager), every Mamba spec carrying
speculative blocks. After each call: ``check_invariants`` (a block ahead is never
cached: no hash, no event, no hit lands on it before it became a state block), vLLM's
blocks ahead unhashed too, and each Mamba row ending with them. A scenario with exact
ids shows vLLM's move of the blocks ahead over a long chunk. Needs vllm installed."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
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

from . import test_vllm_block_sizes_reference as reference  # noqa: E402
from . import test_vllm_eagle_mamba as eagle  # noqa: E402
from . import test_vllm_mamba_checkpoint_plugin as checkpoint_plugin  # noqa: E402
from . import test_vllm_mamba_checkpoints as checkpoint_pair  # noqa: E402
from .test_vllm_block_sizes_reference import MAMBA_LAYOUTS, _request  # noqa: E402
from .test_vllm_mamba_sizes import OP, Sides  # noqa: E402
from .test_vllm_sized_model import MAX_LEN, PARTIAL, PROMPT  # noqa: E402

_MODULES = (reference, checkpoint_plugin, checkpoint_pair, eagle)  # (those whose ``_spec`` builds the specs)


@contextmanager
def speculative(n: int, *more: Any) -> Iterator[None]:
    """Every Mamba spec the helpers build (and the ``more`` modules that import ``_spec``
    by name) carries ``num_speculative_blocks=n``."""
    plain = reference._spec

    def spec(block_size: int, window: Any, retained: int = 0) -> Any:
        got = plain(block_size, window, retained)
        return replace(got, num_speculative_blocks=n) if window == "mamba" else got

    for module in _MODULES + more:
        module._spec = spec  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for module in _MODULES + more:
            module._spec = plain  # type: ignore[attr-defined]


def blocks_ahead_sound(sides: Sides) -> None:
    """Each live request's Mamba rows end with ``S`` blocks ahead on both sides, vLLM's
    unhashed (it asserts so before moving them), and prefixkv's invariants hold (its
    own check: none is cached)."""
    vllm, ours = sides.ms
    ours.core.check_invariants()
    for g, group in enumerate(vllm.coordinator.single_type_managers):
        ahead = getattr(group, "num_speculative_blocks", 0)
        if not ahead or group.mamba_cache_mode != "align":
            continue
        for rid, blocks in group.req_to_blocks.items():
            if rid not in sides.reqs[0]:
                continue
            tail = blocks[len(blocks) - ahead:]
            assert all(not b.is_null and b.block_hash is None for b in tail), (rid, g, blocks)


def _usable(groups: Any, small: bool, ahead: int, spare: int = 3) -> int:
    return sum(-(-MAX_LEN // b) + (ahead if w == "mamba" else 0) for b, w in groups) + spare if small else 400


@pytest.mark.parametrize("ahead", [1, 3])
@pytest.mark.parametrize("small", [False, True])
@pytest.mark.parametrize("layout", list(MAMBA_LAYOUTS) + [f"partial hits: {k}" for k in PARTIAL])
@settings(max_examples=25, deadline=None)
@given(ops=st.lists(OP, min_size=4, max_size=30), probe=PROMPT)
def test_speculative_blocks_in_align_mode_as_vllms_manager(layout, small, ahead, ops, probe):
    # (small: a pool a little over one longest request: refusals and evictions;
    # "partial hits": vLLM's fine-grained partial hits on, copies on write compared)
    partial = layout.startswith("partial hits: ")
    groups = PARTIAL[layout[len("partial hits: "):]] if partial else MAMBA_LAYOUTS[layout]
    with speculative(ahead):
        sides = Sides(groups, _usable(groups, small, ahead), partial=partial)
    sides.drive(ops, probe, each=blocks_ahead_sound)


@pytest.mark.parametrize("ahead", [1, 3])
@pytest.mark.parametrize("small", [False, True])
@pytest.mark.parametrize("layout", list(PARTIAL))
@pytest.mark.parametrize("retention", [None, 0])
@settings(max_examples=25, deadline=None)
@given(ops=st.lists(OP, min_size=4, max_size=30), probe=PROMPT, scale=st.sampled_from([1, 2]))
def test_speculative_blocks_beside_checkpoints_as_vllms_manager(layout, small, ahead, retention, ops, probe,
                                                               scale):
    # (chunk-end checkpoint blocks, aligned to ``scale`` hash blocks; a checkpoint may
    # land on a block ahead, which then stays where it is: vLLM's rule)
    groups = PARTIAL[layout]
    h = reduce(math.gcd, (b for b, _ in groups))
    with speculative(ahead):
        sides = checkpoint_plugin.CheckpointSides(groups, _usable(groups, small, ahead, 4), scale * h,
                                                  retention=retention)
    for op, a, b in ops:
        sides.do(op, a, b)
        sides.compare(probe)
        checkpoint_plugin.same_views(sides)
        blocks_ahead_sound(sides)
        if any(sides.ms[1].core._index.twins):
            return


@pytest.mark.parametrize("ahead", [1, 3])
@pytest.mark.parametrize("small", [False, True])
@pytest.mark.parametrize("layout", list(eagle.LAYOUTS))
@settings(max_examples=25, deadline=None)
@given(ops=st.lists(OP, min_size=4, max_size=30), probe=PROMPT)
def test_speculative_blocks_beside_eagle_as_vllms_manager(layout, small, ahead, ops, probe):
    # (vLLM's EAGLE, use_eagle, beside Mamba: its hits one block shorter, chunks cut as
    # its scheduler cuts them; the blocks each hit hands hold its prefix: check_holds)
    groups, h = eagle.LAYOUTS[layout]
    with speculative(ahead):
        sides = eagle.sides(groups, _usable(groups, small, ahead), None, hash_size=h)
    sides.drive(ops, probe, lambda s: (eagle.check_holds(s, probe), blocks_ahead_sound(s)))


def test_a_long_chunk_moves_the_blocks_ahead_as_vllm():
    # full attention at 4 beside Mamba at 4 with 2 speculative blocks: 40 tokens in
    # chunks of 4, 4 and 32, then decodes; the third chunk jumps 8 entries: the two
    # blocks ahead (4, 6) move to the row's end, one fresh block (15) after them
    with speculative(2):
        sides = Sides(((4, None), (4, "mamba")))
    rows: list[list[Any]] = [[], []]
    for m, got in zip(sides.ms, rows, strict=True):
        r = _request("a", list(range(40)), 4)
        # (a new request of 4 tokens: full attention's block, Mamba's state and 2 ahead)
        assert m.coordinator.get_num_blocks_to_allocate("a", 4, ([], []), 0, 0, 0, 4) == 4
        for n in (4, 4, 32, 1, 1, 1, 1, 1):
            m.new_step_starts()
            if r.num_computed_tokens >= len(r.all_token_ids):
                r.append_output_token_ids([7])
            assert m.allocate_slots(r, n) is not None
            r.num_computed_tokens += n
            got.append(list(m.get_block_ids("a")[1]))
    assert rows[0] == rows[1]
    assert rows[1][:5] == [
        [2, 3, 4],
        [2, 3, 4, 6],
        [0, 3, 0, 0, 0, 0, 0, 0, 0, 4, 6, 15],
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 6, 15, 17],
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 6, 15, 17],
    ]

"""The blocks vLLM's worker zeroes (integrations/vllm/zeroing.py), id for id beside vLLM
0.33's own manager on small scripted steps (the random reference streams compare how
many only): admission, a hit's admission, growth, a connector's load and
``record_blocks_for_zeroing``."""

from __future__ import annotations

from typing import Any

import pytest

from . import skip_module_without_vllm

skip_module_without_vllm()

from .test_vllm_hybrid_reference import _bf16_window, _hybrid_pair, _mamba, _replayed  # noqa: E402
from .test_vllm_plugin import full  # noqa: E402
from .test_vllm_reference import BS, _request  # noqa: E402

LAYOUTS = {
    "full+bf16window6": lambda: (full(BS), _bf16_window(6)),
    "bf16window6+full": lambda: (_bf16_window(6), full(BS)),
    "full+mamba": lambda: (full(BS), _mamba()),
    "replayed5+full+bf16window6": lambda: (_replayed(5), full(BS), _bf16_window(6)),
}


def _steps(m: Any, skip: tuple[int, ...], load: int) -> list[Any]:
    """What each step gives to zero, each id as the (request, group, table index) it
    holds: vLLM takes a load's blocks in another order, so the ids differ there."""
    from vllm.v1.request import RequestStatus

    out = []
    a = _request("a", list(range(11)), None)
    assert m.allocate_slots(a, 11) is not None
    out.append(_where(m, m.take_new_block_ids()))
    a.status, a.num_computed_tokens = RequestStatus.RUNNING, 11
    a.append_output_token_ids(99)
    assert m.allocate_slots(a, 1) is not None
    out.append(_where(m, m.take_new_block_ids()))
    a.num_computed_tokens = 12
    b = _request("b", list(range(10)) + [50, 51, 52, 53, 54], None)
    blocks, hit = m.get_computed_blocks(b)[:2]
    out.append(hit)
    assert m.allocate_slots(b, 15 - hit, hit, blocks) is not None
    out.append(_where(m, m.take_new_block_ids()))
    c = _request("c", [70 + i for i in range(13)], None)
    blocks, hit = m.get_computed_blocks(c)[:2]
    assert m.allocate_slots(c, 13 - load, hit, blocks, num_external_computed_tokens=load,
                            skip_zeroing_group_ids=skip) is not None
    out.append(_where(m, m.take_new_block_ids()))
    m.record_blocks_for_zeroing("c", 4)  # (a failed load: zeroed again from 4 on)
    out.append(_where(m, m.take_new_block_ids()))
    m.record_blocks_for_zeroing("b", 8)
    out.append(_where(m, m.take_new_block_ids()))
    return out


def _where(m: Any, ids: list[int]) -> list[tuple[str, int, int]]:
    at = {i: (rid, g, j) for rid in ("a", "b", "c") if m.get_block_ids(rid)
          for g, row in enumerate(m.get_block_ids(rid)) for j, i in enumerate(row)}
    return sorted(at.get(i, ("?", i, -1)) for i in ids)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("skip", [(), (0,), (1,)])
def test_the_blocks_to_zero_are_vllms_id_for_id(layout, skip):
    load = 0 if "mamba" in layout else 9  # (no connector load beside Mamba: refused)
    ours, theirs = (_steps(m, skip, load) for m in _hybrid_pair(40, *LAYOUTS[layout]()))
    assert ours == theirs


@pytest.mark.parametrize("layout", ["full+window6", "full+bf16window6"])
def test_zeroing_again_where_nothing_is_zeroed_or_held_is_a_no_op(layout):
    # a layout whose blocks vLLM never zeroes, and a request holding no blocks
    from .test_vllm_hybrid_reference import _window

    specs = (full(BS), _window(6)) if layout == "full+window6" else LAYOUTS[layout]()
    for m in _hybrid_pair(40, *specs):
        a = _request("a", list(range(9)), None)
        assert m.allocate_slots(a, 9) is not None
        m.take_new_block_ids()
        m.record_blocks_for_zeroing("a" if layout == "full+window6" else "gone", 0)
        assert m.take_new_block_ids() == []

"""vLLM 0.33's ``KVCacheManager.create_kv_cache_blocks`` (a result of the blocks given, one
list per group; the shared empty one when all are empty) and ``truncate_computed_blocks``
(a hit cut at a token count: a Mamba group may hold fewer blocks, every other group must
reach it; an assert otherwise), on prefixkv's plug-in and vLLM's own manager side by
side: the same blocks, the same ids, the same refusals (prefixkv's ``TruncationError``
is a RequestError and the AssertionError vLLM raises). Needs vllm installed."""

from __future__ import annotations

import os
from typing import Any

import pytest

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")

from .test_vllm_hybrid_reference import _mamba, _window  # noqa: E402
from .test_vllm_plugin import full  # noqa: E402
from .test_vllm_reference import BS, _managers, _request  # noqa: E402

LAYOUTS = {"full": (full(BS),), "full and window": (full(BS), _window(2 * BS)),
           "full and Mamba": (full(BS), _mamba())}


def _hit(m: Any, tokens: list[int]) -> Any:
    """A producer computes ``tokens`` and goes; a consumer of them and one more token
    looks its hit up (nothing taken)."""
    p = _request("p", tokens, None)
    blocks, hit, _ = m.get_computed_blocks(p)
    assert m.allocate_slots(p, len(tokens) - hit, hit, blocks) is not None
    p.num_computed_tokens = len(tokens)
    m.cache_blocks(p, len(tokens))
    m.free(p)
    m.new_step_starts()
    blocks, hit, _ = m.get_computed_blocks(_request("c", [*tokens, 99], None))
    return blocks, hit


def _ids(blocks: Any) -> list[list[int]]:
    return [[b.block_id for b in g] for g in blocks.blocks]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_results_built_and_cut_are_vllms(layout):
    sides = [s.m for s in _managers(24, LAYOUTS[layout])]
    seen = []
    for m in sides:
        blocks, hit = _hit(m, list(range(3 * BS)))
        n = len(m.kv_cache_config.kv_cache_groups)
        assert m.create_kv_cache_blocks(((),) * n) is m.empty_kv_cache_blocks
        made = m.create_kv_cache_blocks(tuple(list(g) for g in blocks.blocks))
        assert _ids(made) == _ids(blocks) and made is not blocks
        cuts = {}
        for tokens in range(0, hit + 2 * BS + 1, 2):
            try:
                cuts[tokens] = _ids(m.truncate_computed_blocks(blocks, tokens))
            except AssertionError:
                cuts[tokens] = "refused"
        short = m.create_kv_cache_blocks((list(blocks.blocks[0]),) + ([],) * (n - 1))
        try:
            short_cut: Any = _ids(m.truncate_computed_blocks(short, BS))
        except AssertionError:
            short_cut = "refused"
        seen.append((_ids(blocks), hit, cuts, short_cut))
        assert _ids(blocks) == _ids(m.create_kv_cache_blocks(tuple(list(g) for g in blocks.blocks)))
    assert seen[0] == seen[1]
    ids, hit, cuts, short_cut = seen[0]
    assert hit == 3 * BS and cuts[BS] == [g[:1] for g in ids]
    assert cuts[BS + 2] == "refused" and cuts[hit + BS] == "refused"
    # (a short Mamba group is cut at what it holds; a short window group is refused)
    assert short_cut == ("refused" if layout == "full and window" else [ids[0][:1]] + [[]] * (len(ids) - 1))


def test_a_cut_refused_is_a_request_error_and_changes_nothing():
    from prefixkv.errors import RequestError
    from prefixkv.integrations.vllm.hits import TruncationError

    m = _managers(24, LAYOUTS["full and window"])[0].m
    blocks, hit = _hit(m, list(range(3 * BS)))
    before = _ids(blocks)
    with pytest.raises(TruncationError, match="group 0 .*block size 4.* cannot be cut at 5 tokens") as e:
        m.truncate_computed_blocks(blocks, 5)
    assert isinstance(e.value, RequestError) and isinstance(e.value, AssertionError)
    assert _ids(blocks) == before
    m.core.check_invariants()


@pytest.mark.parametrize("bad", [[[]], ([], [], []), "ab", [1, 2]])
def test_create_refuses_what_is_not_one_list_per_group(bad):
    from prefixkv.errors import RequestError

    m = _managers(24, LAYOUTS["full and window"])[0].m
    with pytest.raises(RequestError, match="one list of blocks per group \\(2\\)"):
        m.create_kv_cache_blocks(bad)

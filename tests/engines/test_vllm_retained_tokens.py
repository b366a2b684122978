"""A sliding window's ``extra_retained_tokens`` (vLLM 0.33's SlidingWindowSpec: the
window's trailing edge extended for multi-module speculative decoding, whose drafter
re-prefills the last tokens and reads that many tokens below the window). vLLM keeps
those blocks until the window passes them (``get_num_skipped_tokens``); a manager that
releases them first hands vLLM's worker a block that may hold another request's KV by
then. prefixkv's plug-in and vLLM's own manager, side by side: the same blocks released
at every step. Needs vllm installed."""

from __future__ import annotations

import os
from typing import Any

import pytest

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")

from .test_vllm_plugin import full  # noqa: E402
from .test_vllm_reference import BS, MAX_LEN, NULL, _managers, _request  # noqa: E402


def _window(tokens: int, retained: int) -> Any:
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32,
                             sliding_window=tokens, extra_retained_tokens=retained)


def _released(side: Any, rid: str) -> list[list[int]]:
    return [[j for j, b in enumerate(ids) if b == NULL] for ids in side.m.get_block_ids(rid)]


@pytest.mark.parametrize("retained", [0, 1, 3, 5, 9])
@pytest.mark.parametrize("window", [3, 8])
def test_blocks_below_the_window_stay_while_vllm_retains_them(window, retained):
    sides = _managers(2 * MAX_LEN // BS + 4, (full(BS), _window(window, retained)))
    reqs = [_request("r0", list(range(21)), None) for _ in sides]
    for s, r in zip(sides, reqs, strict=True):
        blocks, hit, _ = s.m.get_computed_blocks(r)
        assert s.m.allocate_slots(r, r.num_tokens, hit, blocks) is not None
        r.num_computed_tokens = r.num_tokens
        r.append_output_token_ids(7)
    assert _released(sides[0], "r0") == _released(sides[1], "r0")
    while reqs[0].num_tokens < MAX_LEN - 1:  # decode: one token a step
        for s, r in zip(sides, reqs, strict=True):
            assert s.m.allocate_slots(r, 1) is not None
            r.num_computed_tokens += 1
            r.append_output_token_ids(7)
        assert _released(sides[0], "r0") == _released(sides[1], "r0"), reqs[0].num_computed_tokens
        assert sides[0].m.block_pool.get_num_free_blocks() == sides[1].m.block_pool.get_num_free_blocks()


def _blocks(side: Any, r: Any) -> tuple[int, list[list[int]]]:
    """The hit of ``r`` and its block ids per group (``NULL`` where not served)."""
    blocks, hit, _ = side.m.get_computed_blocks(r)
    return hit, [list(ids) for ids in blocks.get_block_ids()] if hit else []


@pytest.mark.parametrize("retained", [3, 6, 9])  # (each asks for more blocks cached than
@pytest.mark.parametrize("window", [3, 8])      # the window alone: so the hits could differ)
def test_hits_ask_for_the_window_alone_as_vllms(window, retained):
    """vLLM judges a hit by ``sliding_window`` alone (``_contiguous_blocks_for_hit``) and
    keeps the retained tokens' blocks only on release (``get_num_skipped_tokens``). A
    request decodes (its window blocks released as vLLM releases them), a filler of every
    size in turn then evicts the oldest released ones, and every prefix of the request's
    tokens is looked up: the same hits and block ids on both sides (a hit that also asked
    for the retained tokens cached was shorter)."""
    full_blocks = 2 * MAX_LEN // BS + 4
    tokens = list(range(21)) + [7] * 12
    differ = 0
    for filler in range(1, 12):
        sides = _managers(full_blocks, (full(BS), _window(window, retained)))
        reqs = [_request("r0", tokens[:21], None) for _ in sides]
        for s, r in zip(sides, reqs, strict=True):
            blocks, hit, _ = s.m.get_computed_blocks(r)
            assert s.m.allocate_slots(r, r.num_tokens, hit, blocks) is not None
            r.num_computed_tokens = r.num_tokens
            r.append_output_token_ids(7)
            while r.num_tokens < len(tokens):
                assert s.m.allocate_slots(r, 1) is not None
                r.num_computed_tokens += 1
                r.append_output_token_ids(7)
            f = _request("filler", [1000 + i for i in range(filler * BS)], None)
            fb, fh, _ = s.m.get_computed_blocks(f)
            s.filled = s.m.allocate_slots(f, f.num_tokens, fh, fb) is not None
        if not sides[0].filled:  # (the pool is too small for it: so is vLLM's)
            assert not sides[1].filled
            break
        assert sides[0].m.block_pool.get_num_free_blocks() == sides[1].m.block_pool.get_num_free_blocks()
        for n in range(2, len(tokens) + 1):
            ours, theirs = (_blocks(s, _request(f"q{n}", tokens[:n], None)) for s in sides)
            assert ours == theirs, (filler, n)
            differ += theirs[0] != _longest_asking_retained(sides[1], tokens[:n], window, retained)
    assert differ, "no lookup where the window alone and the window with the retained tokens differ"


def _longest_asking_retained(side: Any, tokens: list[int], window: int, retained: int) -> int:
    """The hit on vLLM's cache had it asked for the retained tokens cached too (prefixkv's
    reading before): the longest ``k`` blocks whose full group holds ``0 .. k-1`` and whose
    window group holds the blocks a window of ``window + retained`` reads at ``k * BS``."""
    r = _request("probe", tokens, None)
    pool = side.m.block_pool
    hashes = r.block_hashes
    best = 0
    for k in range(1, (len(tokens) - 1) // BS + 1):
        first = max(0, k * BS - window - retained + 1) // BS
        if all(pool.get_cached_block(hashes[j], [0]) for j in range(k)) and \
                all(pool.get_cached_block(hashes[j], [1]) for j in range(first, k)):
            best = k * BS
    return best

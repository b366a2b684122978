"""The plug-in's KV events have vLLM 0.33's shape: its ``BlockPool`` sends one
``BlockRemoved`` a withdrawn hash (``_emit_block_removed_events``), in the order its
evictions take them; prefixkv's own log keeps one ``BlockRemoved`` per batch of
evictions (its wire, the router's, is unchanged). prefixkv's plug-in and vLLM's own
manager run the same requests on a pool small enough to evict, and each step's events
are the same list: each event's type, group, medium and the prefix of tokens each of
its hashes names (the two hash differently: a hash is known by the ``BlockStored`` that
announced it). Needs vllm."""

from __future__ import annotations

import os
import random
from typing import Any

import pytest

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
pytest.importorskip("torch")

from .test_vllm_free_order import _admit, _free  # noqa: E402
from .test_vllm_reference import BS, Side, _managers  # noqa: E402


def _shape(events: list[Any], names: dict[Any, tuple[int, ...]]) -> list[tuple[Any, ...]]:
    """``events`` as (type, group, medium, the prefix each hash names); learns the
    hashes each ``BlockStored`` announces into ``names``."""
    from vllm.distributed.kv_events import BlockStored

    out = []
    for e in events:
        if isinstance(e, BlockStored):
            prefix = names[e.parent_block_hash] if e.parent_block_hash is not None else ()
            for i, h in enumerate(e.block_hashes):
                prefix = prefix + tuple(e.token_ids[i * e.block_size:(i + 1) * e.block_size])
                names[h] = prefix
        hashes = getattr(e, "block_hashes", ())
        out.append((type(e).__name__, getattr(e, "group_idx", None), getattr(e, "medium", None),
                    [names[h] for h in hashes]))
    return out


def _same_events(sides: tuple[Side, Side], names: tuple[dict[Any, Any], dict[Any, Any]]) -> list[Any]:
    ours, theirs = (_shape(s.m.take_events(), n) for s, n in zip(sides, names, strict=True))
    assert ours == theirs
    return theirs


@pytest.mark.parametrize("blocks", [2, 3, 10])
def test_an_eviction_of_n_blocks_is_n_block_removed(blocks):
    """vLLM's test_kv_cache_events: a prompt of ``blocks`` blocks, freed, then another
    of as many that evicts all of them."""
    sides = _managers(blocks + 1)
    names: tuple[dict[Any, Any], dict[Any, Any]] = ({}, {})
    for s in sides:
        _admit(s, "a", list(range(blocks * BS)), 0)
    assert [e[0] for e in _same_events(sides, names)] == ["BlockStored"]
    for s in sides:
        _free(s, "a")
        _admit(s, "b", list(range(100, 100 + blocks * BS)), 0)
    got = _same_events(sides, names)
    assert [e[0] for e in got] == ["BlockRemoved"] * blocks + ["BlockStored"]
    assert all(len(e[3]) == 1 for e in got[:-1])


@pytest.mark.parametrize("seed", range(8))
def test_the_plugins_events_are_vllms_step_by_step(seed):
    """Prompts of shared stems, admitted, kept a while and freed on a small pool (one
    full-attention group: a hybrid request's cached blocks are freed in another order
    than vLLM's by design, groups/free_order.py, so the blocks evicted differ)."""
    rng = random.Random(seed)
    sides = _managers(14)
    names: tuple[dict[Any, Any], dict[Any, Any]] = ({}, {})
    stems = [[rng.randrange(50) for _ in range(3 * BS)] for _ in range(3)]
    live: list[str] = []
    removed = 0
    for step in range(14):
        if live and (len(live) > 1 or rng.random() < 0.4):
            rid = live.pop(rng.randrange(len(live)))
            for s in sides:
                _free(s, rid)
        tokens = rng.choice(stems)[:rng.randrange(1, 3 * BS)]
        tokens += [rng.randrange(50) for _ in range(rng.randrange(1, 2 * BS))]
        rid = f"r{step}"
        took = [_admit(s, rid, tokens, 0) for s in sides]
        assert took[0] == took[1]
        live.append(rid)
        removed += sum(e[0] == "BlockRemoved" for e in _same_events(sides, names))
    assert removed  # (the pool is small enough to evict)
    sides[0].m.core.check_invariants()


def test_a_groups_batch_is_one_block_removed_a_hash_in_its_group():
    """A hybrid manager's ``GroupBlockRemoved`` of three hashes in group 1: three of
    vLLM's ``BlockRemoved``, each of group 1 and its medium, in the batch's order."""
    from vllm.distributed.kv_events import BlockRemoved

    from prefixkv.groups.events import GroupBlockRemoved
    from prefixkv.integrations.vllm.events import to_vllm_events

    batch = GroupBlockRemoved([b"a", b"b", b"c"], [4, 5, 6], "CPU", group_idx=1)
    got = to_vllm_events([batch], BS, [("full_attention", None), ("sliding_window", 8)])
    assert got == [BlockRemoved(block_hashes=[h], medium="CPU", group_idx=1) for h in (b"a", b"b", b"c")]

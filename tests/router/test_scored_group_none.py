"""A ``Stored`` that names no layer group must not blind the router to the replica's
groups. Found by fleet-r18 in test_wire_fuzz (a fuzzed ``Stored`` with ``group_idx`` nil
and kind full_attention applied first after a resync): scored.py took None as the
replica's scored group, and every later batch of its real group 0 was left out of the
index, so the replica scored 0 for the prompts it held (until a Cleared). vLLM 0.33's
BlockPool names the group of every event it sends (``group_idx=kv_cache_group_id``); an
event naming none is indexed as a one-group replica's."""

from __future__ import annotations

from prefixkv.router import Removed, Router, Stored

BS = 4
PROMPT = list(range(1, 17))  # 4 full blocks


def test_a_stored_naming_no_group_first_leaves_group_0_scored():
    router = Router(["a"], block_size=BS)
    hs = tuple(router.prompt_hashes(PROMPT))
    router.apply("a", [Stored(hs[:1], None, "GPU", None, "full_attention")])
    router.apply("a", [Stored(hs, None, "GPU", 0, "full_attention"),
                       Stored(hs, None, "GPU", 1, "sliding_window")])
    assert router.scored_group("a") == 0
    assert router.cached_tokens(PROMPT) == {"a": 16}


def test_stored_events_naming_no_group_are_indexed_alone():
    router = Router(["a", "b"], block_size=BS)
    hs = tuple(router.prompt_hashes(PROMPT))
    router.apply("a", [Stored(hs[:3], None, "GPU")])
    router.apply("b", [Stored(hs[:2], None, "GPU", None, "sliding_window")])  # windowed
    assert router.scored_group("a") is None
    assert router.cached_tokens(PROMPT) == {"a": 12, "b": 0}
    router.apply("a", [Removed(hs[2:3], "GPU")])
    assert router.cached_tokens(PROMPT) == {"a": 8, "b": 0}


def test_group_0_first_then_an_event_naming_no_group():
    router = Router(["a"], block_size=BS)
    hs = tuple(router.prompt_hashes(PROMPT))
    router.apply("a", [Stored(hs[:2], None, "GPU", 0, "full_attention"),
                       Stored(hs[2:], hs[1], "GPU", None, None)])
    assert router.scored_group("a") == 0
    assert router.cached_tokens(PROMPT) == {"a": 16}

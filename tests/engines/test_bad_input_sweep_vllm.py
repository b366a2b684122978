"""The reviewer's sweep over the vLLM plug-in's slot and pool surface
(``prefixkv.integrations.vllm.KVCacheManager``: what vLLM's scheduler calls): a manager
over a full-attention and a sliding-window group, with a live request (computed tokens
cached), a request freed (its blocks cached) and a step's outputs not taken, given each
plain argument of each call replaced by each value of tests/hostile.py. A call either
succeeds as on a twin driven alike, or raises a ``PrefixKVError`` with the manager's deep
fingerprint (tests/deep_fingerprint.py) unchanged; then prefixkv's own
``check_invariants`` holds."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from deep_fingerprint import fingerprint
from hostile import HOSTILE, outcome

from .test_vllm_plugin import BS, config, full, request, window

Call = tuple[tuple[Any, ...], dict[str, Any]]
PROMPT = list(range(1, 50))


def _driven() -> Any:
    from prefixkv.integrations.vllm import KVCacheManager

    m = KVCacheManager(config(full(), window(32), num_blocks=30), max_model_len=8192,
                       scheduler_block_size=BS, hash_block_size=BS)
    gone = request("gone", list(range(100, 140)))
    m.allocate_slots(gone, 40)
    m.cache_blocks(gone, 40)
    gone.num_computed_tokens = 40
    m.free(gone)
    live = request("live", PROMPT)
    blocks, hit, _ = m.get_computed_blocks(live)
    m.allocate_slots(live, len(PROMPT) - hit, hit, blocks)
    m.cache_blocks(live, len(PROMPT))
    live.num_computed_tokens = len(PROMPT)
    m.new_step_starts()
    m.allocate_slots(live, 1)
    return m


def _live(m: Any) -> Any:
    r = request("live", PROMPT)
    r.num_computed_tokens = len(PROMPT)
    return r


# call name -> a valid call's arguments past ``self``, given the manager (a vLLM Request
# is built anew each time: the sweep replaces the plain arguments beside it)
CALLS: dict[str, Callable[[Any], Call]] = {
    "allocate_slots": lambda m: ((_live(m), 1), {"num_new_computed_tokens": 0, "num_lookahead_tokens": 0,
                                                 "num_external_computed_tokens": 0, "reserved_blocks": 0}),
    "cache_blocks": lambda m: ((_live(m), len(PROMPT)), {}),
    "get_block_ids": lambda m: (("live",), {}),
    "get_blocks": lambda m: (("live",), {}),
    "key_of": lambda m: (("live",), {}),
    "num_cached_tokens": lambda m: (("live",), {}),
    "get_block_ids_for_computed_tokens": lambda m: (("live", 32), {}),
    "get_num_common_prefix_blocks": lambda m: (("live",), {}),
    "get_computed_blocks": lambda m: ((request("new", PROMPT),), {"max_cache_hit_length": 32}),
    "remove_skipped_blocks": lambda m: (("live", 48), {}),
    "evict_blocks": lambda m: (({1, 2},), {}),
    "record_prefix_cache_stats": lambda m: ((request("new", PROMPT), 16), {}),
    "record_blocks_for_zeroing": lambda m: (("live", 0), {}),
}
# the request object itself is not swept (a vLLM Request is the scheduler's own)
REQUEST_ARG = {"allocate_slots", "cache_blocks", "get_computed_blocks", "record_prefix_cache_stats"}


# vLLM's own contract: allocate_slots with nothing to schedule raises ValueError (False
# is 0 to the count's check, as it is to vLLM's)
VLLM_S_OWN = {("allocate_slots", 1, "False")}


def _state(m: Any) -> Any:
    return fingerprint(m)


@pytest.mark.parametrize("name", sorted(CALLS))
def test_every_bad_plain_argument_of_a_vllm_slot_call_is_a_typed_error_before_any_change(name):
    args0, kw0 = CALLS[name](None)
    slots: list[int | str] = [*range(1 if name in REQUEST_ARG else 0, len(args0)), *kw0]
    problems = []
    for slot in slots:
        for label, value in HOSTILE.items():
            def call(m: Any, slot: int | str = slot, value: Callable[[], Any] = value) -> object:
                args, kw = CALLS[name](m)
                if isinstance(slot, str):
                    kw = {**kw, slot: value()}
                else:
                    args = args[:slot] + (value(),) + args[slot + 1:]
                return getattr(m, name)(*args, **kw)
            ours = _driven()
            problem = outcome(ours, _driven(), call, _state)
            if problem and (name, slot, label) not in VLLM_S_OWN:
                problems.append(f"{name} {slot}={label}: {problem}")
            ours.core.check_invariants()
    assert problems == []


def test_a_count_or_id_of_the_wrong_type_is_a_request_error_before_any_change():
    """What the sweep found: an unhashable request id raised the dict's TypeError out of
    get_block_ids, get_blocks, key_of, num_cached_tokens and remove_skipped_blocks; a
    count that is not an int raised TypeError (``<``, unary ``-``, a slice) out of
    cache_blocks, get_block_ids_for_computed_tokens and remove_skipped_blocks, and a
    numpy array as any count of allocate_slots numpy's own ValueError."""
    import numpy as np

    from prefixkv import RequestError

    ours, twin = _driven(), _driven()
    for call in (ours.get_block_ids, ours.get_blocks, ours.key_of, ours.num_cached_tokens):
        with pytest.raises(RequestError, match="request id"):
            call(["live"])
    with pytest.raises(RequestError, match="request id"):
        ours.remove_skipped_blocks(["live"], 48)
    with pytest.raises(RequestError, match="processed_computed_tokens"):
        ours.remove_skipped_blocks("live", "48")
    with pytest.raises(RequestError, match="num_computed_tokens"):
        ours.cache_blocks(_live(ours), None)
    with pytest.raises(RequestError, match="num_computed_tokens"):
        ours.get_block_ids_for_computed_tokens("live", 2.0)
    for keyword in ("num_new_computed_tokens", "num_lookahead_tokens", "reserved_blocks"):
        with pytest.raises(RequestError, match=keyword):
            ours.allocate_slots(_live(ours), 1, **{keyword: np.array([1, 2])})
    assert _state(ours) == _state(twin)
    ours.core.check_invariants()

"""The plug-in's ``block_pool.get_cached_block`` and ``cached_block_hash_to_block`` beside
vLLM 0.33's own pool (block_hashes.py): a vLLM block hash names a prefix, which prefixkv
finds by content in the requests its block hasher noted.

One random request stream (tests/engines/test_vllm_reference.py's, LoRA adapters, salts
and images included) through both managers, on one full-attention group and on full
attention beside a sliding window: until either pool removes a block (then each holds
what it evicted, by design), every hash of every request gets the same answer, None or
a block, in every group, and the map's ``len`` is the same; any block prefixkv answers
holds that prefix (the stream's model of what each block holds). Groups of different
block sizes (a scenario vLLM's test_different_block_size starts with): the same block
ids, the partial tail entry vLLM adds inside a larger full-attention block included
(prefixkv keeps those with events on; without, a hash there is refused). And what the
view refuses, with UnsupportedByPrefixKV (writes, hashes of no request it knows,
``len`` where tail entries would count) or RequestError (bad input). Needs vllm."""

from __future__ import annotations

import os
from typing import Any
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")

from prefixkv import RequestError  # noqa: E402

from . import test_vllm_reference as ref  # noqa: E402
from .test_vllm_block_objects import compare_counts  # noqa: E402
from .test_vllm_hybrid_reference import _window  # noqa: E402
from .test_vllm_plugin import config, full  # noqa: E402

BS = ref.BS
LAYOUTS = {"full": None, "full and sliding window": (full(BS), _window(2 * BS))}


def _noting(ours: Any) -> Any:
    """The stream's request factory, each request noted by prefixkv's manager as its
    block hasher would (vLLM's side's too: the same contents, the same hashes)."""
    make = ref._request

    def request(*args: Any, **kw: Any) -> Any:
        r = make(*args, **kw)
        ours.prepared_prompts.note(r)
        return r

    return request


def _answers(m: Any, block_hash: bytes, groups: int) -> list[int | None]:
    out = []
    for g in range(groups):
        blocks = m.block_pool.get_cached_block(block_hash, [g])
        out.append(None if blocks is None else blocks[0].block_id)
    return out


def _compare_hashes(sides: tuple[ref.Side, ref.Side]) -> None:
    ours, theirs = sides
    groups = len(ours.windows)
    strict = not (ours.evicted or theirs.evicted or ours.diverged)
    if strict:
        assert len(ours.m.block_pool.cached_block_hash_to_block) == len(
            theirs.m.block_pool.cached_block_hash_to_block)
    for slot in ours.reqs.keys() & theirs.reqs.keys():
        r, v = ours.reqs[slot], theirs.reqs[slot]
        if list(r.all_token_ids) != list(v.all_token_ids):
            continue  # (after divergence, a slot may hold another request on each side)
        assert list(r.block_hashes) == list(v.block_hashes)
        for j, h in enumerate(r.block_hashes):
            mine = _answers(ours.m, h, groups)
            if strict:
                assert [b is None for b in mine] == [b is None for b in _answers(theirs.m, h, groups)], (
                    j, mine, _answers(theirs.m, h, groups))
                both = ours.m.block_pool.get_cached_block(h, list(range(groups)))
                assert (both is None) == (None in mine)
            if not ours.tainted:
                for g, b in enumerate(mine):
                    assert b is None or ours.held.get(b) == ref._identity(r, g, (j + 1) * BS), (g, j, b)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@settings(max_examples=25, deadline=None)
@given(num_blocks=st.integers(ref.MAX_LEN // BS + 1, 30), ops=st.lists(ref.OP, min_size=8, max_size=30))
def test_every_hash_gets_vllms_answer_until_a_block_is_removed(layout, num_blocks, ops):
    specs = LAYOUTS[layout]
    sides = ref._managers(num_blocks if specs is None else 2 * num_blocks, specs)
    with mock.patch.object(ref, "_request", _noting(sides[0].m)):
        for serial, (op, slot, k, prompt, more) in enumerate(ops):
            strict = not (sides[0].evicted or sides[1].evicted)
            ref._do(sides, op, slot, k, prompt, more, serial, strict)
            for s in sides:
                s.note_events()
            _compare_hashes(sides)
            compare_counts(sides)  # (and every block object's ref_cnt is vLLM's)


def _sized(events: bool) -> list[Any]:
    """Both managers on full attention of 2 * BS beside a window of BS tokens (hashes of
    BS): vLLM's own, then prefixkv's, each with a request of 10 hash blocks computed
    and a second of 8 admitted on its hit; their requests."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager as Theirs
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.request import RequestStatus

    from prefixkv.integrations.vllm import KVCacheManager as Ours

    init_none_hash(sha256)
    out = []
    for cls in (Theirs, Ours):
        m = cls(config(full(2 * BS), _window(2 * BS), num_blocks=40), max_model_len=ref.MAX_LEN,
                scheduler_block_size=2 * BS, hash_block_size=BS, enable_kv_cache_events=events)
        reqs = []
        for rid, n in (("a", 10 * BS), ("b", 8 * BS + 1)):
            r = ref._request(rid, [k // BS for k in range(n)], None)
            if cls is Ours:
                m.prepared_prompts.note(r)
            blocks, hit, _ = m.get_computed_blocks(r)
            assert m.allocate_slots(r, n - hit, hit, blocks) is not None
            r.status, r.num_computed_tokens = RequestStatus.RUNNING, n
            m.cache_blocks(r, n)
            reqs.append(r)
        out.append((m, reqs))
    return out


@pytest.mark.parametrize("events", [False, True])
def test_groups_of_different_block_sizes_answer_vllms_block_ids(events):
    from prefixkv.integrations.vllm.layout import UnsupportedByPrefixKV

    (theirs, _), (ours, reqs) = _sized(events)
    tails = 0
    for r in reqs:
        for j, h in enumerate(r.block_hashes):
            want = _answers(theirs, h, 2)
            if (j + 1) % 2 and not events:  # (inside a full-attention block: its tail entry unknown)
                with pytest.raises(UnsupportedByPrefixKV, match="partial tail entry"):
                    ours.block_pool.get_cached_block(h, [0])
                window = ours.block_pool.get_cached_block(h, [1])
                assert (None if window is None else window[0].block_id) == want[1]
                continue
            tails += (j + 1) % 2 and want[0] is not None
            assert _answers(ours, h, 2) == want, (r.request_id, j)
    # (a's last hash boundary before its last token, 36, inside its 32..39 block; b's, 32, is a
    # block end)
    assert tails == events
    with pytest.raises(UnsupportedByPrefixKV, match="partial tail entries"):
        len(ours.block_pool.cached_block_hash_to_block)


def _plain(**kw: Any) -> tuple[Any, Any]:
    """prefixkv's manager (one group) and a noted request of 2 full blocks, computed."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    from prefixkv.integrations.vllm import KVCacheManager as Ours

    init_none_hash(sha256)

    m = Ours(config(full(BS), num_blocks=8), max_model_len=ref.MAX_LEN, scheduler_block_size=BS,
             hash_block_size=BS, **kw)
    r = ref._request("a", list(range(9)), None)
    m.prepared_prompts.note(r)
    assert m.allocate_slots(r, 9) is not None
    return m, r


def test_the_map_answers_by_hash_and_group_and_refuses_writes():
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    from prefixkv.integrations.vllm.layout import UnsupportedByPrefixKV

    m, r = _plain()
    cached = m.block_pool.cached_block_hash_to_block
    assert len(cached) == 2 and cached
    key = make_block_hash_with_group_id(r.block_hashes[1], 0)
    assert cached.get_one_block(key).block_id == 2
    assert cached.contain(key, 2) and not cached.contain(key, 1)
    assert cached.get_one_block(make_block_hash_with_group_id(r.block_hashes[1], 1)) is None
    for write in (lambda: cached.pop(key, 2), lambda: cached.insert(key, None), lambda: cached._cache):
        with pytest.raises(UnsupportedByPrefixKV, match="read-only"):
            write()
    with pytest.raises(RequestError, match="group id"):
        cached.get_one_block(b"abc")


def test_a_hash_of_no_noted_request_is_refused_and_bad_input_is_a_request_error():
    from prefixkv.integrations.vllm.layout import UnsupportedByPrefixKV

    m, r = _plain()
    pool = m.block_pool
    assert [b.block_id for b in pool.get_cached_block(r.block_hashes[0], [0])] == [1]
    assert pool.get_cached_block(r.block_hashes[0], [1]) is None  # (no such group: vLLM's None)
    assert pool.get_cached_block(r.block_hashes[0], []) == []
    stranger = ref._request("b", list(range(9)), "salt")  # built without prefixkv's hasher
    with pytest.raises(UnsupportedByPrefixKV, match="no live request"):
        pool.get_cached_block(stranger.block_hashes[0], [0])
    for bad in ("abc", None, 7):
        with pytest.raises(RequestError, match="bytes"):
            pool.get_cached_block(bad, [0])
    for groups in ([-1], ["0"], None, [True]):
        with pytest.raises(RequestError, match="kv_cache_group_ids"):
            pool.get_cached_block(r.block_hashes[0], groups)


def test_without_caching_no_block_is_cached():
    m, r = _plain(enable_caching=False)
    assert m.block_pool.get_cached_block(r.block_hashes[0], [0]) is None
    assert len(m.block_pool.cached_block_hash_to_block) == 0


def test_the_event_queue_reads_empty_until_events_are_pending_and_refuses_writes():
    from prefixkv.integrations.vllm.layout import UnsupportedByPrefixKV

    m, _ = _plain(enable_kv_cache_events=True)
    queue = m.block_pool.kv_event_queue
    with pytest.raises(UnsupportedByPrefixKV, match="only while it is empty"):
        len(queue)
    assert m.take_events()
    assert len(queue) == 0 and list(queue) == []
    with pytest.raises(UnsupportedByPrefixKV, match="read-only"):
        queue.append(None)
    quiet, _ = _plain()  # (events off: vLLM's queue stays empty, whatever prefixkv records)
    assert len(quiet.block_pool.kv_event_queue) == 0


def test_each_group_view_shows_the_one_pool_connectors_ask():
    # (vLLM's UMBP connector asks coordinator.single_type_managers[g].block_pool)
    m, r = _plain()
    view = m.coordinator.single_type_managers[0]
    assert view.block_pool is m.block_pool
    assert [b.block_id for b in view.block_pool.get_cached_block(r.block_hashes[1], [0])] == [2]


def test_the_free_queue_lists_the_free_blocks_in_reuse_order():
    m, _ = _plain()
    assert [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()] == [
        i + m._blocks.offset for i in m.core.free_block_order()] == [4, 5, 6, 7]

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
from .test_vllm_block_hash_objects import compare_block_hashes  # noqa: E402
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
    loaded_badly: set[str] = set()
    with mock.patch.object(ref, "_request", _noting(sides[0].m)):
        for serial, (op, slot, k, prompt, more) in enumerate(ops):
            strict = not (sides[0].evicted or sides[1].evicted)
            ref._do(sides, op, slot, k, prompt, more, serial, strict)
            for s in sides:
                s.note_events()
            _compare_hashes(sides)
            compare_counts(sides)  # (and every block object's ref_cnt is vLLM's)
            if op == "evict":  # (a failed load: the hashes of the requests on it may part)
                loaded_badly.update(sides[0].reqs[q].request_id for q in sides[0].live)
            compare_block_hashes(sides, loaded_badly)  # (and its hash)


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
    # (``_cache`` reads, as a read-only snapshot: cache_map.py; its writes are refused)
    for write in (lambda: cached.pop(key, 2), lambda: cached.insert(key, None),
                  lambda: cached._cache.pop(key)):
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


@pytest.mark.parametrize("window", [False, True])
def test_a_connector_asking_each_block_pays_the_same_on_a_long_request(window):
    # (vLLM's SimpleCPUOffload and aux-output connectors ask every block, every step: the
    # request's prompt is encoded once, block_hashes.py's probes)
    import gc

    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    from prefixkv.bench.opcodes import count_opcodes
    from prefixkv.integrations.vllm import KVCacheManager as Ours

    init_none_hash(sha256)

    def cost(blocks: int) -> int:
        specs = (full(BS), _window(2 * BS)) if window else (full(BS),)
        m = Ours(config(*specs, num_blocks=len(specs) * (blocks + 4)), max_model_len=blocks * BS + BS,
                 scheduler_block_size=BS, hash_block_size=BS)
        r = ref._request("a", [(i * 31) % 1000 for i in range(blocks * BS)], None)
        m.prepared_prompts.note(r)
        assert m.allocate_slots(r, blocks * BS) is not None
        r.num_computed_tokens = blocks * BS
        m.cache_blocks(r, blocks * BS)
        for h in r.block_hashes:  # (a step's questions: the prompt encoded, its blocks walked)
            assert m.block_pool.get_cached_block(h, [0]) is not None
        gc.disable()  # (a collection's callbacks would be counted)
        try:
            return count_opcodes(lambda: m.block_pool.get_cached_block(r.block_hashes[blocks // 2], [0]))
        finally:
            gc.enable()

    assert cost(256) == cost(16)


def test_a_finished_requests_hash_is_refused_without_a_look_at_every_live_hash():
    # (the aux-output connector asks finished requests' hashes; the map of hashes is made
    # from where each live request's last scan left it)
    import gc

    from prefixkv.bench.opcodes import count_opcodes
    from prefixkv.integrations.vllm.layout import UnsupportedByPrefixKV

    def cost(blocks: int) -> int:
        m, _ = _plain()
        live = []
        for i in range(4):
            r = ref._request(f"l{i}", [i] * (blocks * BS), None)
            m.prepared_prompts.note(r)
            live.append(r)
        gone = ref._request("gone", list(range(9)), "salt")
        m.prepared_prompts.note(gone)
        h = gone.block_hashes[0]
        del gone
        gc.collect()

        def ask() -> None:
            with pytest.raises(UnsupportedByPrefixKV, match="no live request"):
                m.block_pool.get_cached_block(h, [0])

        ask()
        gc.disable()  # (a collection's callbacks would be counted)
        try:
            return count_opcodes(ask)
        finally:
            gc.enable()

    assert cost(64) == cost(4)


@pytest.mark.parametrize("goes", [0, 1])
def test_a_hash_two_requests_hold_is_answered_while_either_lives(goes):
    import gc

    m, a = _plain()
    b = ref._request("b", list(range(9)), None)
    m.prepared_prompts.note(b)
    pool, h = m.block_pool, a.block_hashes[1]
    assert [x.block_id for x in pool.get_cached_block(h, [0])] == [2]
    reqs = [a, b]
    del reqs[goes], a, b
    gc.collect()
    assert [x.block_id for x in pool.get_cached_block(h, [0])] == [2]


def test_a_request_cut_and_grown_again_names_its_new_prefix():
    # (vLLM's P/D connectors cut a prompt's tail on the prefill side; the hashes go with it)
    m, r = _plain()
    pool = m.block_pool
    old = r.block_hashes[1]
    assert [x.block_id for x in pool.get_cached_block(old, [0])] == [2]
    del r._all_token_ids[4:]
    del r.block_hashes[1:]
    r.num_computed_tokens = 4
    r.append_output_token_ids([7] * 5)  # (its hasher hashes the new block)
    assert len(r.block_hashes) == 2 and r.block_hashes[1] != old
    assert pool.get_cached_block(r.block_hashes[1], [0]) is None  # (never computed)
    from prefixkv.integrations.vllm.layout import UnsupportedByPrefixKV
    with pytest.raises(UnsupportedByPrefixKV, match="no live request"):
        pool.get_cached_block(old, [0])


@pytest.mark.parametrize("window", [False, True])
def test_contain_lists_every_copy_of_a_prefix_as_vllms_map(window):
    # (vLLM's BlockHashToBlockMap keeps each block that computed a prefix under its key:
    # the primary and a spare its request holds; get_one_block gives the first cached)
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager as Theirs
    from vllm.v1.core.kv_cache_utils import init_none_hash, make_block_hash_with_group_id
    from vllm.v1.request import RequestStatus

    from prefixkv.integrations.vllm import KVCacheManager as Ours

    init_none_hash(sha256)
    specs = (full(BS), _window(2 * BS)) if window else (full(BS),)
    seen = []
    for cls in (Theirs, Ours):
        m = cls(config(*specs, num_blocks=12 * len(specs)), max_model_len=ref.MAX_LEN,
                scheduler_block_size=BS, hash_block_size=BS)
        reqs = []
        for rid in ("a", "b"):  # b: a's prompt again, its last block computed anew (a spare)
            r = ref._request(rid, list(range(3 * BS)), None)
            if cls is Ours:
                m.prepared_prompts.note(r)
            blocks, hit, _ = m.get_computed_blocks(r)
            assert m.allocate_slots(r, 3 * BS - hit, hit, blocks) is not None
            r.status, r.num_computed_tokens = RequestStatus.RUNNING, 3 * BS
            m.cache_blocks(r, 3 * BS)
            reqs.append(r)
        cached = m.block_pool.cached_block_hash_to_block
        state = []
        for g in range(len(specs)):
            for h in reqs[0].block_hashes:
                key = make_block_hash_with_group_id(h, g)
                one = cached.get_one_block(key)
                state.append((None if one is None else one.block_id,
                              [i for i in range(1, m.block_pool.num_gpu_blocks) if cached.contain(key, i)]))
        seen.append(state)
    assert seen[0] == seen[1]
    assert any(len(ids) == 2 for _, ids in seen[1])  # (a spare is listed)

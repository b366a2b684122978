"""prefixkv's plug-in manager on a HiSparse layout (integrations/vllm/hisparse_manager.py)
against vLLM 0.33's own manager, side by side through the calls vLLM's scheduler and its
HiSparse connector make: three requests stepped (prefill chunks, decode tokens,
lookahead slots, the full-sequence gate, ``reserved_blocks``, the watermark), the copies
to host confirmed by one or two workers, requests freed and replaced, the cache reset.
After each op every answer must be vLLM's: what ``allocate_slots`` took per group, each
request's block ids (whole and clipped), the free count and usage, the scheduler's count
of blocks a request still needs, and the coordinator's (offload commands, pending work
and reclamation, whether a step reads only resident pages). Then the binding: what the
manager refuses, by name, and that a plain layout still gets the plain class.
Needs vllm installed."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from . import skip_module_without_vllm

skip_module_without_vllm()

from vllm.v1.hisparse.coordinator import get_hisparse_coordinator  # noqa: E402

from prefixkv.integrations.vllm import KVCacheManager, UnsupportedByPrefixKV  # noqa: E402

from .hisparse_model import BS, MAX_LEN  # noqa: E402
from .test_vllm_hisparse import hisparse_config, vllm_manager  # noqa: E402
from .test_vllm_plugin import request as make_request  # noqa: E402

OPS = st.lists(st.one_of(
    st.tuples(st.just("step"), st.integers(0, 2), st.integers(1, 48), st.integers(0, 7)),
    st.tuples(st.just("decode"), st.integers(0, 2), st.integers(1, 3), st.integers(0, 7)),
    st.tuples(st.just("confirm"), st.integers(0, 2**16 - 1), st.just(0), st.integers(0, 1)),
    st.tuples(st.just("free"), st.integers(0, 2), st.just(0), st.just(0)),
    st.tuples(st.just("reset"), st.just(0), st.just(0), st.just(0)),
    st.tuples(st.just("take"), st.integers(1, 8), st.just(0), st.just(0)),
    st.tuples(st.just("give_back"), st.just(0), st.just(0), st.just(0)),
    st.tuples(st.just("hot"), st.integers(0, 2), st.just(0), st.just(0)),
    st.tuples(st.just("sync"), st.integers(0, 7), st.just(0), st.just(0))), min_size=4, max_size=40)


def confirm(coordinators: Any, mask: int, two: int) -> None:
    """The offload commands sent (alike on both sides), then the copies in flight of
    ``mask`` confirmed: by one worker, or by two of which one completes when ``two``."""
    sent = [c.build_offload_command().page_transfers for c in coordinators]
    assert sent[1] == sent[0]
    chosen = [t for k, t in enumerate(sorted(coordinators[0].pending_spills)) if mask >> (k % 16) & 1]
    for c in coordinators:
        c.update_spills({t: 2 if two else 1 for t in chosen}, {t: 1 for t in chosen})


def step_tokens(req: Any, op: str, n: int) -> int:
    """The tokens a ``step`` of ``n`` schedules for ``req`` (its prompt's rest at most), or
    a ``decode`` (one token, after ``n`` output tokens appended once the prompt is
    computed); 0: nothing to schedule."""
    if op == "decode":
        if req.num_computed_tokens < req.num_tokens or req.num_tokens + n > MAX_LEN:
            return 0
        req.append_output_token_ids(list(range(n)))
        n = 1
    return max(min(n, req.num_tokens - req.num_computed_tokens), 0)


def _ids(blocks: Any) -> Any:
    return None if blocks is None else tuple(list(g) for g in blocks.get_block_ids())


def side_by_side(num_blocks: int, host_blocks: int, hot_blocks: int, in_flight: int, watermark: float,
                 lookahead: int, ops: list[tuple[str, int, int, int]]) -> set[str]:
    """vLLM's manager and prefixkv's on one HiSparse layout, driven alike (module doc).
    An op: ``step`` of request ``a`` by ``n`` tokens (flags ``f``: 1 the whole request
    must fit, 2 with ``lookahead`` slots, 4 with 2 reserved blocks); ``decode`` (a step
    of one token once the prompt is computed, ``n`` output tokens appended); ``confirm``
    the copies of mask ``a`` (one worker, or two with one completing when ``f``);
    ``free`` request ``a`` (a new one takes its place); ``reset`` the cache; another
    user's ``take`` of ``a`` device blocks and ``give_back`` of all it took; ``hot``: live
    request ``a`` asked to take its hot region; ``sync``: the residency updates of the
    requests of mask ``a``. Returns what happened."""
    from vllm.v1.request import RequestStatus

    kw = {"max_model_len": MAX_LEN, "max_in_flight_tokens": in_flight, "watermark": watermark}
    cfg = hisparse_config(num_blocks, host_blocks, hot_blocks=hot_blocks)
    theirs, ours = vllm_manager(cfg, **kw), _plugin_manager(cfg, **kw)
    coordinators = get_hisparse_coordinator(theirs), get_hisparse_coordinator(ours)
    reqs = [make_request(f"q{k}", list(range(1000 * k, 1000 * k + 24 + 40 * k))) for k in range(3)]
    seen: set[str] = set()
    taken: list[list[Any]] = [[], []]
    for i, (op, a, n, f) in enumerate(ops):
        if op in ("step", "decode"):
            req = reqs[a]
            n = step_tokens(req, op, n)
            if not n:
                continue
            args = dict(full_sequence_must_fit=bool(f & 1), num_lookahead_tokens=lookahead if f & 2 else 0,
                        reserved_blocks=2 if f & 4 else 0)
            got = [m.allocate_slots(req, n, **args) for m in (theirs, ours)]
            assert _ids(got[1]) == _ids(got[0]), (op, a, n, args)
            if got[0] is not None:
                total = req.num_computed_tokens + n
                for c in coordinators:
                    c.advance_scheduled([(req.request_id, total)])
                req.num_computed_tokens = total
                req.status = RequestStatus.RUNNING
            seen.add("stepped" if got[0] is not None else "refused")
        elif op == "confirm":
            confirm(coordinators, a, f)
        elif op == "free":
            for m in (theirs, ours):
                m.free(reqs[a])
            reqs[a] = make_request(f"q{a}-{i}", list(range(24 + 40 * a)))
        elif op == "reset":
            done = theirs.reset_prefix_cache()
            assert ours.reset_prefix_cache() == done
            seen.add(f"reset {done}")
        elif op == "take":
            k = min(a, theirs.block_pool.get_num_free_blocks())
            for side, m in enumerate((theirs, ours)):
                taken[side] += m.block_pool.get_new_blocks(k)
            assert [b.block_id for b in taken[1]] == [b.block_id for b in taken[0]]
        elif op == "give_back":
            for side, m in enumerate((theirs, ours)):
                m.block_pool.free_blocks(taken[side])
            taken = [[], []]
        elif op == "hot" and theirs.get_block_ids(reqs[a].request_id)[0]:
            for c in coordinators:
                c.hot_managers[0].require_hot(reqs[a].request_id)
            seen.add("hot asked")
        elif op == "sync":
            asked = [r.request_id for k, r in enumerate(reqs) if a >> k & 1]
            updates = [c.take_residency_updates(asked) for c in coordinators]
            assert updates[1] == updates[0]
            seen.add("synced" if updates[0] else "nothing to sync")
        compare(theirs, ours, coordinators, reqs)
        ours.state.check_invariants(list(ours.block_pool.taken.values()))
        if ours.state.device.unpinned:
            seen.add("unpinned")
    return seen


def compare(theirs: Any, ours: Any, coordinators: Any, reqs: list[Any]) -> None:
    """Every answer of ``ours`` is ``theirs``' (module doc)."""
    for m in (theirs, ours):
        assert m.block_pool.get_num_free_blocks() == theirs.block_pool.get_num_free_blocks()
        assert m.usage == pytest.approx(theirs.usage)
    for call in ("has_pending_work", "has_pending_reclamation"):
        assert getattr(coordinators[1], call)() == getattr(coordinators[0], call)(), call
    assert len(coordinators[1].pending_spills) == len(coordinators[0].pending_spills)
    pools = [c.get_host_block_pool() for c in coordinators]
    assert [p.get_num_free_blocks() for p in pools] == [pools[0].get_num_free_blocks()] * 2
    for req in reqs:
        rid, computed = req.request_id, req.num_computed_tokens
        assert ours.get_block_ids(rid) == theirs.get_block_ids(rid)
        assert ours.get_block_ids_for_computed_tokens(rid, computed) == \
            theirs.get_block_ids_for_computed_tokens(rid, computed)
        assert _ids(ours.get_blocks(rid)) == _ids(theirs.get_blocks(rid))
        for scheduled in (0, 1, 17):
            asked = ((rid, computed, scheduled),)
            assert coordinators[1].all_context_pages_resident(asked) == \
                coordinators[0].all_context_pages_resident(asked)
            mirrors = ((rid, max(computed - 5, 0), scheduled + 5),)
            assert coordinators[1].build_row_mirrors(mirrors) == coordinators[0].build_row_mirrors(mirrors)
        rows = [[b.block_id for b in c.resident_managers[0].get_residency_row(rid)] for c in coordinators]
        assert rows[1] == rows[0]
        assert [c.hot_managers[0].has_hot(rid) for c in coordinators] == \
            [coordinators[0].hot_managers[0].has_hot(rid)] * 2
        hosts = [{r: [b.block_id for b in bs] for r, bs in c.host_manager.req_to_blocks.items() if bs}
                 for c in coordinators]
        assert hosts[1] == hosts[0]
        if computed:  # (the scheduler's count for a running request: _request_remaining_blocks)
            need = [m.coordinator.get_num_blocks_to_allocate(
                request_id=rid, num_tokens=req.num_tokens, new_computed_blocks=((), (), (), ()),
                num_encoder_tokens=0, total_computed_tokens=computed, num_local_computed_tokens=computed,
                num_tokens_main_model=req.num_tokens, apply_admission_cap=True) for m in (theirs, ours)]
            assert need[1] == need[0]


def _plugin_manager(cfg: Any, **kw: Any) -> Any:
    kw = {"max_model_len": 128, "scheduler_block_size": BS, "hash_block_size": BS,
          "enable_caching": False, **kw}
    return KVCacheManager(cfg, **kw)


def test_a_scenario_answers_as_vllm() -> None:
    """Two requests prefill past the admission window (rows read from host, pages
    unpinned and lost), copies confirmed by one and two workers, a request freed with
    copies in flight, the gate and the watermark refusing, the cache reset once free."""
    every = 2**16 - 1
    seen = side_by_side(20, 16, 2, 32, 0.1, 3, [
        ("step", 2, 48, 0), ("step", 0, 24, 1), ("confirm", every, 0, 0), ("step", 2, 48, 2),
        ("step", 1, 32, 5), ("confirm", every, 0, 1), ("decode", 0, 1, 0), ("step", 2, 40, 0),
        ("confirm", 0b101, 0, 0), ("free", 2, 0, 0), ("step", 1, 32, 0), ("confirm", every, 0, 0),
        ("reset", 0, 0, 0), ("free", 0, 0, 0), ("free", 1, 0, 0), ("free", 2, 0, 0),
        ("confirm", every, 0, 0), ("reset", 0, 0, 0)])
    assert {"stepped", "refused", "unpinned", "reset False", "reset True"} <= seen, seen


def test_another_user_a_hot_region_asked_for_and_residency_answer_as_vllm() -> None:
    """A request asked to take its hot region (vLLM's ``require_hot``) unpins its clean
    pages; another user takes them from the pool (lost to host) and gives blocks back; the
    residency updates tell the lost pages, then only what changed."""
    every = 2**16 - 1
    seen = side_by_side(24, 16, 2, MAX_LEN, 0.0, 1, [
        ("step", 1, 48, 0), ("sync", 2, 0, 0), ("hot", 1, 0, 0), ("step", 1, 8, 0), ("confirm", every, 0, 0),
        ("sync", 2, 0, 0), ("take", 8, 0, 0), ("sync", 2, 0, 0), ("take", 4, 0, 0), ("sync", 7, 0, 0),
        ("give_back", 0, 0, 0), ("step", 0, 16, 0), ("sync", 7, 0, 0), ("free", 1, 0, 0), ("sync", 7, 0, 0)])
    assert {"hot asked", "unpinned", "synced", "nothing to sync"} <= seen, seen
    # the last page the workers were told of is lost once the row grew two pages past it
    seen = side_by_side(16, 16, 2, MAX_LEN, 0.0, 1, [
        ("step", 1, 32, 0), ("sync", 2, 0, 0), ("hot", 1, 0, 0), ("step", 1, 32, 0), ("confirm", every, 0, 0),
        ("take", 8, 0, 0), ("sync", 2, 0, 0)])
    assert {"unpinned", "synced"} <= seen, seen


def test_the_watermark_keeps_a_waiting_request_out_as_vllm() -> None:
    """A waiting request's step that fits the pool but not the watermark above it (3 of
    12 blocks) is refused; a smaller one is taken; then steps the pool is short of."""
    seen = side_by_side(12, 16, 2, MAX_LEN, 0.25, 1, [
        ("step", 2, 80, 0), ("step", 2, 64, 0), ("step", 2, 32, 0), ("step", 1, 16, 4)])
    assert seen == {"stepped", "refused"}


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_blocks=st.integers(10, 40), host_blocks=st.integers(6, 24), hot_blocks=st.integers(1, 3),
       in_flight=st.sampled_from([16, 32, 64, MAX_LEN]), watermark=st.sampled_from([0.0, 0.1, 0.25]),
       lookahead=st.sampled_from([1, 3, BS + 1]), ops=OPS)
def test_random_streams_answer_as_vllm(num_blocks: int, host_blocks: int, hot_blocks: int, in_flight: int,
                                       watermark: float, lookahead: int,
                                       ops: list[tuple[str, int, int, int]]) -> None:
    side_by_side(num_blocks, host_blocks, hot_blocks, in_flight, watermark, lookahead, ops)


def test_the_layout_gets_the_hisparse_manager_and_its_seam() -> None:
    """``KVCacheManager(...)`` with a HiSparse host pool is the HiSparse manager, whose
    seam ``get_hisparse_coordinator`` finds; a plain layout keeps the plain class."""
    from prefixkv.integrations.vllm.hisparse import HiSparseSeam
    from prefixkv.integrations.vllm.hisparse_manager import HiSparseKVCacheManager

    ours = _plugin_manager(hisparse_config())
    assert type(ours) is HiSparseKVCacheManager
    assert isinstance(get_hisparse_coordinator(ours), HiSparseSeam)
    assert get_hisparse_coordinator(ours).state is ours.state
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    plain = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["a"], hisparse_config().kv_cache_groups[1].kv_cache_spec)])
    assert type(_plugin_manager(plain)) is KVCacheManager


@pytest.mark.parametrize(("call", "named"), [
    (lambda m, r: (setattr(r, "num_computed_tokens", 16),
                   m.allocate_slots(r, 16, num_external_computed_tokens=16)),
     "external tokens for a request holding blocks or computed tokens"),
    (lambda m, r: m.allocate_slots(r, 16, num_encoder_tokens=16), "encoder"),
    (lambda m, r: (setattr(r, "num_computed_tokens", 16), m.allocate_slots(r, 16)), "a host prefix"),
    (lambda m, r: m.block_pool.evict_blocks({1}), "block_pool.evict_blocks"),
    (lambda m, r: get_hisparse_coordinator(m).hot_managers[0].require_hot("r"), "require_hot"),
    (lambda m, r: get_hisparse_coordinator(m).complete_host_import("r", 17), "complete_host_import"),
    (lambda m, r: get_hisparse_coordinator(m).resident_managers[0].residency_changes, "residency_changes"),
    (lambda m, r: m.key_of(r.request_id), "key_of"),
])
def test_what_the_manager_does_not_serve_is_refused_by_name(call: Any, named: str) -> None:
    ours = _plugin_manager(hisparse_config())
    req = make_request("r", list(range(40)))
    with pytest.raises(UnsupportedByPrefixKV, match=named):
        call(ours, req)
    assert ours.get_block_ids("r") == ([], [], [], [])
    assert get_hisparse_coordinator(ours).get_host_block_pool().get_num_free_blocks() == 15


@pytest.mark.parametrize(("kw", "named"), [
    ({"enable_kv_cache_events": True}, "KV cache events"),
    ({"metrics_collector": object()}, "metrics collector"),
    ({"dcp_world_size": 2}, "context parallelism"),
    ({"scheduler_block_size": 2 * BS}, "block sizes"),
])
def test_options_outside_the_scope_are_refused_at_construction(kw: dict[str, Any], named: str) -> None:
    with pytest.raises(UnsupportedByPrefixKV, match=named):
        _plugin_manager(hisparse_config(), **kw)


def test_arguments_by_position_or_by_name_as_the_base_class_takes_them() -> None:
    """The base class's arguments, by position (in its order) or by name; others refused
    as Python refuses them (TypeError)."""
    ours = KVCacheManager(hisparse_config(), 128, BS, BS, None, False, False, 0, 3)  # (lookahead 3)
    assert ours.coordinator.num_reprefillable_tokens == 2
    req = make_request("r", list(range(40)))
    got = ours.allocate_slots(req, 16, 0, None, 17)  # (17 lookahead slots: 33 tokens)
    assert [len(g) for g in got.get_block_ids()] == [3, 3, 3, 0]
    with pytest.raises(TypeError):
        ours.allocate_slots(req, 16, num_lookahead_tokens=1, bogus=2)
    with pytest.raises(TypeError):
        ours.allocate_slots(req, 16, 0, num_new_computed_tokens=0)
    with pytest.raises(TypeError):
        _plugin_manager(hisparse_config(), bogus=1)


def test_every_call_of_vllms_hisparse_connector_is_served() -> None:
    """What vLLM's HiSparse connector reads of the coordinator (test_vllm_hisparse.py's
    list, pinned against the wheel's source) is all served by a bound seam: none of it
    is a refusal."""
    from .test_vllm_hisparse import CONNECTOR_CALLS

    seam = get_hisparse_coordinator(_plugin_manager(hisparse_config()))
    for name in sorted(CONNECTOR_CALLS):
        attr = getattr(seam, name)
        assert not (callable(attr) and (attr.__doc__ or "").startswith("Refused")), name

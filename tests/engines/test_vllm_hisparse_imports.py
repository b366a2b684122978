"""HiSparse external (connector) loads into host pages, three ways side by side: vLLM 0.33's
own manager and coordinator (from the wheel), the reference (hisparse_import_model.py), and
prefixkv's plug-in manager (integrations/vllm/hisparse_manager.py, its seam and
groups/hisparse/imports.py). The same ops on all three; after each, every block id of the
request, its page sets, the pending import, the restores and copies in flight, both
pools' free counts and every block's ``ref_cnt`` must agree; what ``allocate_slots``
returns, the offload commands (restores: before the forward pass) and the scheduler's
count of blocks a request needs must be vLLM's. Never a wrong KV: a page prefixkv reads
from host, or marks valid, is one the load wrote whole or a confirmed copy to host wrote.
Needs vllm installed."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from . import skip_module_without_vllm

skip_module_without_vllm()

from vllm.v1.hisparse.coordinator import get_hisparse_coordinator  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from prefixkv.groups.hisparse.row import CLEAN, UNPINNED  # noqa: E402
from prefixkv.integrations.vllm import KVCacheManager, UnsupportedByPrefixKV  # noqa: E402

from .hisparse_import_model import (  # noqa: E402
    IMPORT_SCENARIOS,
    IMPORT_STREAMS,
    ImportModel,
    import_state,
    reports,
    seeded_stream,
)
from .hisparse_model import BS, MAX_LEN, cdiv  # noqa: E402
from .test_vllm_hisparse import hisparse_config, vllm_manager  # noqa: E402
from .test_vllm_hisparse_reference import vllm_state  # noqa: E402
from .test_vllm_plugin import request as make_request  # noqa: E402


def prefixkv_state(manager: Any, rid: str) -> dict[str, Any]:
    """What ``import_state`` reads from the model, read from prefixkv's manager: its
    block ids, and the page sets its seam's ``request_states`` shows as vLLM's."""
    seam = get_hisparse_coordinator(manager)
    state = manager.state
    ids = manager.get_block_ids(rid)
    view = seam.request_states.get(rid) if state.holds(rid) else None
    held = state.holds(rid)
    return {"host_row": ids[0], "indexer": ids[1], "row": state.request(rid)[2] if held else [],
            "hot": ids[3], "hot_required": held and state.request(rid)[4],
            "valid": set(view.valid_pages) if view else set(),
            "pending": sorted(view.pending_pages) if view else [],
            "pinned_clean": set(view.pinned_clean) if view else set(),
            "unpinned": set(view.unpinned_pages) if view else set(),
            "gpu_free": manager.block_pool.get_num_free_blocks(),
            "host_free": seam.get_host_block_pool().get_num_free_blocks(),
            "in_flight": len(seam.pending_spills), "work": seam.has_pending_work(),
            "import": state.imports.pending.get(rid, 0),
            "restores": sorted(p for t, (k, p) in seam.pending_spills.items()
                               if k == rid and t in state.imports.restores)}


def _ids(blocks: Any) -> Any:
    return None if blocks is None else tuple(list(g) for g in blocks.get_block_ids())


def run(num_blocks: int, host_blocks: int, hot_blocks: int, in_flight: int, prompt: int,
        ops: list[tuple[str, int]]) -> ImportModel:
    """``ops`` on vLLM's manager, the model and prefixkv's manager (module doc)."""
    kw = {"max_model_len": MAX_LEN, "max_in_flight_tokens": in_flight}
    cfg = hisparse_config(num_blocks, host_blocks, hot_blocks=hot_blocks)
    theirs, ours = vllm_manager(cfg, **kw), KVCacheManager(cfg, scheduler_block_size=BS, hash_block_size=BS,
                                                            enable_caching=False, **kw)
    managers = (theirs, ours)
    coordinators = tuple(get_hisparse_coordinator(m) for m in managers)
    m = ImportModel(num_blocks, host_blocks, hot_blocks, cdiv(min(in_flight, MAX_LEN), BS))
    req = make_request("r", list(range(prompt)))
    taken: list[list[Any]] = [[], []]
    stepped = False  # (a step ran since the load: vLLM then forgets pages copied meanwhile)
    written: set[int] = set()  # the request's pages whose host copy is whole (loaded or copied)
    for i, (op, arg) in enumerate(ops):
        if op == "load":  # (by a new request: the one holding blocks, if any, is freed first)
            if m.host_row:
                for mg in managers:
                    mg.free(req)
                m.free()
                req = make_request(f"r{i}", list(range(prompt)))
            imported = min(abs(arg), prompt)
            got = [mg.allocate_slots(req, 0, num_external_computed_tokens=imported, delay_cache_blocks=True,
                                     full_sequence_must_fit=arg < 0) for mg in managers]
            assert _ids(got[1]) == _ids(got[0]), (i, op, arg)
            assert (got[0] is not None) == m.load(imported, prompt if arg < 0 else 0), (i, op, arg)
            if got[0] is not None:
                req.num_computed_tokens = imported
                req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                stepped = False
                written = set(range(imported // BS))
        elif op == "finish" and m.pending_import and not stepped:
            for c in coordinators:
                c.finish_host_import(req.request_id, failed=bool(arg))
            m.finish(bool(arg))
            if arg:  # (the scheduler frees a request whose load failed)
                for mg in managers:
                    mg.free(req)
                m.free()
                req = make_request(f"r{i}", list(range(prompt)))
                written = set()
            else:  # (the scheduler's: the last token of a whole prompt is computed again)
                m.computed = req.num_computed_tokens = min(m.computed, prompt - 1)
                req.status = RequestStatus.WAITING
        elif op == "step" and m.computed < prompt and (not m.pending_import or arg % 4 == 0):
            # (a request waits for its load to end; one in four steps do not, as when no
            # connector ends it)
            total = min(m.computed + arg, prompt)
            got = [mg.allocate_slots(req, total - m.computed) for mg in managers]
            assert _ids(got[1]) == _ids(got[0]), (i, op, arg)
            if got[0] is not None:
                for c in coordinators:
                    c.advance_scheduled([(req.request_id, total)])
                req.num_computed_tokens = total
                req.status = RequestStatus.RUNNING
                stepped = True
            assert (got[0] is not None) == m.step(total), (i, op, arg)
        elif op in ("confirm", "halve"):
            sent = [c.build_offload_command().page_transfers for c in coordinators]
            assert sent[1] == sent[0], (i, op, arg)
            assert [(t.transfer_id, t.resident_block_ids, t.restore, t.after_forward) for t in sent[0]] == [
                (t, (m.block_of(t),), t in m.restores, t not in m.restores) for t in m.to_send], (i, op, arg)
            m.to_send = []
            enqueued, completed = reports(m, op, arg)
            for c in coordinators:
                c.update_spills(enqueued, completed)
            copies = {t: p for t, p in m.pending.items() if t not in m.restores}
            written |= {copies[t] for t in m.report(enqueued, completed) if t in copies}
        elif op == "free":
            for mg in managers:
                mg.free(req)
            m.free()
            req = make_request(f"r{i}", list(range(prompt)))
            written = set()
        elif op == "take":
            n = min(arg, theirs.block_pool.get_num_free_blocks())
            got = [mg.block_pool.get_new_blocks(n) for mg in managers]
            assert [b.block_id for b in got[1]] == [b.block_id for b in got[0]] == m.take(n), (i, op, arg)
            taken = [taken[0] + got[0], taken[1] + got[1]]
        elif op == "give_back":
            for side, mg in enumerate(managers):
                mg.block_pool.free_blocks(taken[side])
            taken = [[], []]
            m.give_back()
        expected = import_state(m)
        got_vllm = {**vllm_state(theirs, coordinators[0], req.request_id),
                    "import": coordinators[0]._pending_imports.get(req.request_id, 0),
                    "restores": sorted(p.page[1] for p in coordinators[0].pending_spills.values()
                                       if p.restore and p.page[0] == req.request_id)}
        assert got_vllm == expected, (i, op, arg)
        assert prefixkv_state(ours, req.request_id) == expected, (i, op, arg)
        hosts = tuple(c.get_host_block_pool() for c in coordinators)
        for pools in ((theirs.block_pool, ours.block_pool), hosts):
            refs = [[b.ref_cnt for b in pool.blocks[1:]] for pool in pools]
            assert refs[1] == refs[0], (i, op)
        _check_no_wrong_kv(ours, req.request_id, written)
        ours.state.check_invariants([b for b in ours.block_pool.taken.values()])
        _check_counts(theirs, ours, req, prompt)
    return m


def _check_no_wrong_kv(manager: Any, rid: str, written: set[int]) -> None:
    """Every page prefixkv reads from host (0 in its row) or holds as a valid host copy
    (CLEAN, UNPINNED, or valid in its ``request_states``) was written whole: by the load
    (its whole pages) or by a confirmed copy to host."""
    state = manager.state
    if not state.holds(rid):
        return
    row, r = state.request(rid)[2], state.row(rid)
    view = get_hisparse_coordinator(manager).request_states.get(rid)
    read = {p for p, b in enumerate(row) if not b} | set(r.pages(CLEAN)) | set(r.pages(UNPINNED))
    assert read | (set(view.valid_pages) if view else set()) <= written, (row, written)


def _check_counts(theirs: Any, ours: Any, req: Any, prompt: int) -> None:
    """The scheduler's count of blocks a request holding blocks still needs (its
    in-flight reservation), and as an import of its computed tokens, on both."""
    if not ours.state.holds(req.request_id):
        return
    for local in {req.num_computed_tokens, 0}:
        args = dict(request_id=req.request_id, num_tokens=prompt,
                    new_computed_blocks=theirs.empty_kv_cache_blocks.blocks, num_encoder_tokens=0,
                    total_computed_tokens=req.num_computed_tokens, num_local_computed_tokens=local,
                    num_tokens_main_model=prompt, apply_admission_cap=True)
        assert ours.coordinator.get_num_blocks_to_allocate(**args) == \
            theirs.coordinator.get_num_blocks_to_allocate(**args), args


@pytest.mark.parametrize("name", sorted(IMPORT_SCENARIOS))
def test_import_scenarios_agree_three_ways(name: str) -> None:
    shape, ops, expected = IMPORT_SCENARIOS[name]
    m = run(*shape, ops)
    assert expected <= set(m.seen), m.seen


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**IMPORT_STREAMS)
def test_random_import_streams_agree_three_ways(num_blocks: int, host_blocks: int, hot_blocks: int,
                                                in_flight: int, prompt: int, ops: list[Any]) -> None:
    run(num_blocks, host_blocks, hot_blocks, in_flight, prompt, ops)


@pytest.mark.parametrize("seed", range(24))
def test_seeded_import_streams_agree_three_ways(seed: int) -> None:
    """Uniform random streams (``seeded_stream``): over the 24 seeds, restores confirmed,
    pages unpinned and lost."""
    shape, ops = seeded_stream(seed)
    run(*shape, ops)


def _load(manager: Any, req: Any, tokens: int) -> Any:
    return manager.allocate_slots(req, 0, num_external_computed_tokens=tokens, delay_cache_blocks=True,
                                  full_sequence_must_fit=True)


@pytest.mark.parametrize("side", ["vllm", "prefixkv"])
def test_a_partial_tail_is_restored_and_stays_dirty_exact_values(side: str) -> None:
    """17 tokens loaded (16 device blocks, 16 host, hot region of 2): host pages 1, 2;
    indexer 1, 2; the row null but its tail page, block 3; the hot region 4, 5 (all
    ``allocate_slots`` returns). Done: page 0 valid, the tail's restore (copy 0, host 2
    to block 3, before the forward pass); confirmed, the tail is dirty, then copied once
    the steps seal it. Both sides alike."""
    cfg = hisparse_config(16, 16)
    kw = {"max_model_len": MAX_LEN}
    manager = vllm_manager(cfg, **kw) if side == "vllm" else KVCacheManager(
        cfg, scheduler_block_size=BS, hash_block_size=BS, enable_caching=False, **kw)
    c = get_hisparse_coordinator(manager)
    req = make_request("r", list(range(3 * BS)))
    assert _ids(_load(manager, req, BS + 1)) == ([], [], [], [4, 5])
    assert manager.get_block_ids("r") == ([1, 2], [1, 2], [0, 3], [4, 5])
    assert not c.build_offload_command().page_transfers and not c.all_context_pages_resident([("r", 17, 1)])
    c.finish_host_import("r", failed=False)
    assert c.request_states["r"].valid_pages == {0} and c.request_states["r"].ready_prefix_pages == 1
    (t,) = c.build_offload_command().page_transfers
    assert (t.transfer_id, t.host_block_id, t.resident_block_ids, t.restore, t.after_forward) == \
        (0, 2, (3,), True, False)
    assert [b.ref_cnt for b in manager.get_blocks("r").blocks[2]] == [0, 2]  # (the null block; the restore's)
    c.update_spills({0: 1}, {0: 1})
    assert c.request_states["r"].pending_pages == {} and c.request_states["r"].valid_pages == {0}
    req.num_computed_tokens = BS + 1
    assert _ids(manager.allocate_slots(req, BS)) == ([3], [6], [7], [])
    c.advance_scheduled([("r", 2 * BS + 1)])
    (t,) = c.build_offload_command().page_transfers
    assert (t.transfer_id, t.host_block_id, t.resident_block_ids, t.restore) == (1, 2, (3,), False)


def test_a_step_after_a_failed_load_is_refused_until_the_request_is_freed() -> None:
    """vLLM would recompute into pages it reads from host (null in its row): refused by
    name, nothing changed; freed, every block is back."""
    ours = KVCacheManager(hisparse_config(16, 16), max_model_len=MAX_LEN, scheduler_block_size=BS,
                          hash_block_size=BS, enable_caching=False)
    c = get_hisparse_coordinator(ours)
    req = make_request("r", list(range(3 * BS)))
    assert _load(ours, req, 2 * BS + 1) is not None
    c.finish_host_import("r", failed=True)
    assert "r" not in c.request_states and not c.build_offload_command().page_transfers
    req.num_computed_tokens = BS
    before = (ours.get_block_ids("r"), ours.block_pool.get_num_free_blocks())
    with pytest.raises(UnsupportedByPrefixKV, match="whose external load failed"):
        ours.allocate_slots(req, BS)
    assert (ours.get_block_ids("r"), ours.block_pool.get_num_free_blocks()) == before
    ours.free(req)
    assert ours.block_pool.get_num_free_blocks() == 15 and c.get_host_block_pool().get_num_free_blocks() == 15
    ours.state.check_invariants()
    with pytest.raises(TypeError):
        c.request_states["r"] = None  # type: ignore[index]


@pytest.mark.parametrize(("imported", "new", "lookahead", "num_blocks"), [
    (20, 30, 0, 32), (16, 16, 3, 32), (1, 47, 2, 32), (33, 0, 5, 32), (20, 30, 0, 9), (40, 8, 0, 8)])
def test_a_load_with_new_tokens_and_lookahead_answers_as_vllm(imported: int, new: int, lookahead: int,
                                                              num_blocks: int) -> None:
    """A synchronous load (new tokens computed in the same step, lookahead slots): what
    ``allocate_slots`` takes per group (or None), the block ids, the step's copies and
    the load's end, on both managers alike."""
    cfg = hisparse_config(num_blocks, 16)
    managers = (vllm_manager(cfg, max_model_len=MAX_LEN),
                KVCacheManager(cfg, max_model_len=MAX_LEN, scheduler_block_size=BS, hash_block_size=BS,
                               enable_caching=False))
    coordinators = [get_hisparse_coordinator(m) for m in managers]  # (vLLM's: before the first admission)
    reqs = [make_request("r", list(range(64))) for _ in managers]
    got = [m.allocate_slots(r, new, num_external_computed_tokens=imported, num_lookahead_tokens=lookahead,
                            full_sequence_must_fit=True) for m, r in zip(managers, reqs, strict=True)]
    assert _ids(got[1]) == _ids(got[0])
    if got[0] is None:
        return
    assert managers[1].get_block_ids("r") == managers[0].get_block_ids("r")
    for c in coordinators:
        c.advance_scheduled([("r", imported + new)])
    for c in coordinators:
        c.finish_host_import("r", failed=False)
    sent = [c.build_offload_command().page_transfers for c in coordinators]
    assert sent[1] == sent[0]
    resident = [c.all_context_pages_resident([("r", imported + new, 1)]) for c in coordinators]
    assert resident[1] == resident[0] == (imported <= BS)  # (no page but the tail is imported)


def test_a_load_for_a_request_holding_blocks_or_computed_tokens_is_refused_with_nothing_changed() -> None:
    """A load is a request's first allocation (its host pages start at page 0): one for a
    request with computed tokens, or holding blocks already, is refused by name; nothing
    changed (mutants-r29: no test reached the refusal)."""
    ours = KVCacheManager(hisparse_config(16, 16), max_model_len=MAX_LEN, scheduler_block_size=BS,
                          hash_block_size=BS, enable_caching=False)
    c = get_hisparse_coordinator(ours)
    late = make_request("late", list(range(3 * BS)))
    late.num_computed_tokens = BS
    with pytest.raises(UnsupportedByPrefixKV, match="external tokens for a request holding blocks"):
        _load(ours, late, BS + 1)
    assert not ours.state.holds("late") and ours.block_pool.get_num_free_blocks() == 15
    held = make_request("held", list(range(3 * BS)))
    assert _ids(ours.allocate_slots(held, BS)) == ([1], [1], [2], [])
    before = (ours.get_block_ids("held"), ours.block_pool.get_num_free_blocks(),
              c.get_host_block_pool().get_num_free_blocks())
    with pytest.raises(UnsupportedByPrefixKV, match="external tokens for a request holding blocks"):
        _load(ours, held, BS + 1)
    assert (ours.get_block_ids("held"), ours.block_pool.get_num_free_blocks(),
            c.get_host_block_pool().get_num_free_blocks()) == before
    assert "held" not in ours.state.imports.pending
    ours.state.check_invariants()


@pytest.mark.parametrize("num_blocks", [7, 8])
@pytest.mark.parametrize("scheduled", [False, True])
def test_a_waiting_loads_watermark_applies_only_beside_scheduled_requests(num_blocks: int,
                                                                          scheduled: bool) -> None:
    """A 40-token load with 8 new tokens (watermark 0.25: 1 or 2 blocks kept) fits 7 or 8
    device blocks without the watermark, not with it: vLLM keeps it free only for a
    waiting request while others are scheduled. Both managers alike, exact values."""
    cfg = hisparse_config(num_blocks, 16)
    managers = (vllm_manager(cfg, max_model_len=MAX_LEN, watermark=0.25),
                KVCacheManager(cfg, max_model_len=MAX_LEN, scheduler_block_size=BS, hash_block_size=BS,
                               enable_caching=False, watermark=0.25))
    for m in managers:
        get_hisparse_coordinator(m)  # (vLLM's: before the first admission)
    got = [_ids(m.allocate_slots(make_request("r", list(range(64))), 8, num_external_computed_tokens=40,
                                 has_scheduled_reqs=scheduled)) for m in managers]
    assert got[1] == got[0] == (None if scheduled else ([], [], [], [5, 6]))

"""prefixkv's plug-in manager on a HiSparse layout with prefix caching on
(integrations/vllm/hisparse_cache.py over groups/hisparse/cache.py) against vLLM 0.33's
own manager, side by side: requests of shared prompt stems admitted with the hit both
find (``get_computed_blocks`` then ``allocate_slots`` with it), stepped and decoded, the
copies to host confirmed by one or two workers (the host prefix published as it becomes
durable), freed finished or preempted (a finished one's pages in flight published once
confirmed), another user taking and giving back device blocks (GPU copies lost) or host
blocks (published pages evicted), the cache reset. After each op every answer must be
vLLM's (test_vllm_hisparse_manager.py's ``compare``, plus each live request's host and
indexer hashes and ``ref_cnt``, the hits and the GPU copies indexed by host hash), and
never a wrong KV: every full computed page a live request reads (its host page, its
indexer page, its resident page when on the device) holds the KV of that request's
tokens, tracked here from what each step wrote (a block handed out anew holds nothing
until written). Then scenarios with exact values, and what is refused by name. Needs
vllm installed."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from . import skip_module_without_vllm

skip_module_without_vllm()

from vllm.v1.hisparse.coordinator import get_hisparse_coordinator  # noqa: E402

from prefixkv.integrations.vllm import UnsupportedByPrefixKV  # noqa: E402

from .hisparse_model import BS, MAX_LEN  # noqa: E402
from .test_vllm_block_sizes_reference import _request  # noqa: E402
from .test_vllm_hisparse import hisparse_config, vllm_manager  # noqa: E402
from .test_vllm_hisparse_manager import _ids, _plugin_manager, compare, confirm, step_tokens  # noqa: E402

STEMS = (list(range(100, 164)), list(range(500, 532)))  # (two shared prompt stems)

_ADMIT = st.tuples(st.just("admit"), st.integers(0, 2), st.integers(1, 80), st.integers(0, 7))
_CONFIRM = st.tuples(st.just("confirm"), st.integers(0, 2**16 - 1), st.just(0), st.integers(0, 1))
_FREE = st.tuples(st.just("free"), st.integers(0, 2), st.integers(0, 1), st.integers(0, 7))
OP = st.one_of(  # (admissions, confirmations and frees weighed up: hits need all three)
    _ADMIT, _ADMIT, _ADMIT, _ADMIT, _CONFIRM, _CONFIRM, _CONFIRM, _FREE, _FREE, _FREE,
    st.tuples(st.just("step"), st.integers(0, 2), st.integers(1, 48), st.integers(0, 3)),
    st.tuples(st.just("decode"), st.integers(0, 2), st.integers(1, 3), st.just(0)),
    st.tuples(st.just("confirm"), st.integers(0, 2**16 - 1), st.just(0), st.integers(0, 1)),
    st.tuples(st.just("free"), st.integers(0, 2), st.integers(0, 1), st.integers(0, 7)),
    st.tuples(st.just("reset"), st.just(0), st.just(0), st.just(0)),
    st.tuples(st.just("take"), st.integers(1, 8), st.just(0), st.integers(0, 1)),
    st.tuples(st.just("give_back"), st.just(0), st.just(0), st.just(0)),
    st.tuples(st.just("pop"), st.integers(0, 2), st.just(0), st.just(0)))
OPS = st.lists(OP, min_size=12, max_size=50)


def _prompt(k: int, variant: int) -> list[int]:
    """A prompt of stem ``variant % 2``, cut at one of a few lengths, with a tail of its own."""
    stem = STEMS[variant % 2]
    return stem[:len(stem) - 16 * (variant // 2 % 3)] + [9000 + 37 * k + variant + j for j in range(5 + k)]


class Written:
    """Which request page's KV each block of one side holds (pool, block id -> the page's
    block hash): set by the steps that compute full pages, None for a block handed out
    anew (module doc)."""

    def __init__(self) -> None:
        self.kv: dict[tuple[int, int], bytes | None] = {}

    def handed_out(self, blocks: Any) -> None:
        for g, group in enumerate(blocks.get_block_ids() if blocks is not None else ()):
            for i in group:
                self.kv[(g == 0, i)] = None

    def computed(self, m: Any, req: Any, start: int, end: int) -> None:
        host, indexer, _, _ = m.get_block_ids(req.request_id)
        row = get_hisparse_coordinator(m).resident_managers[0].get_residency_row(req.request_id)
        for page in range(start // BS, min(end // BS, len(req.block_hashes))):
            h = req.block_hashes[page]
            self.kv[(True, host[page])] = self.kv[(False, indexer[page])] = h
            if not row[page].is_null:
                self.kv[(False, row[page].block_id)] = h

    def check(self, m: Any, req: Any) -> None:
        """Every full computed page ``req`` reads holds its own KV."""
        rid = req.request_id
        host, indexer, _, _ = m.get_block_ids(rid)
        row = get_hisparse_coordinator(m).resident_managers[0].get_residency_row(rid)
        for page in range(min(req.num_computed_tokens // BS, len(req.block_hashes), len(host))):
            h = req.block_hashes[page]
            reads = [(True, host[page]), (False, indexer[page])]
            reads += [] if row[page].is_null else [(False, row[page].block_id)]
            for at in reads:
                assert self.kv.get(at) == h, f"{rid} page {page} reads {at}, which holds other KV"


@pytest.fixture(autouse=True)
def _none_hash() -> None:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)


def side_by_side(num_blocks: int, host_blocks: int, in_flight: int, reprefill: int,
                 ops: list[tuple[str, int, int, int]]) -> set[str]:
    """vLLM's manager and prefixkv's, caching on, driven alike (module doc). An op:
    ``admit`` request slot ``a`` (a new request of prompt variant ``f``) with its hit and
    ``n`` tokens more; ``step`` a live request by ``n`` (flag 1: the whole request must
    fit, 2: with 2 reserved blocks); ``decode`` one token after ``n`` output tokens;
    ``confirm`` the copies of mask ``a`` (two workers, one completing, when ``f``);
    ``free`` slot ``a``, finished when ``n`` else preempted; ``reset``; another user's
    ``take`` of ``a`` blocks (host blocks when ``f``), ``give_back`` of all it took;
    ``evict`` the hash of slot ``a``'s indexer page ``n`` (its host page when ``f``),
    held (a later hit stops there, the host hit may outlast it); ``pop`` slot ``a``'s blocks
    (finished), given back with the other user's at ``give_back``."""
    from vllm.v1.request import RequestStatus

    kw = {"max_model_len": MAX_LEN, "max_in_flight_tokens": in_flight, "enable_caching": True,
          "num_prefill_lookahead": reprefill + 1}
    cfg = hisparse_config(num_blocks, host_blocks)
    sides = vllm_manager(cfg, **kw), _plugin_manager(cfg, **kw)
    coordinators = [get_hisparse_coordinator(m) for m in sides]
    written = Written(), Written()
    reqs: list[Any] = [None, None, None]
    live: list[bool] = [False, False, False]
    loading = [0, 0, 0]  # (an external load pending, its pages unwritten: 1 asynchronous, 2 synchronous)
    seen: set[str] = set()
    starts: dict[str, int] = {}  # (a load's request -> the hit's tokens it follows)
    popped: list[list[Any]] = [[], []]  # (per side: blocks pop_blocks_for_free handed out)
    taken: dict[int, list[list[Any]]] = {0: [[], []], 1: [[], []]}  # device (0), host (1): per side
    for i, (op, a, n, f) in enumerate(ops):
        if op == "admit" and not live[a]:
            req = reqs[a] = _request(f"q{a}-{i}", _prompt(a, f), BS)
            hits = [m.get_computed_blocks(req) for m in sides]
            assert (_ids(hits[1][0]), hits[1][1:]) == (_ids(hits[0][0]), hits[0][1:]), (op, a, f)
            blocks, hit, _ = hits[0]
            n = min(n, req.num_tokens - hit)
            _counts(sides, req, hits, hit, 0, hit + n)
            args = [dict(num_new_computed_tokens=hit, new_computed_blocks=h[0]) if hit else {} for h in hits]
            got1 = sides[1].allocate_slots(req, n, **args[1])
            got0 = sides[0].allocate_slots(req, n, **args[0])
            assert _ids(got1) == _ids(got0), (op, a, n, hit)
            seen.add("hit" if hit else "no hit")
            if got0 is not None:
                live[a] = True
                _stepped(sides, coordinators, written, req, got0, got1, hit + n, hit)
                req.status = RequestStatus.RUNNING
                resident = coordinators[0].resident_managers[0]
                adopted = {b.block_id for b in resident.get_residency_row(req.request_id)[:hit // BS]} - {0}
                seen.add("adopted") if adopted else None
                if any(adopted & {b.block_id for b in resident.get_residency_row(r.request_id)}
                       for r, on in zip(reqs, live, strict=True) if on and r is not req):
                    seen.add("shared")
        elif op == "load" and not live[a]:
            reqs[a] = _request(f"q{a}-{i}", _prompt(a, f), BS)
            loading[a] = _load(sides, written, reqs[a], n, f, seen, starts)
            live[a] = bool(loading[a])
            if loading[a] == 2:  # (a synchronous load ends within its step, before any lookup)
                live[a] = _finish(sides, coordinators, written, reqs[a], int(n % 5 == 0), True, seen,
                                  starts[reqs[a].request_id])
                loading[a] = 0
        elif op == "finish" and loading[a]:
            live[a] = _finish(sides, coordinators, written, reqs[a], n % 2, loading[a] == 2, seen,
                              starts[reqs[a].request_id])
            loading[a] = 0
        elif op in ("step", "decode") and live[a] and not loading[a]:
            req = reqs[a]
            n = step_tokens(req, op, n)
            if not n:
                continue
            args = dict(full_sequence_must_fit=bool(f & 1), reserved_blocks=2 if f & 2 else 0)
            got = [m.allocate_slots(req, n, **args) for m in sides]
            assert _ids(got[1]) == _ids(got[0]), (op, a, n, args)
            if got[0] is not None:
                _stepped(sides, coordinators, written, req, got[0], got[1], req.num_computed_tokens + n,
                         req.num_computed_tokens)
            seen.add("stepped" if got[0] is not None else "refused")
        elif op == "evict" and live[a] and not loading[a]:  # (a held page's hash dropped: host when f)
            ids = sides[0].get_block_ids(reqs[a].request_id)[0 if f else 1]
            if ids:
                for pool in _pools(sides, coordinators, f):
                    pool.evict_blocks({ids[n % len(ids)]})
                seen.add("host evicted" if f else "indexer evicted")
        elif op == "confirm":
            confirm(coordinators, a, f)
        elif op == "free" and live[a]:
            reqs[a].status = RequestStatus.FINISHED_STOPPED if n else RequestStatus.PREEMPTED
            for m in sides:
                m.free(reqs[a])
            seen.add("freed loading") if loading[a] else None
            live[a], loading[a] = False, 0
            seen.add("freed finished" if n else "freed preempted")
        elif op == "pop" and live[a] and not loading[a]:  # (finished; its blocks held till given back)
            reqs[a].status = RequestStatus.FINISHED_STOPPED
            _pop(sides, reqs[a], popped, seen)
            live[a] = False
        elif op == "reset":
            done = sides[0].reset_prefix_cache()
            assert sides[1].reset_prefix_cache() == done
            seen.add(f"reset {done}")
        elif op == "take":  # (from the host pool when ``f``)
            pools = _pools(sides, coordinators, f)
            k = min(a, pools[0].get_num_free_blocks())
            for side, pool in enumerate(pools):
                got = pool.get_new_blocks(k)
                taken[f][side] += got
                ids = [b.block_id for b in got]
                written[side].handed_out(type("B", (), {"get_block_ids": lambda s, i=ids, h=f: (
                    i if h else [], [] if h else i)})())
            assert [b.block_id for b in taken[f][1]] == [b.block_id for b in taken[f][0]]
            seen.add("host taken" if f else "device taken")
        elif op == "give_back":
            for h in (0, 1):
                for side, pool in enumerate(_pools(sides, coordinators, h)):
                    pool.free_blocks(taken[h][side])
                taken[h] = [[], []]
            for side, m in enumerate(sides):
                m.block_pool.free_blocks(reversed(popped[side]))
            popped = [[], []]
        _compare(sides, coordinators, [r for r, on in zip(reqs, live, strict=True) if on], written,
                 [r.request_id for r, on in zip(reqs, loading, strict=True) if on])
        sides[1].state.check_invariants(list(sides[1].block_pool.taken.values()),
                                        list(coordinators[1].get_host_block_pool().taken.values()))
        if coordinators[0].copies:
            seen.add("copies")
    return seen


def _counts(sides: Any, req: Any, hits: Any, hit: int, ext: int, tokens: int) -> None:
    """Each side's read-only count of blocks for new request ``req`` with the hit ``hits``
    (the host hit cut as allocate_slots cuts it) and ``ext`` external tokens, to cover
    ``tokens`` tokens and the whole request (capped): the coordinator's and each group's."""
    if not hit:
        return
    answers = []
    for m, h in zip(sides, hits, strict=True):
        cut = (h[0].blocks[0][:-(-(hit + ext) // BS)], *h[0].blocks[1:])
        c, got = m.coordinator, []
        for num, cap in ((tokens, False), (min(req.num_tokens, MAX_LEN), True)):
            got.append(c.get_num_blocks_to_allocate(
                request_id=req.request_id, num_tokens=num, new_computed_blocks=cut, num_encoder_tokens=0,
                total_computed_tokens=hit + ext, num_local_computed_tokens=hit, num_tokens_main_model=num,
                apply_admission_cap=cap))
            got += [g.get_num_blocks_to_allocate(req.request_id, num, cut[i], hit + ext, hit, num, cap)
                    for i, g in enumerate(c.single_type_managers)]
        answers.append(got)
    assert answers[1] == answers[0], (hit, ext, tokens)


def _pop(sides: Any, req: Any, popped: list[list[Any]], seen: set[str]) -> None:
    """``pop_blocks_for_free`` of ``req`` on both sides (its blocks kept in ``popped``
    till ``give_back``); where prefixkv refuses it by name (a page copied or read from
    host), nothing changed there, and both free it instead."""
    ours = sides[1]
    before = ours.get_block_ids(req.request_id), ours.block_pool.get_num_free_blocks()
    try:
        got1 = ours.pop_blocks_for_free(req)
    except UnsupportedByPrefixKV:
        assert (ours.get_block_ids(req.request_id), ours.block_pool.get_num_free_blocks()) == before
        for m in sides:
            m.free(req)
        seen.add("pop refused")
        return
    got0 = sides[0].pop_blocks_for_free(req)
    assert [b.block_id for b in got1] == [b.block_id for b in got0]
    popped[0] += got0
    popped[1] += got1
    seen.add("popped")


def _pools(sides: Any, coordinators: Any, host: int) -> list[Any]:
    """Each side's device pool, or host pool when ``host``."""
    return [c.get_host_block_pool() if host else m.block_pool
            for m, c in zip(sides, coordinators, strict=True)]


def _stepped(sides: Any, coordinators: Any, written: Any, req: Any, got0: Any, got1: Any, total: int,
             start: int) -> None:
    for side, (m, c, got) in enumerate(zip(sides, coordinators, (got0, got1), strict=True)):
        written[side].handed_out(got)
        c.advance_scheduled([(req.request_id, total)])
        written[side].computed(m, req, start, total)
    req.num_computed_tokens = total


def _load(sides: Any, written: Any, req: Any, n: int, f: int, seen: set[str], starts: dict[str, int]) -> int:
    """A new request's external load of ``n`` tokens (to its whole prompt at most) as its
    first allocation, past the hit the lookup finds (none, or a hit: the host hit kept up
    to the load's pages), asynchronous (caching delayed) unless ``f`` >= 6, under the
    full-sequence gate when ``n % 3 == 0`` and with 2 reserved blocks when ``n % 4 == 0``; 0 unless
    admitted, 1 asynchronous, 2 synchronous. ``starts``: request id -> its hit's tokens
    (where the load's pages begin)."""
    from vllm.v1.request import RequestStatus

    hits = [m.get_computed_blocks(req) for m in sides]
    assert (_ids(hits[1][0]), hits[1][1:]) == (_ids(hits[0][0]), hits[0][1:]), ("load", n)
    hit = hits[0][1]
    ext = min(n, req.num_tokens - hit)
    _counts(sides, req, hits, hit, ext, hit + ext)
    args = dict(num_external_computed_tokens=ext, delay_cache_blocks=f < 6,  # (else synchronous)
                full_sequence_must_fit=n % 3 == 0, reserved_blocks=2 if n % 4 == 0 else 0)
    got = [m.allocate_slots(req, 0, **args, **(dict(num_new_computed_tokens=hit, new_computed_blocks=h[0])
                                               if hit else {})) for m, h in zip(sides, hits, strict=True)]
    assert _ids(got[1]) == _ids(got[0]), ("load", hit, ext)
    if got[0] is None:
        seen.add("load refused")
        return 0
    kept = [{(g == 0, b.block_id) for g, bs in enumerate(h[0].blocks[:2]) for b in bs} for h in hits]
    for side, m in enumerate(sides):  # (the hit's blocks keep their KV; the rest is handed out anew)
        ids = m.get_block_ids(req.request_id)
        written[side].handed_out(type("B", (), {"get_block_ids": lambda s, i=ids, k=kept[side]: tuple(
            [b for b in group if (g == 0, b) not in k] for g, group in enumerate(i))})())
    req.num_computed_tokens, starts[req.request_id] = hit + ext, hit
    req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
    seen.add(("loaded" if f < 6 else "loaded synchronously") + (" after a hit" if hit else ""))
    if hit and min(len(hits[0][0].blocks[0]), -(-(hit + ext) // BS)) > hit // BS:
        seen.add("loaded after a longer host hit")  # (host pages kept past the indexer's hit)
    return 1 if f < 6 else 2


def _finish(sides: Any, coordinators: Any, written: Any, req: Any, failed: int, sync: bool,
            seen: set[str], start: int) -> bool:
    """The connector ends ``req``'s load: failed (the scheduler frees it, no token
    valid; a synchronous load's blocks, cached at its allocation, evicted first as the
    scheduler's invalid blocks), or done (its whole pages written by the load, its tail page restored before
    the next forward, the caching wish up to the loaded tokens, then the last token of a
    whole prompt computed again); whether the request still runs. ``start``: the tokens of
    the hit the load follows (its pages are not the load's)."""
    from vllm.v1.request import RequestStatus

    for c in coordinators:
        c.finish_host_import(req.request_id, failed=bool(failed))
    if failed:
        for m in sides:
            if sync:
                indexer = m.get_block_ids(req.request_id)[1]
                m.evict_blocks(set(indexer[start // BS:req.num_computed_tokens // BS]))
            m.free(req)
        seen.add("load failed")
        return False
    ext = req.num_computed_tokens
    for side, m in enumerate(sides):
        written[side].computed(m, req, start, ext)
        m.cache_blocks(req, ext)
    req.num_computed_tokens = min(ext, req.num_tokens - 1)
    req.status = RequestStatus.WAITING
    seen.add("load done after a hit" if start else "load done")
    return True


def _compare(sides: Any, coordinators: Any, reqs: list[Any], written: Any, loading: list[str]) -> None:
    compare(sides[0], sides[1], coordinators, reqs)
    for req in reqs:
        blocks = [m.get_blocks(req.request_id).blocks for m in sides]
        for g in (0, 1):
            assert [(b.block_hash, b.ref_cnt) for b in blocks[1][g]] == \
                [(b.block_hash, b.ref_cnt) for b in blocks[0][g]], (req.request_id, g)
        for side, m in enumerate(sides):
            if req.request_id not in loading:
                written[side].check(m, req)
    copies = [{h: [b.block_id for b in bs] for h, bs in c.copies.items()} for c in coordinators]
    assert copies[1] == copies[0]
    for req in reqs:  # (the pages each side counts valid on host, where prefixkv's view shows them)
        states = [c.request_states.get(req.request_id) for c in coordinators]
        assert [None if s is None else (s.valid_pages, s.ready_prefix_pages) for s in states[1:]] == \
            [None if s is None else (s.valid_pages, s.ready_prefix_pages) for s in states[:1]], req.request_id


def test_a_hit_adopts_the_copies_that_survive_as_vllm() -> None:
    """A request published whole and freed; another of the same stem hits its host prefix
    and adopts its GPU copies; one more hits while that one runs (both rows read the
    copies); a request freed finished with copies in flight publishes them once confirmed;
    another user takes the pool's free blocks (copies lost), the next hit reads from host."""
    every = 2**16 - 1
    seen = side_by_side(40, 32, MAX_LEN, 0, [
        ("admit", 0, 64, 0), ("confirm", every, 0, 0), ("free", 0, 1, 0), ("admit", 1, 64, 0),
        ("admit", 2, 8, 0), ("confirm", every, 0, 0), ("step", 1, 8, 0), ("free", 1, 1, 2),
        ("admit", 0, 32, 1), ("free", 0, 1, 1), ("confirm", every, 0, 0), ("take", 8, 0, 0),
        ("take", 8, 0, 0), ("admit", 0, 16, 0), ("give_back", 0, 0, 0), ("reset", 0, 0, 0)])
    assert {"hit", "no hit", "adopted", "shared", "freed finished", "copies"} <= seen, seen


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_blocks=st.integers(12, 40), host_blocks=st.integers(8, 32),
       in_flight=st.sampled_from([32, 64, MAX_LEN]), reprefill=st.sampled_from([0, 0, 2]), ops=OPS)
def test_random_streams_answer_as_vllm(num_blocks: int, host_blocks: int, in_flight: int, reprefill: int,
                                       ops: list[tuple[str, int, int, int]]) -> None:
    side_by_side(num_blocks, host_blocks, in_flight, reprefill, ops)


def test_exact_values_of_a_publication_a_hit_and_its_adoption() -> None:
    """64 tokens on 16-token pages: the indexer's 4 pages cached at once, the host's
    published only as copies are confirmed (page 1 first: nothing, a prefix with a hole
    is not published; then page 0: two pages, their GPU copies indexed); a request freed
    finished with two copies in flight publishes them once confirmed (their host blocks
    held till then, no copy indexed); a hit of 3 pages (63 tokens at most) starts its row
    with the null block, takes its hot region and adopts the two copies at its step. The
    same values as vLLM's manager (checked by running both)."""
    from vllm.v1.request import RequestStatus

    ours = _plugin_manager(hisparse_config(32, 16), enable_caching=True)
    seam = get_hisparse_coordinator(ours)
    tokens = list(range(64))
    first = _request("first", tokens, BS)
    got = ours.allocate_slots(first, 64)
    assert got.get_block_ids() == ([1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8], [])
    seam.advance_scheduled([("first", 64)])
    first.num_computed_tokens = 64
    assert [b.block_hash is not None for b in ours.get_blocks("first").blocks[1]] == [True] * 4
    sent = [t.transfer_id for t in seam.build_offload_command().page_transfers]
    assert sent == [0, 1, 2, 3]
    probe = _request("probe", tokens, BS)
    for done, hit in (({1}, 0), ({0}, 32)):
        seam.update_spills(dict.fromkeys(done, 1), dict.fromkeys(done, 1))
        assert ours.get_computed_blocks(probe)[1] == hit
    first.status = RequestStatus.FINISHED_STOPPED
    ours.free(first)
    assert seam.has_pending_work() and not seam.has_pending_reclamation()  # (held to publish)
    seam.update_spills({2: 1, 3: 1}, {2: 1, 3: 1})
    blocks, hit, boundary = ours.get_computed_blocks(probe)
    assert (blocks.get_block_ids(), hit, boundary) == (([1, 2, 3], [1, 2, 3], [], []), 48, 0)
    assert sorted(b[0].block_id for b in seam.copies.values()) == [5, 6]  # (published live)
    got = ours.allocate_slots(probe, 16, num_new_computed_tokens=48, new_computed_blocks=blocks)
    assert got.get_block_ids() == ([5], [8], [7], [9, 10])
    assert ours.get_block_ids("probe") == ([1, 2, 3, 5], [1, 2, 3, 8], [0, 0, 0, 7], [9, 10])
    seam.advance_scheduled([("probe", 64)])
    row = seam.resident_managers[0].get_residency_row("probe")
    assert [b.block_id for b in row] == [5, 6, 0, 7]  # (pages 0 and 1 adopted; 2 read from host)
    assert not seam.all_context_pages_resident((("probe", 48, 16),))


def test_caching_on_gets_the_caching_class_and_a_mismatch_is_refused() -> None:
    from prefixkv.integrations.vllm.hisparse_cache import HiSparseCachingKVCacheManager
    from prefixkv.integrations.vllm.hisparse_manager import HiSparseKVCacheManager

    assert type(_plugin_manager(hisparse_config(), enable_caching=True)) is HiSparseCachingKVCacheManager
    assert type(_plugin_manager(hisparse_config())) is HiSparseKVCacheManager
    kw = {"max_model_len": 128, "scheduler_block_size": BS, "hash_block_size": BS}
    with pytest.raises(UnsupportedByPrefixKV, match="enable_caching=True"):
        HiSparseKVCacheManager(hisparse_config(), enable_caching=True, **kw)
    with pytest.raises(UnsupportedByPrefixKV, match="enable_caching=False"):
        HiSparseCachingKVCacheManager(hisparse_config(), enable_caching=False, **kw)


def test_a_stale_hit_is_refused_with_nothing_changed() -> None:
    """A hit whose indexer block was evicted between the lookup and the allocation raises
    RequestError (never a wrong KV), nothing changed."""
    from prefixkv.errors import RequestError

    ours = _plugin_manager(hisparse_config(32, 16), enable_caching=True)
    seam = get_hisparse_coordinator(ours)
    first = _request("first", list(range(64)), BS)
    ours.allocate_slots(first, 64)
    seam.advance_scheduled([("first", 64)])
    sent = {t.transfer_id: 1 for t in seam.build_offload_command().page_transfers}
    seam.update_spills(sent, sent)
    ours.free(first)
    probe = _request("probe", list(range(64)), BS)
    blocks, hit, _ = ours.get_computed_blocks(probe)
    assert hit == 48
    before = (ours.block_pool.get_num_free_blocks(), seam.get_host_block_pool().get_num_free_blocks())
    ours.evict_blocks({blocks.get_block_ids()[1][2]})
    with pytest.raises(RequestError, match="no longer hold"):
        ours.allocate_slots(probe, 16, num_new_computed_tokens=48, new_computed_blocks=blocks)
    assert (ours.block_pool.get_num_free_blocks(), seam.get_host_block_pool().get_num_free_blocks()) == before
    assert ours.get_block_ids("probe") == ([], [], [], []) and ours.get_computed_blocks(probe)[1] == 32
    ours.state.check_invariants()


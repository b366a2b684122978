"""prefixkv's vLLM plug-in beside vLLM 0.33's own ``KVCacheManager`` (from the wheel), driven
by one random request stream (Hypothesis), as vLLM's scheduler drives its manager:
admission (``get_computed_blocks`` then ``allocate_slots``, chunked), prefill chunks and
decode steps (``allocate_slots`` for a running request, outputs appended), finish
(``free``), preemption (``free``, computed tokens reset, re-admitted later), and
``reset_prefix_cache``.

What the scheduler reads must agree (SPEC.md §6): the hit on admission, whether an
allocation fits, the blocks each request holds (counts), the free count and usage,
``get_num_common_prefix_blocks``, ``reset_prefix_cache``'s answer and the prefix-cache
stats; on hybrid models (vLLM's ``HybridKVCacheCoordinator``: full attention and sliding
windows), also the null entries of each group's table (the blocks a window released).
Block ids differ by design (the order of each pool's free blocks: prefixkv takes blocks
with no content before it evicts a cached one, vLLM pops its queue's head): their
counts are compared, and hits only until the first eviction in either manager (events),
after which each depends on what each evicted; once hits differ, each side runs the
stream by its own state, and a request admitted alike on both and computed as far holds
tables as long, with the same null entries. At every step, in both managers, a hit
must be true: each block it returns holds, per a model of what every request wrote
where, the prompt's own prefix up to it (and salt, LoRA adapter, images) in its group,
and a window group's null entries lie below what the first query reads. Until hits
diverge, prefixkv keeps at least the prefix vLLM keeps of every request, evictions or
not, on one full-attention group and on the hybrid layouts (it reuses blocks without
content before it evicts, and a prefix stays findable while a copy of it is held, as
vLLM's every copy under its hash). Needs vllm installed."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")

from .test_vllm_plugin import config, full  # noqa: E402

BS = 4
MAX_LEN = 40  # vLLM's engine refuses a pool that cannot hold one request of this length
SLOTS = 4  # logical requests at a time
NULL = 0  # vLLM's null block: a window group's entries below what its queries read


@dataclass
class Side:
    """One manager, its requests (one ``Request`` per logical slot) and a model of the KV
    each block holds: block id -> (group, salt, every token up to the block's end), for
    full blocks (a block's KV in any layer depends on the whole prefix before it).
    ``windows``: what each group's queries read: None (full attention), ``("sliding",
    W)`` (the last W positions), ``("replayed", W)`` (the same, in a window never
    cached nor looked up: SWA bounded replay) or ``("chunked", C)`` (the query's own
    C-token chunk)."""

    m: Any
    windows: tuple[tuple[str, int] | None, ...] = (None,)
    reqs: dict[int, Any] = field(default_factory=dict)
    live: set[int] = field(default_factory=set)
    remote: set[int] = field(default_factory=set)  # waiting for remote KV (an async load)
    held: dict[int, tuple[Any, ...] | None] = field(default_factory=dict)
    evicted: bool = False
    diverged: bool = False  # the two hits differed (after an eviction): states apart from here
    hit: int = 0  # the last admission's
    hits: dict[int, int | None] = field(default_factory=dict)  # slot -> its admission's hit
    aligned: bool = False  # a prefill chunk but the last ends on a block boundary (vLLM's
    # scheduler beside an align-mode Mamba group: need_mamba_block_aligned_split)
    tainted: bool = False  # KV found invalid under blocks a live request computed on it

    def chunk(self, computed: int, n: int, total: int) -> int:
        """The tokens scheduled of ``n`` asked from ``computed`` (of ``total``)."""
        return n if not self.aligned or computed + n >= total else (computed + n) // BS * BS - computed

    def note_events(self) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved

        if any(isinstance(e, (BlockRemoved, AllBlocksCleared)) for e in self.m.take_events()):
            self.evicted = True

    def wrote(self, slot: int) -> None:
        """The request in ``slot`` computed its tokens up to num_computed_tokens; its
        blocks past them hold nothing known yet."""
        r = self.reqs[slot]
        for g, ids in enumerate(self.m.get_block_ids(r.request_id)):
            full = r.num_computed_tokens // BS
            for j, b in enumerate(ids):
                if b != NULL:
                    self.held[b] = _identity(r, g, (j + 1) * BS) if j < full else None

    def check_hit(self, slot: int, blocks: Any, hit: int) -> None:
        """Every block of the hit holds the prompt's prefix up to it in its group, and a
        group's null entries lie wholly below what a query at ``hit`` reads."""
        r = self.reqs[slot]
        for g, ids in enumerate(blocks.get_block_ids() if hit else [[] for _ in self.windows]):
            w = self.windows[g]
            if w is not None and w[0] == "replayed":  # (never looked up: SWA bounded replay)
                assert ids == [], (g, ids, hit)
                continue
            assert len(ids) * BS == hit, (g, ids, hit)
            reach = _first_needed(self.windows[g], hit)
            for j, b in enumerate(ids):
                if b == NULL:
                    assert (j + 1) * BS <= reach, f"group {g} lost block {j} a query at {hit} reads"
                else:
                    want = _identity(r, g, (j + 1) * BS)
                    assert self.held.get(b) == want, (
                        f"wrong KV: group {g} block {b} holds {self.held.get(b)} for block {j}: {want}")


def _identity(r: Any, g: int, end: int) -> tuple[Any, ...]:
    """What the KV of group ``g`` up to position ``end`` of request ``r`` depends on: the
    salt, the LoRA adapter, the images placed before ``end`` and every token before it."""
    images = tuple((f.identifier, f.mm_position.offset, f.mm_position.length)
                   for f in r.mm_features if f.mm_position.offset < end)
    lora = r.lora_request.lora_name if r.lora_request else None
    return (g, r.cache_salt, lora, images, *list(r.all_token_ids)[:end])


def _first_needed(window: tuple[str, int] | None, pos: int) -> int:
    """The first position a query at ``pos`` reads in a group of ``window``."""
    if window is None:
        return 0
    kind, n = window
    return max(0, pos - n + 1) if kind != "chunked" else pos - pos % n


def _managers(num_blocks: int, specs: tuple[Any, ...] | None = None, **over: Any) -> tuple[Side, Side]:
    """prefixkv's plug-in and vLLM's own manager over groups ``specs`` (one full-attention
    group by default), built with the manager's keyword arguments ``over`` too."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager as Theirs
    from vllm.v1.core.kv_cache_utils import init_none_hash

    from prefixkv.integrations.vllm import KVCacheManager as Ours

    init_none_hash(sha256)
    specs = specs or (full(BS),)
    windows = tuple(("replayed", s.sliding_window) if not s.prefix_cacheable  # (its hit slot: empty)
                    else ("sliding", s.sliding_window) if getattr(s, "sliding_window", None)
                    else ("chunked", s.attention_chunk_size) if getattr(s, "attention_chunk_size", None)
                    else ("sliding", 2) if type(s).__name__ == "MambaSpec"  # (the state before a step)
                    else None for s in specs)
    kw = dict(max_model_len=MAX_LEN, scheduler_block_size=BS, hash_block_size=BS, log_stats=True,
              enable_kv_cache_events=True) | over
    aligned = any(getattr(s, "mamba_cache_mode", None) == "align" for s in specs)
    return (Side(Ours(config(*specs, num_blocks=num_blocks), **kw), windows, aligned=aligned),
            Side(Theirs(config(*specs, num_blocks=num_blocks), **kw), windows, aligned=aligned))


IMAGES = {"cat": 3, "dog": 6}  # image -> its placeholder length (fixed by the image)


def _request(rid: str, tokens: list[int], salt: str | None, lora: str | None = None,
             image: tuple[str, int] | None = None) -> Any:
    """vLLM's Request; ``image``: (image, offset) whose placeholders replace tokens
    there (vLLM's mm_features)."""
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    tokens, mm = list(tokens), []
    if image is not None:
        name, off = image
        off = min(off, len(tokens))
        tokens[off:off] = [999] * IMAGES[name]  # (the image token id, never text here)
        mm.append(MultiModalFeatureSpec(None, "image", name, PlaceholderRange(off, IMAGES[name])))
    return Request(request_id=rid, prompt_token_ids=tokens, mm_features=mm,
                   lora_request=LoRARequest(lora, 1 + len(lora), "/" + lora) if lora else None,
                   sampling_params=SamplingParams(max_tokens=8), pooling_params=None,
                   cache_salt=salt, block_hasher=get_request_block_hasher(BS, sha256))


def _stats(m: Any) -> tuple[int, ...]:
    s = m.make_prefix_cache_stats()
    return (s.requests, s.queries, s.hits, s.preempted_requests, s.preempted_queries,
            s.preempted_hits, s.reset)


PROMPT = st.tuples(st.integers(0, 2), st.integers(0, 24), st.lists(st.integers(0, 3), max_size=9),
                   st.sampled_from([None, None, "tenant"]), st.sampled_from([None, None, None, "adapter"]),
                   st.none() | st.tuples(st.sampled_from(sorted(IMAGES)), st.integers(0, 30))).map(
    lambda p: ([100 * p[0] + k for k in range(p[1])] + p[2] or [7], *p[3:]))
OP = st.tuples(st.sampled_from(["admit", "admit", "remote", "step", "step", "step", "free", "preempt",
                                "reset", "evict"]),
               st.integers(0, SLOTS - 1), st.integers(1, 12), PROMPT, st.integers(0, 11))


def _do(sides: tuple[Side, Side], op: str, slot: int, k: int, prompt: tuple[Any, ...],
        more: int, serial: int, strict: bool) -> None:
    """``op`` on the request in ``slot`` in both managers (``_do_one``), each side by its
    own state (once hits diverged after an eviction, a request may run on one side
    only); their answers must agree until then."""
    ours, theirs = sides
    answers = [_do_one(s, op, slot, k, prompt, more, serial, strict) for s in sides]
    if op in ("admit", "remote") and answers[0] is not None and ours.hit != theirs.hit:
        # (only after an eviction: each pool evicted its own blocks, and prefixkv caches
        # what a request recomputes after evict_blocks again, where vLLM does not)
        assert not strict, (op, ours.hit, theirs.hit)
        ours.diverged = True
    if answers[0] is not None and not ours.diverged:
        assert answers[0] == answers[1], (op, answers)


def _do_one(s: Side, op: str, slot: int, k: int, prompt: tuple[Any, ...], more: int,
            serial: int, strict: bool) -> Any:
    """``op`` on the request in ``slot`` of one side; its answer (None: nothing to
    compare): ``k`` tokens scheduled at most (``remote``: ``k`` blocks a connector
    loads asynchronously past the hit, as vLLM's scheduler admits a request that then
    waits for remote KV; its next ``step`` lands them; ``evict``: the KV of its block
    ``k`` turned out invalid, and vLLM's scheduler evicts it and the request's blocks
    after it, then recomputes from there); ``more``: the lookahead slots (``more % 4``)
    and the blocks to keep free (``reserved_blocks``, ``more // 4``)."""
    from vllm.v1.request import RequestStatus

    present = slot in s.reqs and not s.reqs[slot].is_finished()
    live = slot in s.live
    if op in ("admit", "remote") and not present:  # a new request arrives
        s.reqs[slot] = _request(f"r{serial}", *prompt)
    r = s.reqs.get(slot)
    if op == "admit" and not live:
        blocks, hit, junction = s.m.get_computed_blocks(r)
        s.check_hit(slot, blocks, hit)
        n = s.chunk(hit, min(k, r.num_tokens - hit), r.num_tokens)  # a chunk of the step's budget
        if n <= 0:
            return None
        new = s.m.allocate_slots(r, n, hit, blocks, num_lookahead_tokens=more % 4,
                                 reserved_blocks=more // 4)
        s.hit, s.hits[slot] = hit, hit
        if new is not None:
            s.m.record_prefix_cache_stats(r, hit)
            r.status = RequestStatus.RUNNING
            r.num_computed_tokens = hit + n
            s.live.add(slot)
            s.wrote(slot)
            if r.num_computed_tokens == r.num_tokens:
                r.append_output_token_ids(1000 + serial)
        # (the shared-prefix junction: prefixkv reports it beside a Mamba group only)
        return (hit if strict else None, junction if strict and s.aligned else None, new is None)
    if op == "remote" and not live:
        blocks, hit, _ = s.m.get_computed_blocks(r)
        s.check_hit(slot, blocks, hit)
        ext = min(k, (r.num_tokens - hit) // BS) * BS
        new = None if not ext else s.m.allocate_slots(
            r, 0, hit, blocks, num_external_computed_tokens=ext, delay_cache_blocks=True,
            reserved_blocks=more // 4, skip_zeroing_group_ids=(0,) if more % 2 else ())
        s.hit, s.hits[slot] = hit, hit
        if new is not None:
            s.m.record_prefix_cache_stats(r, hit)
            r.status, r.num_computed_tokens = RequestStatus.WAITING_FOR_REMOTE_KVS, hit + ext
            s.live.add(slot)
            s.remote.add(slot)
        return (hit if strict else None, ext if strict else None, new is None)
    if op == "step" and slot in s.remote:  # the load landed (_update_waiting_for_remote_kv)
        s.m.cache_blocks(r, r.num_computed_tokens)
        s.wrote(slot)
        s.remote.discard(slot)
        r.status = RequestStatus.WAITING
        if r.num_computed_tokens == r.num_tokens:
            r.num_computed_tokens -= 1
    elif op == "step" and live and r.num_tokens < MAX_LEN - 1:
        n = s.chunk(r.num_computed_tokens, min(k, r.num_tokens - r.num_computed_tokens), r.num_tokens)
        if n <= 0:
            return None
        new = s.m.allocate_slots(r, n, num_lookahead_tokens=more % 4, reserved_blocks=more // 4)
        if new is not None:
            r.status = RequestStatus.RUNNING
            r.num_computed_tokens += n
            s.wrote(slot)
            if r.num_computed_tokens == r.num_tokens:
                r.append_output_token_ids(1000 + serial)
        return new is None
    elif op in ("free", "preempt") and live and not (op == "preempt" and slot in s.remote):
        if op == "free":  # (vLLM marks it finished, then frees it)
            r.status = RequestStatus.FINISHED_STOPPED
        s.m.free(r)
        s.live.discard(slot)
        s.remote.discard(slot)
        if op == "preempt":
            r.status, r.num_computed_tokens = RequestStatus.PREEMPTED, 0
            r.num_preemptions += 1
    elif op == "evict" and live and slot not in s.remote:
        # (vLLM's _update_requests_with_invalid_blocks, _handle_invalid_blocks)
        rows = s.m.get_block_ids(r.request_id)
        j = min(k, r.num_computed_tokens // BS)
        # not where the recompute would read what a window released: vLLM reads its null
        # block there (test_vllm_hybrid_reference.py: ..._reads_the_null_block_in_both)
        reads = [_first_needed(w, j * BS) // BS for w in s.windows]
        if j < len(rows[0]) and all(NULL not in ids[a:j] for a, ids in zip(reads, rows, strict=True)):
            gone = {b for ids in rows for b in ids[j:] if b != NULL}
            s.tainted = s.tainted or _computed_on(s, slot, gone)
            s.m.evict_blocks(gone)
            for b in gone:
                s.held[b] = None
            r.num_computed_tokens = min(r.num_computed_tokens, j * BS)
    elif op == "reset":
        before = _free_order(s)
        done = s.m.reset_prefix_cache()
        if done:
            s.held.clear()
            # vLLM's reset drops the hashes and keeps its free queue; prefixkv's keeps
            # its free order too (tests/engines/test_vllm_reset_order.py: block for block)
            assert _free_order(s) == before, (before, _free_order(s))
        return done
    return None


def _computed_on(s: Side, slot: int, gone: set[int]) -> bool:
    """Whether KV was or will be computed on the KV of ``gone`` (found invalid by the
    request in ``slot``), which prefixkv forgets and vLLM keeps findable, reached again
    once the invalid block is recomputed: another live request holds one of ``gone``
    (it reads it as it goes on, a partial block or the next ones: this model's evict
    sets back the slot's request only, where vLLM's scheduler sets back every request
    of the step that holds the block), or a block outside ``gone`` holds a content that
    continues one of theirs (computed on it, by a request live or gone since: prefixkv
    forgets a lost content's cached descendants, vLLM keeps their hashes)."""
    for q in s.live - {slot}:
        if any(b in gone for ids in s.m.get_block_ids(s.reqs[q].request_id) for b in ids):
            return True
    lost = [s.held[b] for b in gone if s.held.get(b) is not None]
    return any(h is not None and b not in gone and any(_continues(h, k) for k in lost)
               for b, h in s.held.items())


def _continues(h: tuple[Any, ...], k: tuple[Any, ...]) -> bool:
    """Whether content ``h`` (an ``_identity``) lies past content ``k`` on one chain: the
    same group, salt and adapter, ``k``'s images and tokens a prefix of ``h``'s."""
    return (h[:3] == k[:3] and h[3][:len(k[3])] == k[3] and len(h) > len(k)
            and h[4:len(k)] == k[4:])


def _free_order(s: Side) -> list[int]:
    """vLLM block ids in the order the side's pool hands them out."""
    m = s.m
    if hasattr(m, "core"):  # prefixkv's plug-in: its core's ids, shifted to vLLM's
        return [i + m._blocks.offset for i in m.core.free_block_order()]
    return [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]


def _compare(sides: tuple[Side, Side], same_hits: bool) -> None:
    ours, theirs = sides
    if ours.diverged:  # each side's own hits checked true in _do; the counts differ, but
        # a request that both sides admitted with the same hit and ran alike since (the
        # same computed tokens) holds a table as long, with the same null entries
        for slot in ours.live & theirs.live:
            r, v = ours.reqs[slot], theirs.reqs[slot]
            if ours.hits.get(slot) != theirs.hits.get(slot) or r.num_computed_tokens != v.num_computed_tokens:
                continue
            mine, vllms = ours.m.get_block_ids(r.request_id), theirs.m.get_block_ids(v.request_id)
            assert [len(g) for g in mine] == [len(g) for g in vllms], (r.request_id, mine, vllms)
            assert [g.count(NULL) for g in mine] == [g.count(NULL) for g in vllms], (
                r.request_id, mine, vllms)
        ours.m.core.check_invariants()
        for s in sides:
            s.m.take_new_block_ids()
        return
    assert ours.m.block_pool.get_num_free_blocks() == theirs.m.block_pool.get_num_free_blocks()
    # the blocks to zero (needs_kv_cache_zeroing: beside Mamba, or mixed precisions), as many
    zeroed = [s.m.take_new_block_ids() for s in sides]
    assert len(zeroed[0]) == len(zeroed[1]), zeroed
    assert ours.m.usage == pytest.approx(theirs.m.usage)
    for slot in ours.live:
        rid = ours.reqs[slot].request_id
        mine, vllms = ours.m.get_block_ids(rid), theirs.m.get_block_ids(rid)
        assert [len(g) for g in mine] == [len(g) for g in vllms], (rid, mine, vllms)
        # where the null entries are (a Mamba group's lie between its blocks too)
        assert [[b == NULL for b in g] for g in mine] == [[b == NULL for b in g] for g in vllms], (
            rid, mine, vllms)
        assert ours.m.get_num_common_prefix_blocks(rid) == theirs.m.get_num_common_prefix_blocks(rid)
        cached = [s.m.estimate_cached_tokens(s.reqs[slot]) for s in sides]
        assert cached[0] == cached[1], (rid, cached)
        n = ours.reqs[slot].num_computed_tokens
        assert [len(g) for g in ours.m.get_block_ids_for_computed_tokens(rid, n)] == [
            len(g) for g in theirs.m.get_block_ids_for_computed_tokens(rid, n)]
    stats = [_stats(s.m) for s in sides]
    assert stats[0] == stats[1] or not same_hits, stats
    ours.m.core.check_invariants()
    # prefixkv keeps every prefix vLLM keeps, evictions or not, on every layout (a copy
    # vLLM finds under its hash, prefixkv finds as a spare that took over: groups/index.py),
    # until KV found invalid had blocks computed on it (vLLM keeps those: not a true prefix)
    if theirs.tainted:
        return
    from prefixkv.integrations.vllm.requests import core_tokens, extra_keys_of

    for slot, r in ours.reqs.items():
        v = theirs.reqs[slot]
        mine = ours.m.core.lookup(core_tokens(r), extra=extra_keys_of(r, BS))
        vllms = theirs.m.coordinator.find_longest_cache_hit(v.block_hashes, v.num_tokens - 1)[1]
        assert mine >= vllms, (f"vLLM keeps {vllms} tokens of {list(r.all_token_ids)} "
                               f"cached, prefixkv {mine}")


@settings(max_examples=40, deadline=None)
@given(num_blocks=st.integers(MAX_LEN // BS + 1, 30), ops=st.lists(OP, min_size=8, max_size=40))
def test_prefixkv_and_vllms_manager_agree_on_what_the_scheduler_reads(num_blocks, ops):
    sides = _managers(num_blocks)
    for serial, (op, slot, k, prompt, more) in enumerate(ops):
        strict = not (sides[0].evicted or sides[1].evicted)
        _do(sides, op, slot, k, prompt, more, serial, strict)
        for s in sides:
            s.note_events()
        _compare(sides, strict)


@pytest.mark.parametrize("keep", ["reserved_blocks", "watermark"])
def test_an_admission_that_keeps_blocks_free_counts_only_the_hit_blocks_it_takes_from_them(keep):
    # a running request holds 9 of 11 blocks; another hits its 8 full ones (held: none
    # comes out of the free ones) and needs 1 new block, keeping 1 free: it fits (vLLM's
    # answer), where prefixkv counted every hit block as taken from the free ones
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager as Theirs
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.request import RequestStatus

    from prefixkv.integrations.vllm import KVCacheManager as Ours

    init_none_hash(sha256)
    kw: dict[str, Any] = dict(max_model_len=MAX_LEN, scheduler_block_size=BS, hash_block_size=BS)
    if keep == "watermark":
        kw["watermark"] = 1 / 12  # one block of 12
    answers = []
    for cls in (Ours, Theirs):
        m = cls(config(full(BS), num_blocks=12), **kw)
        a, b = _request("a", list(range(33)), None), _request("b", [*range(32), 99], None)
        assert m.allocate_slots(a, 33) is not None
        a.status, a.num_computed_tokens = RequestStatus.RUNNING, 33
        blocks, hit, _ = m.get_computed_blocks(b)
        assert (hit, m.block_pool.get_num_free_blocks()) == (32, 2)
        new = m.allocate_slots(b, 1, hit, blocks, reserved_blocks=1 if keep == "reserved_blocks" else 0)
        answers.append(None if new is None else (len(new.get_block_ids()[0]),
                                                 m.block_pool.get_num_free_blocks()))
    assert answers[0] == answers[1] == (1, 1)


def _pair(**kw: Any) -> list[Any]:
    """prefixkv's plug-in and vLLM's own manager, 12 blocks of BS tokens each."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager as Theirs
    from vllm.v1.core.kv_cache_utils import init_none_hash

    from prefixkv.integrations.vllm import KVCacheManager as Ours

    init_none_hash(sha256)
    kw = dict(max_model_len=MAX_LEN, scheduler_block_size=BS, hash_block_size=BS) | kw
    return [cls(config(full(BS), num_blocks=12), **kw) for cls in (Ours, Theirs)]


@pytest.mark.parametrize("evict", [[3, 4, 5, 6, 7, 8], [1], [0, 7], [7]])
def test_the_cached_token_estimate_leaves_out_blocks_evict_blocks_uncached(evict):
    # a holds 9 blocks (8 cached), b hit a's first 8; blocks at these indexes of a turn out
    # invalid (a failed load): vLLM's estimate is the end of the last block still cached,
    # for both requests. Before: prefixkv said 32 whatever was evicted.
    from vllm.v1.request import RequestStatus

    answers = []
    for m in _pair():
        a, b = _request("a", list(range(33)), None), _request("b", [*range(32), 99], None)
        assert m.allocate_slots(a, 33) is not None
        a.status, a.num_computed_tokens = RequestStatus.RUNNING, 33
        blocks, hit, _ = m.get_computed_blocks(b)
        assert m.allocate_slots(b, 1, hit, blocks) is not None
        ids = m.get_block_ids("a")[0]
        m.evict_blocks({ids[j] for j in evict})
        answers.append([m.estimate_cached_tokens(r) for r in (a, b)])
        m.free(b)
        m.free(a)  # freed and admitted again: its new blocks count again
        a.status, a.num_computed_tokens = RequestStatus.WAITING, 0
        blocks, hit, _ = m.get_computed_blocks(a)
        assert m.allocate_slots(a, 33 - hit, hit, blocks) is not None
        answers[-1].append(m.estimate_cached_tokens(a))
    assert answers[0] == answers[1], answers
    last = max((j + 1 for j in range(8) if j not in evict), default=0) * BS
    assert answers[0][:2] == [last, last]


def test_a_block_of_one_token_whose_load_is_pending_is_not_a_hit():
    # block_size 1, an async load of 8 tokens: prefixkv schedules one token at admission,
    # which filled block 0 and made it findable before its KV landed: b hit it (wrong KV,
    # or none if the load then failed). vLLM caches nothing of a load before it lands.
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager as Theirs
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.request import Request, RequestStatus

    from prefixkv.integrations.vllm import KVCacheManager as Ours

    init_none_hash(sha256)
    spec = FullAttentionSpec(block_size=1, num_kv_heads=1, head_size=1, dtype=torch.float32)

    def make(rid: str) -> Any:
        return Request(request_id=rid, prompt_token_ids=list(range(10)), pooling_params=None,
                       sampling_params=_request("x", [1], None).sampling_params,
                       block_hasher=get_request_block_hasher(1, sha256))

    answers = []
    for cls in (Ours, Theirs):
        m = cls(config(spec, num_blocks=40), max_model_len=MAX_LEN, scheduler_block_size=1, hash_block_size=1)
        a, b = make("a"), make("b")
        assert m.allocate_slots(a, 0, num_external_computed_tokens=8, delay_cache_blocks=True) is not None
        a.status, a.num_computed_tokens = RequestStatus.WAITING_FOR_REMOTE_KVS, 8
        pending = m.get_computed_blocks(b)[1]
        m.cache_blocks(a, 8)  # the load landed
        answers.append((pending, m.get_computed_blocks(b)[1]))
    assert answers[0][0] == answers[1][0] == 0
    assert (answers[0][1], answers[1][1]) == (0, 8)  # prefixkv: block 0 stays uncached (a miss)


@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("n", [1, 3])
def test_the_cached_token_estimate_of_a_pending_load_of_one_token_blocks_is_0(window, n):
    # block_size 1, an n-token prompt loaded asynchronously: nothing is cached before the
    # load lands (vLLM: 0). Before: prefixkv said 1, the block of the one token it
    # schedules at admission (uncached, as the test above shows). The Hypothesis run of
    # the hybrid reference at block_size 1 found it.
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager as Theirs
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
    from vllm.v1.request import Request, RequestStatus

    from prefixkv.integrations.vllm import KVCacheManager as Ours

    init_none_hash(sha256)
    kw: dict[str, Any] = dict(block_size=1, num_kv_heads=1, head_size=1, dtype=torch.float32)
    specs = [FullAttentionSpec(**kw)] + ([SlidingWindowSpec(**kw, sliding_window=window)] if window else [])
    answers = []
    for cls in (Ours, Theirs):
        m = cls(config(*specs, num_blocks=40), max_model_len=MAX_LEN, scheduler_block_size=1,
                hash_block_size=1)
        a = Request(request_id="a", prompt_token_ids=[7] * n, pooling_params=None,
                    sampling_params=_request("x", [1], None).sampling_params,
                    block_hasher=get_request_block_hasher(1, sha256))
        assert m.allocate_slots(a, 0, num_external_computed_tokens=n, delay_cache_blocks=True) is not None
        a.status, a.num_computed_tokens = RequestStatus.WAITING_FOR_REMOTE_KVS, n
        answers.append([m.estimate_cached_tokens(a)])
        m.cache_blocks(a, n)  # the load landed
        answers[-1].append(m.estimate_cached_tokens(a))
    # once it landed: the same, but where the load's one block is the one prefixkv
    # scheduled at admission: it stays uncached (docs/integration.md), its estimate 0
    assert answers == [[0, n if n > 1 else 0], [0, n]]


def test_a_prompt_past_max_model_len_is_refused_before_any_change():
    # vLLM's input processor refuses it; its manager, given one, gives slots for 40 of its
    # 48 tokens (with KV events on, it raises IndexError while caching them): no answer a
    # scheduler could run. Before: prefixkv took 12 blocks past the 40-token limit.
    from prefixkv.errors import PromptTooLongError

    ours, theirs = _pair()
    r = _request("a", list(range(MAX_LEN + 8)), None)
    assert len(theirs.allocate_slots(r, MAX_LEN + 8).get_block_ids()[0]) == 10
    theirs.free(r)
    before = (ours.block_pool.get_num_free_blocks(), ours.live_request_ids(), ours.usage)
    for n in (MAX_LEN + 8, 8):  # the whole prompt, or a first chunk of it
        with pytest.raises(PromptTooLongError, match=r"48 tokens needs at least 12 blocks, "
                                                      r"and the pool has 10 for a request "
                                                      r"\(max_model_len=40 tokens\)"):
            ours.allocate_slots(r, n)
    assert (ours.block_pool.get_num_free_blocks(), ours.live_request_ids(), ours.usage) == before
    ours.core.check_invariants()
    at_limit = _request("b", list(range(MAX_LEN)), None)  # vLLM's pooling runner takes these
    assert [len(m.allocate_slots(at_limit, MAX_LEN).get_block_ids()[0]) for m in (ours, theirs)] \
        == [10, 10]


@pytest.mark.parametrize("evict", [[5, 6, 7, 8], [7], [2]])
def test_the_estimate_after_evict_blocks_agrees_on_a_hybrid_model(evict):
    # a full-attention and a 16-token sliding-window group: the window's first blocks are
    # the null block by now, which holds no cached content either
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager as Theirs
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.kv_cache_interface import SlidingWindowSpec
    from vllm.v1.request import RequestStatus

    from prefixkv.integrations.vllm import KVCacheManager as Ours

    init_none_hash(sha256)
    window = SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32,
                               sliding_window=16)
    answers = []
    for cls in (Ours, Theirs):
        m = cls(config(full(BS), window, num_blocks=30), max_model_len=MAX_LEN,
                scheduler_block_size=BS, hash_block_size=BS)
        a = _request("a", list(range(33)), None)
        assert m.allocate_slots(a, 33) is not None
        a.status, a.num_computed_tokens = RequestStatus.RUNNING, 33
        before = m.estimate_cached_tokens(a)
        ids = m.get_block_ids("a")
        m.evict_blocks({g[j] for g in ids for j in evict if g[j]})
        answers.append((before, m.estimate_cached_tokens(a)))
    assert answers[0] == answers[1], answers


@pytest.mark.parametrize("mixed", [False, True])
def test_prompts_whose_embeddings_share_a_prefix_hit_it_as_in_vllm(mixed):
    # two prompts fed by embeddings (prompt_embeds), equal in their first 34 positions:
    # vLLM hashes each block's own rows, so b hits a's first 8 blocks. Before: prefixkv
    # keyed every block by a digest of the whole prompt's embeddings and hit nothing.
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request, RequestStatus

    def make(rid: str, last: float, tokens: list[bool] | None) -> Any:
        embeds = torch.arange(80.0).reshape(40, 2)
        embeds[35:] += last
        ids = None
        if tokens is not None:  # a mixed prompt: token ids where the mask says so
            ids = [7 if t else 0 for t in tokens]
            embeds[torch.tensor(tokens)] = 0
        return Request(request_id=rid, prompt_token_ids=ids, prompt_embeds=embeds,
                       prompt_is_token_ids=tokens, sampling_params=SamplingParams(max_tokens=8),
                       pooling_params=None, block_hasher=get_request_block_hasher(BS, sha256))

    mask = [i % 3 == 0 for i in range(40)] if mixed else None
    answers = []
    for m in _pair():
        a = make("a", 0.0, mask)
        assert m.allocate_slots(a, 40) is not None
        a.status, a.num_computed_tokens = RequestStatus.RUNNING, 40
        hits = [m.get_computed_blocks(make("b", 1.0, mask))[1],  # differs from position 35
                m.get_computed_blocks(make("c", 0.0, mask))[1]]  # the same prompt
        if mixed:  # position 3 read a token in a, an embedding in d
            other = [i % 3 == 0 and i != 3 for i in range(40)]
            hits.append(m.get_computed_blocks(make("d", 0.0, other))[1])
        answers.append(hits)
    assert answers[0] == answers[1] == ([32, 36, 0] if mixed else [32, 36]), answers


def test_the_events_extra_keys_have_vllms_shape_block_by_block():
    # vLLM 0.33 publishes per block: the LoRA name, (identifier, offset minus the block's
    # first token) for each image overlapping it, the salt on the first block only
    # (kv_cache_utils.to_event_extra_keys). Before: absolute offsets, and the salt on
    # every block, so a consumer that reads vLLM's keys (llm-d) saw other keys.
    from vllm.distributed.kv_events import BlockStored

    got = []
    for m in _pair(enable_kv_cache_events=True):
        r = _request("r", list(range(1, 24)), "tenant-x", lora="sql", image=("dog", 6))
        m.get_computed_blocks(r)
        assert m.allocate_slots(r, r.num_tokens) is not None
        stored = [e for e in m.take_events() if isinstance(e, BlockStored)]
        got.append(([k for e in stored for k in e.extra_keys],
                    [(e.lora_name, e.lora_id) for e in stored]))
    assert got[0] == got[1], got


def test_the_events_keys_of_a_salted_embedded_prompt_have_vllms_shape():
    # per block: the salt (first block only) then the block's embeddings digest, bare
    # bytes of 32 (the digests differ: prefixkv's also covers the token/embedding mask)
    from vllm.distributed.kv_events import BlockStored
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    shapes = []
    for m in _pair(enable_kv_cache_events=True):
        r = Request(request_id="e", prompt_token_ids=None, prompt_embeds=torch.arange(24.0).reshape(12, 2),
                    sampling_params=SamplingParams(max_tokens=8), pooling_params=None,
                    cache_salt="tenant-x", block_hasher=get_request_block_hasher(BS, sha256))
        m.get_computed_blocks(r)
        assert m.allocate_slots(r, r.num_tokens) is not None
        keys = [k for e in m.take_events() if isinstance(e, BlockStored) for k in e.extra_keys]
        shapes.append([tuple(x if isinstance(x, str) else (type(x).__name__, len(x)) for x in k)
                       for k in keys])
    assert shapes[0] == shapes[1] == [("tenant-x", ("bytes", 32))] + [(("bytes", 32),)] * 2, shapes

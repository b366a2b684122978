"""tests/sized_model.py's reference of a hybrid manager with groups of DIFFERENT block
sizes, driven beside vLLM 0.33's own ``KVCacheManager`` (from the wheel) by one random
stream of admissions (with their hits, in chunks), prefill chunks, decode steps, frees and
resets: after every call the two hold the same block ids in every group's table, the same
free queue (ids, in order), the same keys cached (each with as many holders) and give the
same hit; with EAGLE too (``use_eagle``, some groups flagged ``is_eagle_group`` or none:
the reference's ``peek``), on the layouts vLLM finds its hit for in one pass (two specs at
most, full attention one of them when two: the plug-in's ``eagle_layout``). Calls the
reference refuses (short of blocks) are not made on vLLM (it releases a window's blocks
before it refuses; prefixkv does not). The reference with prefixkv's twin rule (``twins``:
a second block caching a key is a spare of its holder) is held to vLLM's too, exactly,
until it frees a twin (which it empties: vLLM keeps the copy cached); a concrete run past
twins holds prefixkv's manager beside the three. This checks the reference that
tests/test_groups_sizes_machine.py holds prefixkv's manager to. Needs vllm installed."""

from __future__ import annotations

import math
import os
from collections import Counter
from functools import reduce
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sized_model import SizedModel

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")

from .test_vllm_block_sizes_reference import LAYOUTS, MAMBA_LAYOUTS, _request, _spec, _vllm  # noqa: E402

# EAGLE layouts: (groups, is_eagle_group flags; all False: vLLM flags every group). No
# peeking full-attention group is larger than the hash block: vLLM would register the
# whole prompt's last hash boundary as a partial entry of a block not full yet (promoted
# when it fills), which neither the reference nor prefixkv's manager serve.
EAGLE = {
    "full32+window8@8, the window flagged": (((32, None), (8, 8)), (False, True)),
    "full32+two windows8@8, one flagged": (((32, None), (8, 8), (8, 8)), (False, False, True)),
    "full8+window20@16": (((8, None), (16, 20)), (False, False)),
    "window10@8+full16, the window flagged": (((8, 10), (16, None)), (True, False)),
    "full8+full24, the first flagged": (((8, None), (24, None)), (True, False)),
    "window20@16+full24, the window flagged": (((16, 20), (24, None)), (True, False)),
    "full8+window40@16, the full flagged": (((8, None), (16, 40)), (True, False)),
    "window9@16+full8": (((16, 9), (8, None)), (False, False)),  # (need 2 >= 1 block a boundary)
    # (a run from block 0 shorter than a peeking window's need: vLLM's hit falls a span lower)
    "full16+window40@8, the window flagged": (((16, None), (8, 40)), (False, True)),
}

# vLLM's fine-grained partial hits (a Mamba group larger than the hash block, every
# other group full attention of the hash block's size): the reference's ``partial``
PARTIAL = {
    "full8+mamba16": ((8, None), (16, "mamba")),
    "mamba24+full8": ((24, "mamba"), (8, None)),
    "mamba32+full8+mamba32": ((32, "mamba"), (8, None), (32, "mamba")),
}
# ... and full attention larger than the hash block (vLLM then finds hits inside its
# blocks too, copied on write): (groups, hash block)
PARTIAL_FULL = {
    "full4+mamba4, hash 2": (((4, None), (4, "mamba")), 2),
    "full8+mamba16, hash 4": (((8, None), (16, "mamba")), 4),
    "full16+mamba8, hash 4": (((16, None), (8, "mamba")), 4),
    "full8+mamba8+full8, hash 2": (((8, None), (8, "mamba"), (8, None)), 2),
}

MAX_LEN = 96  # (the longest request: a prompt of 72, decoded up to it)
STEMS = [[100 * s + k for k in range(60)] for s in range(3)]
PROMPT = st.tuples(st.integers(0, 2), st.integers(0, 60), st.lists(st.integers(0, 2), max_size=12)).map(
    lambda p: STEMS[p[0]][:p[1]] + p[2] or [7])
OP = st.one_of(
    st.tuples(st.just("add"), PROMPT, st.none() | st.integers(1, 40)),
    # an admitted request's tokens (as it left, or as they are) cut short and sent on:
    # past the aligned hit, the new one recomputes blocks the first cached (twins)
    st.tuples(st.just("again"), st.tuples(st.integers(0, 5), st.integers(1, 30)),
              st.none() | st.integers(1, 40)),
    st.tuples(st.just("extend"), st.integers(0, 5), st.integers(1, 40)),
    st.tuples(st.just("decode"), st.integers(0, 5), st.lists(st.integers(0, 2), min_size=1, max_size=20)),
    st.tuples(st.just("free"), st.integers(0, 5), st.just(0)),
    # vLLM's scheduler sets a request's computed tokens back by b (a load whose last
    # token it recomputes, a failed load) and schedules them again: the references'
    # ``rewind`` then ``grow``
    st.tuples(st.just("recompute"), st.integers(0, 5), st.integers(1, 30)),
    st.tuples(st.just("reset"), st.just(0), st.just(0)),
)


class Pair:
    """vLLM's manager and the reference, the requests each holds, and a mirror of what
    vLLM's events say is cached: {key: holders}."""

    def __init__(self, groups: Any, num_blocks: int, flags: tuple[bool, ...] | None = None,
                 retained: tuple[int, ...] = (), partial: bool = False, hash_size: int = 0,
                 retention: int | None = None) -> None:
        self.groups = groups
        self.retention = retention  # (vLLM's prefix_cache_retention_interval)
        self.partial = partial
        # vLLM's align-mode scheduler ends a chunk at a Mamba block's end (or the
        # prompt's), and each step starts a new one (no hit on a state cached in it)
        self.mamba = [b for b, w in groups if w == "mamba"]
        self.h = hash_size or reduce(math.gcd, (b for b, _ in groups))
        self.lcm = reduce(math.lcm, (b for b, _ in groups))
        self.twins: SizedModel | None = None
        if partial:
            self.v = _vllm(groups, self.h, self.lcm, num_blocks, events=True)
            assert self.v.coordinator.enable_partial_hash_hits
            self.model = SizedModel(groups, num_blocks, self.h, self.lcm, partial=True)
        elif flags is None:
            self.v = _vllm(groups, self.h, self.lcm, num_blocks, events=True, retained=retained,
                           retention=retention)
            self.model = SizedModel(groups, num_blocks, self.h, self.lcm, retained=retained,
                                    retention=retention)
            self.twins = SizedModel(groups, num_blocks, self.h, self.lcm, twins=True, retained=retained,
                                    retention=retention)
        else:
            self.v = _eagle_vllm(groups, flags, self.h, self.lcm, num_blocks)
            peek = flags if any(flags) else (True,) * len(groups)
            self.model = SizedModel(groups, num_blocks, self.h, self.lcm, peek=peek)
        self.reqs: dict[str, Any] = {}
        self.names: dict[Any, tuple[int, ...]] = {}  # vLLM's hash -> the tokens it chains over
        self.mirror: Counter[Any] = Counter()
        self.serial = 0
        self.sent: list[Any] = []  # every request admitted

    def _name(self, r: Any) -> None:
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        tokens = list(r.all_token_ids)
        for i, h in enumerate(r.block_hashes):
            self.names[maybe_convert_block_hash(h)] = tuple(tokens[:(i + 1) * self.h])

    def note_events(self) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        for e in self.v.take_events():
            if isinstance(e, AllBlocksCleared):
                self.mirror.clear()
                continue
            assert isinstance(e, BlockStored | BlockRemoved), e
            b = self.groups[e.group_idx][0]
            if self.partial and isinstance(e, BlockStored):
                self._check_stored(e, b)
            for h in e.block_hashes:
                tokens = self.names[h]
                if len(tokens) % b and not self.partial:  # (a partial tail entry: not modelled)
                    continue
                key = (e.group_idx, None, tokens)
                self.mirror[key] += 1 if isinstance(e, BlockStored) else -1
                if not self.mirror[key]:
                    del self.mirror[key]

    def _check_stored(self, e: Any, b: int) -> None:
        """With partial hits, the shape vLLM announces a cached entry in: a partial
        entry (a prefix ending inside a block) alone, as one hash block (its tokens the
        last hash block's, its parent the prefix one hash block shorter); whole blocks
        as blocks of the group's size."""
        names = [self.names[h] for h in e.block_hashes]
        if not names:  # (vLLM announces a step whose Mamba blocks it all skipped: no hash)
            return
        parent = None if e.parent_block_hash is None else self.names[e.parent_block_hash]
        if len(names[0]) % b:
            assert (len(names), e.block_size) == (1, self.h), e
            assert tuple(e.token_ids) == names[0][-self.h:] and parent == (names[0][:-self.h] or None), e
        else:
            assert e.block_size == b and not any(len(n) % b for n in names), e

    def compare(self, probe: list[int]) -> None:
        if self.twins is not None and self.twins.emptied:  # (from here on its queue differs)
            self.twins = None
        pool = self.v.block_pool
        r = _request(f"probe{self.serial}", probe, self.h)
        blocks, hit, *_ = self.v.get_computed_blocks(r)
        for m in (self.model, self.twins):
            if m is None:
                continue
            for rid in self.reqs:
                assert [list(ids) for ids in self.v.get_block_ids(rid)] == m.reqs[rid].tables, rid
            assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == list(m.free)
            # (every copy vLLM caches: the twin rule's holder and its spares; with partial
            # hits, the partial entries' too: vLLM announces one per block, moves none)
            assert dict(self.mirror) == {k: len(v) + len(m.spares.get(k, ())) for k, v in m.holders.items()
                                         if self.partial or not len(k[2]) % self.groups[k[0]][0]}
            end, ids = m.hit(probe, None)
            assert hit == end
            assert [list(g) for g in blocks.get_block_ids()] == ids if hit else not any(ids)

    def _models(self) -> list[SizedModel]:
        return [self.model] if self.twins is None else [self.model, self.twins]

    def copies(self) -> None:
        """With partial hits: the same copies queued on both, whose blocks both then free
        (as vLLM's scheduler does once the copy ran)."""
        if not self.partial:
            return
        got, retained = self.v.take_kv_cache_block_copies()
        want = self.model.take_copies()
        assert [(c.src_block_id, c.dst_block_id) for c in got] == want
        assert [b.block_id for b in retained] == [x for pair in want for x in pair]
        self.v.block_pool.free_blocks(retained)
        self.model.release([x for pair in want for x in pair])

    def _chunk(self, start: int, n: int, total: int, prompt: int = 0) -> int:
        """``n`` tokens from ``start`` cut to end at every Mamba group's block end (the
        prompt's end kept; at least one of them); with partial hits, ``partial_chunk``'s."""
        end = start + n
        step = reduce(math.lcm, self.mamba) if self.mamba else 0
        if self.partial:
            return partial_chunk(step, self.h, start, n, total, prompt)
        if not self.mamba or end == total:
            return n
        end = end // step * step
        return end - start if end > start else min(step - start % step, total - start)

    def do(self, op: str, a: Any, b: Any) -> None:
        from vllm.v1.request import RequestStatus

        self.serial += 1
        live = sorted(self.reqs)
        if self.mamba:
            self.v.new_step_starts()
        if op == "again" and self.sent:
            tokens = list(self.sent[a[0] % len(self.sent)].all_token_ids)
            op, a = "add", tokens[:max(1, min(len(tokens) - a[1], 72))] + [3] * 20
        if op == "add":
            rid = f"r{self.serial}"
            r = _request(rid, a, self.h)
            blocks, hit, junction = self.v.get_computed_blocks(r)
            num_new = len(a) - hit if b is None and not self.partial else \
                self._chunk(hit, min(b or len(a), len(a) - hit), len(a), len(a))
            fits = {m.add(rid, a, None, num_new) is not None for m in self._models()}
            assert len(fits) == 1  # (the twin rule refuses as vLLM's until it frees a twin)
            if fits != {True}:
                return
            if self.retention is not None or self.model.checkpoint:  # (vLLM's scheduler keeps it)
                assert {m.reqs[rid].junction for m in self._models()} == {junction}
                r.shared_prefix_boundary = junction
            assert self.v.allocate_slots(r, num_new, hit, blocks) is not None
            r.status, r.num_computed_tokens = RequestStatus.RUNNING, hit + num_new
            self.reqs[rid] = r
            self.sent.append(r)
            self._name(r)
        elif op in ("extend", "decode") and live:
            rid = live[a % len(live)]
            r = self.reqs[rid]
            left = r.num_tokens - r.num_computed_tokens
            if op == "extend" and left:
                n = self._chunk(r.num_computed_tokens, min(b, left), r.num_tokens, r.num_prompt_tokens)
                toks = []
            elif op == "decode" and not left and r.num_tokens + len(b) <= MAX_LEN:
                n, toks = len(b), list(b[:1] if self.mamba else b)
                n = len(toks)
            else:
                return
            fits = {m.grow(rid, n, toks) for m in self._models()}
            assert len(fits) == 1
            if fits != {True}:
                return
            if toks:
                r.append_output_token_ids(toks)
            assert self.v.allocate_slots(r, n) is not None
            r.num_computed_tokens += n
            self._name(r)
        elif op == "recompute" and live:
            self._recompute(live[a % len(live)], b)
        elif op == "free" and live:
            rid = live[a % len(live)]
            self.v.free(self.reqs.pop(rid))
            for m in self._models():
                m.free_request(rid)
        elif op == "reset":
            assert {self.v.reset_prefix_cache()} == {m.reset() for m in self._models()}

    def _recompute(self, rid: str, back: int) -> None:
        """vLLM's manager: the request's computed tokens set back ``back`` and scheduled
        again (its blocks stay cached; the scheduler's recompute). The references:
        prefixkv's ``rewind`` and ``grow`` (tests/sized_model.py): the same tables
        always; the same queue, keys and hits while the rewind forgot only the
        request's own keys, each cached again by the recompute (``diverged`` says when
        not, e.g. a window block only another request's retention marks reach: the
        comparison stops there)."""
        r = self.reqs[rid]
        n = r.num_computed_tokens
        p = max(0, n - back)
        done = set()
        for m in self._models():
            gone = m.reqs[rid].tokens[p:]
            done.add(m.rewind(rid, p))
            if done == {True}:
                assert m.grow(rid, n - p, gone)
        assert len(done) == 1
        if done == {True}:
            r.num_computed_tokens = p
            assert self.v.allocate_slots(r, n - p) is not None
            r.num_computed_tokens = n
            for m in self._models():
                assert m.reqs[rid].tables == [list(ids) for ids in self.v.get_block_ids(rid)]
            if self.twins is not None and self.twins.diverged:
                self.twins = None


def partial_chunk(step: int, h: int, start: int, n: int, total: int, prompt: int) -> int:
    """With vLLM's partial hits, ``n`` tokens from ``start`` (of ``total``, a prompt of
    ``prompt``) as vLLM's ``_mamba_block_aligned_split`` cuts them, Mamba blocks of
    ``step``: a chunk starting inside a block ends at its end, one passing the prompt's
    last hash boundary inside a block ends there, another ends at a block's end unless
    it ends the request (at least one token)."""
    end, tail = start + n, (prompt - 1) // h * h
    stops = [end, *([start + step - start % step] if start % step else []),
             *([tail] if start < tail < end and tail % step else [])]
    end = min(stops)
    if end < total and end != tail and start < end // step * step < end:
        end = end // step * step
    return end - start


def _eagle_vllm(groups: Any, flags: tuple[bool, ...], hash_size: int, lcm: int, num_blocks: int) -> Any:
    """vLLM's manager with ``use_eagle``, the groups ``flags`` names flagged ``is_eagle_group``."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    init_none_hash(sha256)
    specs = [KVCacheGroupSpec([f"l{i}"], _spec(b, w), is_eagle_group=f)
             for i, ((b, w), f) in enumerate(zip(groups, flags, strict=True))]
    return KVCacheManager(KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=specs),
                          max_model_len=256, scheduler_block_size=lcm, hash_block_size=hash_size,
                          enable_kv_cache_events=True, use_eagle=True)


def _drive(pair: Pair, ops: Any, probe: list[int]) -> None:
    for op, a, b in ops:
        pair.do(op, a, b)
        pair.copies()
        if pair.model.diverged:  # (by design: tests/sized_model.py ``rewind``)
            return
        pair.note_events()
        pair.compare(probe)


def _pool(groups: Any, extra: int) -> int:
    """A pool a little over one longest request: constant eviction, refusals."""
    return sum(-(-MAX_LEN // b) for b, _ in groups) + 1 + extra


@pytest.mark.parametrize("layout", list(LAYOUTS) + list(MAMBA_LAYOUTS))
@settings(max_examples=30, deadline=None)
@given(extra=st.integers(0, 6), ops=st.lists(OP, min_size=4, max_size=30), probe=PROMPT)
def test_the_sized_reference_runs_as_vllms_manager(layout, extra, ops, probe):
    groups = {**LAYOUTS, **MAMBA_LAYOUTS}[layout]
    _drive(Pair(groups, _pool(groups, extra)), ops, probe)


@pytest.mark.parametrize("layout", list(PARTIAL))
@settings(max_examples=40, deadline=None)
@given(extra=st.integers(0, 6), ops=st.lists(OP, min_size=4, max_size=30), probe=PROMPT)
def test_the_sized_reference_runs_as_vllms_manager_with_partial_hits(layout, extra, ops, probe):
    groups = PARTIAL[layout]
    _drive(Pair(groups, _pool(groups, extra), partial=True), ops, probe)


@pytest.mark.parametrize("layout", list(PARTIAL_FULL))
@settings(max_examples=40, deadline=None)
@given(extra=st.integers(0, 6), ops=st.lists(OP, min_size=4, max_size=30), probe=PROMPT)
def test_the_sized_reference_runs_as_vllms_manager_with_partial_hits_in_full_attention(layout, extra, ops,
                                                                                      probe):
    groups, h = PARTIAL_FULL[layout]
    _drive(Pair(groups, _pool(groups, extra), partial=True, hash_size=h), ops, probe)


# layouts whose windows keep tokens below them (vLLM's extra_retained_tokens), and whose
# windows cache sparsely by vLLM's prefix_cache_retention_interval (tests/sized_model.py
# ``_reachable``): 0 keeps a window's tails at the replay boundary and the shared-prefix
# junction only, R > 0 also one per R tokens (a multiple of the lcm)
RETAINED = {"window10@8(+5)+full16": (((8, 10), (16, None)), {"retained": (5, 0)}),
            "window6@8(+3)+full16+window40@32(+9)": (((8, 6), (16, None), (32, 40)), {"retained": (3, 0, 9)}),
            "full32+window8@8, retention 0": (((32, None), (8, 8)), {"retention": 0}),
            "full32+window8@8, retention 64": (((32, None), (8, 8)), {"retention": 64}),
            "full8+window20@16, retention 0": (((8, None), (16, 20)), {"retention": 0}),
            "full8+window20@16, retention 32": (((8, None), (16, 20)), {"retention": 32}),
            "window6@8+full16+window40@32, retention 0": (((8, 6), (16, None), (32, 40)), {"retention": 0}),
            "window6@8+full16+window40@32, retention 64": (((8, 6), (16, None), (32, 40)), {"retention": 64}),
            "window20@16+full24, retention 48": (((16, 20), (24, None)), {"retention": 48}),
            "window9@16+window30@8, retention 0": (((16, 9), (8, 30)), {"retention": 0})}


@pytest.mark.parametrize("layout", list(RETAINED))
@settings(max_examples=30, deadline=None)
@given(extra=st.integers(0, 6), ops=st.lists(OP, min_size=4, max_size=30), probe=PROMPT)
def test_the_sized_reference_retains_as_vllms_manager(layout, extra, ops, probe):
    groups, kw = RETAINED[layout]
    _drive(Pair(groups, _pool(groups, extra), **kw), ops, probe)


@pytest.mark.parametrize("layout", list(EAGLE))
@settings(max_examples=30, deadline=None)
@given(extra=st.integers(0, 6), ops=st.lists(OP, min_size=4, max_size=30), probe=PROMPT)
def test_the_sized_reference_runs_as_vllms_manager_with_eagle(layout, extra, ops, probe):
    groups, flags = EAGLE[layout]
    _drive(Pair(groups, _pool(groups, extra), flags), ops, probe)


# mostly recomputes, among admissions (some of the same prompts: twins), chunks and decodes
RECOMPUTES = st.one_of(OP, st.tuples(st.just("recompute"), st.integers(0, 5), st.integers(1, 30)))


@pytest.mark.parametrize("layout", list(LAYOUTS) + list(EAGLE))
@settings(max_examples=20, deadline=None)
@given(extra=st.integers(0, 6), ops=st.lists(RECOMPUTES, min_size=4, max_size=30), probe=PROMPT)
def test_the_sized_reference_recomputes_as_vllms_manager(layout, extra, ops, probe):
    if layout in EAGLE:
        groups, flags = EAGLE[layout]
        _drive(Pair(groups, _pool(groups, extra), flags), ops, probe)
    else:
        groups = LAYOUTS[layout]
        _drive(Pair(groups, _pool(groups, extra)), ops, probe)


def test_past_twins_prefixkv_and_the_references_give_vllms_ids_until_a_twin_is_freed():
    # Full attention at 4 and at 12 (hash 4, lcm 12). b and c hit a's first 12 tokens
    # and recompute its hash blocks 3 and 4 in the group at 4 (past the aligned hit):
    # copies of a's (b's first). d evicts a's blocks 4 and 5: vLLM then finds b's copy
    # of block 4, the first it cached. Freeing b frees a copy (of a's block 3): vLLM
    # keeps it cached at its queue's tail, prefixkv empties it (to the head) and moves
    # a's block 3, free, to its place; from there on each reference holds its own side.
    from prefixkv.groups import BlockSizes, HybridKVCacheManager, full_attention

    stem = [1 + k % 7 for k in range(48)]
    pair = Pair(((4, None), (12, None)), 25)  # vLLM's pool: its null block 0 and 24
    rule = pair.twins  # (the twin rule's reference, kept past its first freed twin)
    ours = HybridKVCacheManager([full_attention()] * 2, 24, BlockSizes.of([4, 12]), hash_mode="sha256",
                                seed=0)

    def up(tables):  # prefixkv's ids as vLLM's (no null block here: one lower)
        return [[b + 1 for b in ids] for ids in tables]

    def call(op, arg):
        pair.do(op, sorted(pair.reqs).index(arg) if op == "free" else arg, None)
        if op == "free":
            ours.free(arg)
        else:
            assert ours.add_request(f"r{pair.serial}", arg) is not None
        pair.note_events()
        pair.compare(stem)
        ours.check_invariants()
        for rid in pair.reqs:
            assert up(ours.get_block_ids(rid)) == rule.reqs[rid].tables == list(pair.v.get_block_ids(rid))
        assert [b + 1 for b in ours.free_block_order()] == list(rule.free)
        blocks, hit, *_ = pair.v.get_computed_blocks(_request(f"p{pair.serial}", stem, 4))
        assert ours.lookup(stem) == hit
        assert up(ours.lookup_block_ids(stem)) == rule.hit(stem, None)[1] == list(blocks.get_block_ids())
        return [b.block_id for b in pair.v.block_pool.free_block_queue.get_all_free_blocks()]

    call("add", stem[:20] + [0] * 4)  # a: r1
    call("free", "r1")
    call("add", stem[:25])  # b: r3
    assert call("add", stem[:20] + [9] * 4 + [0]) == [21, 22, 23, 24, 6, 5, 4, 8]  # c: r4
    assert pair.v.get_block_ids("r3") == ([1, 2, 3, 9, 10, 11, 12], [7, 13, 14])
    assert pair.v.get_block_ids("r4") == ([1, 2, 3, 15, 16, 17, 18], [7, 19, 20])
    assert rule.spares == {(0, None, tuple(stem[:16])): [9, 15], (0, None, tuple(stem[:20])): [10, 16]}
    assert call("add", [9 - k % 5 for k in range(12)] + [0]) == [4, 8]  # d: r5 (a's blocks 5, 4 evicted)
    assert pair.v.get_computed_blocks(_request("p", stem, 4))[0].get_block_ids() == \
        ([1, 2, 3, 4, 10, 11], [7, 13])  # (b's copy of block 4, vLLM's first; prefixkv's was c's)
    assert pair.twins is rule and not rule.emptied
    assert call("free", "r3") == [14, 12, 4, 8, 11, 10, 9, 13]  # b's copy 9 of a's block 3 cached
    assert pair.twins is None and rule.emptied == 1
    assert list(rule.free) == [14, 12, 9, 8, 11, 10, 4, 13]  # prefixkv's: 9 empty, a's 4 in its place
    assert list(pair.model.free) == [14, 12, 4, 8, 11, 10, 9, 13]

"""prefixkv's vLLM plug-in beside vLLM 0.33's own ``KVCacheManager`` on Mamba groups
beside attention groups of other block sizes (``mamba_cache_mode="align"``, vLLM's
fine-grained partial hits off: test_vllm_block_sizes_reference.py's ``MAMBA_LAYOUTS``).
One random stream of admissions (with their hits, in chunks that end at the Mamba blocks'
ends or the prompt's, as vLLM's align-mode scheduler cuts them), prefill chunks, decode
steps of one token and frees, each in a step of its own: after every call the two give
the same answer (the blocks it returns: a Mamba group's null entries the step jumped
over too), the same block ids in every group's table of every live request, the same
free block count and the same hit (with its blocks and vLLM's shared-prefix
junction) for a probe and for each live request's tokens and one more. The pool is
large, or a little over one longest request (refusals and evictions). The run stops at
prefixkv's first spare (a second block computing a prefix its group holds: vLLM keeps
that copy cached, prefixkv empties it when freed, so the free queues differ from there
on; groups/index.py, as test_vllm_block_sizes_manager.py stops). Needs vllm installed."""

from __future__ import annotations

import math
import os
from collections import Counter
from functools import reduce
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")

from .test_vllm_block_sizes_reference import MAMBA_LAYOUTS, _plugin, _request, _vllm  # noqa: E402
from .test_vllm_sized_model import MAX_LEN, PARTIAL, PROMPT, partial_chunk  # noqa: E402

OP = st.one_of(  # (test_vllm_sized_model.py's, a decode step of one token)
    st.tuples(st.just("add"), PROMPT, st.none() | st.integers(1, 40)),
    st.tuples(st.just("extend"), st.integers(0, 5), st.integers(1, 40)),
    st.tuples(st.just("decode"), st.integers(0, 5), st.integers(0, 2)),
    st.tuples(st.just("free"), st.integers(0, 5), st.just(0)),
)


def _chunk(step: int, start: int, n: int, total: int) -> int:
    """``n`` tokens from ``start`` cut to end at a multiple of ``step`` (the Mamba
    blocks' lcm) unless they end the prompt; at least up to the next one."""
    end = start + n
    if end >= total:
        return total - start
    end = end // step * step
    return end - start if end > start else min(step - start % step, total - start)


class Sides:
    def __init__(self, groups: Any, num_blocks: int = 400, partial: bool = False,
                 events: bool = False, hash_size: int | None = None) -> None:
        self.partial = partial  # (vLLM's fine-grained partial hits on: chunks cut as its scheduler does)
        sizes = [b for b, _ in groups]
        self.h, self.lcm = hash_size or reduce(math.gcd, sizes), reduce(math.lcm, sizes)
        self.step = reduce(math.lcm, [b for b, w in groups if w == "mamba"])
        self.ms = [_vllm(groups, self.h, self.lcm, num_blocks, events=events),
                   _plugin(groups, self.h, self.lcm, num_blocks, events=events)]
        self.names: list[dict[Any, tuple[int, ...]]] = [{}, {}]  # each side's chain hash -> its tokens
        self.partial_entries = 0  # (partial entries announced, with events)
        self.reqs: list[dict[str, Any]] = [{}, {}]
        self.serial = 0
        self.hits = 0  # (probes that hit)
        self.copies = 0  # (copies on write)

    def drive(self, ops: Any, probe: list[int], each: Any = None, then: Any = None) -> None:
        """Each of ``ops`` on both sides, compared after each (and ``each(self)`` then, if
        given), up to the first spare (the twin rule: tests/twin_model.py); ``then(self)``
        after each op that made none (the events: prefixkv announces a spare once per
        prefix, vLLM per block)."""
        for op, a, b in ops:
            self.do(op, a, b)
            self.compare(probe)
            if each is not None:
                each(self)
            if any(self.ms[1].core._index.twins):
                return
            if then is not None:
                then(self)

    def compare(self, probe: list[int]) -> None:
        tables = [{rid: [list(g) for g in m.get_block_ids(rid)] for rid in reqs}
                  for m, reqs in zip(self.ms, self.reqs, strict=True)]
        assert tables[0] == tables[1]
        assert self.ms[0].block_pool.get_num_free_blocks() == self.ms[1].block_pool.get_num_free_blocks()
        for tokens in [probe] + [list(r.all_token_ids) + [0] for r in self.reqs[0].values()]:
            hits = []
            for m in self.ms:
                probe_request = self.make_request(m, f"probe{self.serial}", tokens)
                blocks, hit, junction = m.get_computed_blocks(probe_request)
                hits.append((hit, [list(g) for g in blocks.get_block_ids()] if hit else None, junction))
            assert hits[0] == hits[1], hits
            self.hits += hits[0][0] > 0
        # the copies on write queued (none without partial hits), whose blocks both give back
        (copies, held), (ours, ours_held) = (m.take_kv_cache_block_copies() for m in self.ms)
        assert [(c.src_block_id, c.dst_block_id) for c in copies] == \
            [(c.src_block_id, c.dst_block_id) for c in ours]
        assert [b.block_id for b in held] == [b.block_id for b in ours_held]
        self.copies += len(copies)
        for m, blocks in zip(self.ms, (held, ours_held), strict=True):
            m.block_pool.free_blocks(blocks)
        assert self.ms[0].block_pool.get_num_free_blocks() == self.ms[1].block_pool.get_num_free_blocks()

    def same_events(self, groups: Any) -> None:
        """Both sides announce and withdraw the same entries in the step: (stored or
        removed, group, the prefix's tokens, the size announced, the session), a Mamba group's partial
        entry as one hash block (vLLM's empty ``BlockStored``, a step whose Mamba blocks
        it skipped, left out)."""
        from vllm.distributed.kv_events import BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        def _key(h: Any) -> Any:  # (vLLM's events carry an int, prefixkv's bytes)
            return h if isinstance(h, int) else maybe_convert_block_hash(h)

        for r in self.reqs[0].values():
            tokens = list(r.all_token_ids)
            for side, hashes in enumerate((r.block_hashes, self.ms[1].core.prepare(tokens).hashes)):
                for i, h in enumerate(hashes):
                    self.names[side][_key(h)] = tuple(tokens[:(i + 1) * self.h])
        got = []
        for m, names in zip(self.ms, self.names, strict=True):
            got.append(Counter((type(e).__name__, getattr(e, "group_idx", None),
                                names[_key(h)] if hasattr(e, "block_hashes") else None,
                                e.block_size if isinstance(e, BlockStored) else None,
                                getattr(e, "session_id", None))
                               for e in m.take_events() for h in getattr(e, "block_hashes", [None])
                               if h is not None or not hasattr(e, "block_hashes")))
        assert got[0] == got[1], (got[0] - got[1], got[1] - got[0])
        self.partial_entries += sum(n for (kind, g, tokens, size, _), n in got[0].items()
                                    if kind == "BlockStored" and len(tokens) % groups[g][0])

    def make_request(self, m: Any, rid: str, tokens: list[int]) -> Any:
        """A vLLM Request of ``tokens`` for the manager ``m`` (both sides get their own)."""
        return _request(rid, tokens, self.h)

    def _chunk(self, start: int, n: int, total: int, prompt: int) -> int:
        if self.partial:
            return partial_chunk(self.step, self.h, start, n, total, prompt)
        return _chunk(self.step, start, n, total)

    def do(self, op: str, a: Any, b: Any) -> None:
        from vllm.v1.request import RequestStatus

        self.serial += 1
        for m in self.ms:
            m.new_step_starts()
        live = sorted(self.reqs[0])
        if op == "add":
            rid, got = f"r{self.serial}", []
            for m, reqs in zip(self.ms, self.reqs, strict=True):
                r = self.make_request(m, rid, a)
                blocks, hit, r.shared_prefix_boundary = m.get_computed_blocks(r)  # (as vLLM's scheduler)
                n = self._chunk(hit, len(a) - hit if b is None else min(b, len(a) - hit), len(a), len(a))
                out = m.allocate_slots(r, n, hit, blocks)
                got.append((hit, None if out is None else [list(g) for g in out.get_block_ids()]))
                if out is not None:
                    r.status, r.num_computed_tokens = RequestStatus.RUNNING, hit + n
                    reqs[rid] = r
            assert got[0] == got[1], got
        elif op in ("extend", "decode") and live:
            rid, got = live[a % len(live)], []
            for m, reqs in zip(self.ms, self.reqs, strict=True):
                r = reqs[rid]
                left = r.num_tokens - r.num_computed_tokens
                if op == "extend" and left:
                    n = self._chunk(r.num_computed_tokens, min(b, left), r.num_tokens, r.num_prompt_tokens)
                elif op == "decode" and not left and r.num_tokens < MAX_LEN:
                    r.append_output_token_ids([b])
                    n = 1
                else:
                    return
                out = m.allocate_slots(r, n)  # (the blocks added: a Mamba group's null entries too)
                got.append(None if out is None else [list(g) for g in out.get_block_ids()])
                if out is not None:
                    r.num_computed_tokens += n
            assert got[0] == got[1], got
        elif op == "free" and live:
            rid = live[a % len(live)]
            for m, reqs in zip(self.ms, self.reqs, strict=True):
                m.free(reqs.pop(rid))


@pytest.mark.parametrize("small", [False, True])
@pytest.mark.parametrize("layout", list(MAMBA_LAYOUTS) + [f"partial hits: {k}" for k in PARTIAL])
@settings(max_examples=30, deadline=None)
@given(ops=st.lists(OP, min_size=4, max_size=30), probe=PROMPT)
def test_the_plugin_gives_vllms_tables_and_hits_beside_mamba_of_another_size(layout, small, ops, probe):
    # (small: a pool a little over one longest request, so calls are refused and cached
    # blocks evicted; "partial hits": vLLM's fine-grained partial hits on, hits inside
    # Mamba blocks copied on write, the copies compared too)
    partial = layout.startswith("partial hits: ")
    groups = PARTIAL[layout[len("partial hits: "):]] if partial else MAMBA_LAYOUTS[layout]
    sides = Sides(groups, sum(-(-MAX_LEN // b) for b, _ in groups) + 3 if small else 400, partial=partial)
    sides.drive(ops, probe)


@pytest.mark.parametrize("small", [False, True])
@pytest.mark.parametrize("layout", list(PARTIAL))
@settings(max_examples=30, deadline=None)
@given(ops=st.lists(OP, min_size=4, max_size=30), probe=PROMPT)
def test_the_plugin_announces_vllms_events_with_partial_hits(layout, small, ops, probe):
    # (vLLM's KV events on: after every step the same entries stored and removed, a
    # Mamba group's partial entry as one hash block, its move to a copy unannounced;
    # up to the first spare, which prefixkv announces once per prefix, vLLM per block)
    groups = PARTIAL[layout]
    sides = Sides(groups, sum(-(-MAX_LEN // b) for b, _ in groups) + 3 if small else 400, partial=True,
                  events=True)
    sides.drive(ops, probe, then=lambda s: s.same_events(groups))


def test_a_hit_on_a_mamba_state_cached_in_the_same_step_waits_as_in_vllm():
    # full attention at 16 beside Mamba at 8 (hash 8, lcm 16): "a" computes 16 of its
    # 20 tokens, caching the Mamba state at 16; "b", admitted in the same step with that
    # hit, waits (vLLM's MambaManager); in the next step it is admitted
    sides = Sides(MAMBA_LAYOUTS["full16+mamba8"])
    tokens = list(range(20))
    for m in sides.ms:
        m.new_step_starts()
        a = _request("a", tokens, 8)
        assert m.allocate_slots(a, 16) is not None
        a.num_computed_tokens = 16
        b = _request("b", tokens[:16] + [99, 98], 8)
        blocks, hit, *_ = m.get_computed_blocks(b)
        assert hit == 16 and m.allocate_slots(b, 2, hit, blocks) is None
        m.new_step_starts()
        blocks, hit, *_ = m.get_computed_blocks(b)
        assert m.allocate_slots(b, 2, hit, blocks) is not None
        assert [list(g) for g in m.get_block_ids("b")] == [[1, 3], [0, 2, 4]]


def test_a_step_that_fits_with_one_block_for_mamba_is_not_refused():
    # full attention at 16 beside Mamba at 8, 6 usable blocks: a chunk of 40 holds 3 + 1;
    # the next 16 tokens take one full-attention block and one Mamba block (two Mamba
    # entries, the first jumped over): 2 of the 2 free, which vLLM grants
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager
    from vllm.v1.core.kv_cache_utils import init_none_hash

    from prefixkv.integrations.vllm import KVCacheManager

    from .test_vllm_block_sizes_reference import _spec
    from .test_vllm_plugin import config

    init_none_hash(sha256)
    groups = MAMBA_LAYOUTS["full16+mamba8"]
    for make in (VllmManager, KVCacheManager):
        m = make(config(*(_spec(b, w) for b, w in groups), num_blocks=7), max_model_len=256,
                 scheduler_block_size=16, hash_block_size=8)
        r = _request("a", list(range(80)), 8)
        assert m.allocate_slots(r, 40) is not None
        r.num_computed_tokens = 40
        assert m.allocate_slots(r, 16) is not None, make
        assert [list(g) for g in m.get_block_ids("a")] == [[1, 2, 3, 5], [0, 0, 0, 0, 4, 0, 6]]

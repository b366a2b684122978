"""Tokens a connector loads beside a Mamba group (``num_external_computed_tokens``),
prefixkv's vLLM plug-in beside vLLM 0.33's own ``KVCacheManager``
(``mamba_cache_mode="align"``; test_vllm_mamba_sizes.py's ``Sides``, its layouts of
sizes and of partial hits, and layouts of one size). One random stream of the ops
there and admissions with a load: ``num_external_computed_tokens`` past the local hit,
written in the step (a synchronous load: the chunk after it computed in the same step,
cut as vLLM's align-mode scheduler cuts it; when the load ends inside a Mamba block,
inside that block: else vLLM caches a wrong state, which prefixkv does not, as
``test_a_load_ending_inside_a_mamba_block_caches_no_state_there`` shows) or later (an
asynchronous one: ``num_new_tokens`` 0 and ``delay_cache_blocks``, as vLLM's scheduler
admits it; the load lands in a later step, where the scheduler calls ``cache_blocks``
up to the loaded tokens, and the request goes on as a running one). After every call
the two hold the same tables, free count and hits (``Sides.compare``; vLLM's answer to
an admission leaves the load's blocks out, prefixkv's lists them: not compared). And
never a wrong state: each side's Mamba table holds a block where the load ends (the
connector writes the state there), and no block of a load is found before it lands
(the hits compared). Needs vllm installed."""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")

from .test_vllm_block_sizes_reference import MAMBA_LAYOUTS  # noqa: E402
from .test_vllm_free_links import _walk  # noqa: E402
from .test_vllm_mamba_sizes import OP, Sides  # noqa: E402
from .test_vllm_sized_model import MAX_LEN, PARTIAL, PROMPT  # noqa: E402

ONE_SIZE = {
    "full16+mamba16": ((16, None), (16, "mamba")),
    "mamba8+full8+window20@8": ((8, "mamba"), (8, None), (8, 20)),
}

LOAD = st.tuples(st.just("load"), PROMPT, st.tuples(st.integers(1, 90), st.integers(1, 40), st.booleans()))
LAND = st.tuples(st.just("land"), st.integers(0, 5), st.just(0))


class LoadSides(Sides):
    """``Sides`` with admissions that load (``load``) and loads landing (``land``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loading: dict[str, int] = {}  # (request id -> the tokens its load ends at)
        self.loads = 0  # (admissions with a load)
        self.short = False  # (vLLM's pool ran short where it reserved too few blocks: the run ends)
        self.small = False  # (a pool a little over one longest request)

    def _chunk(self, start: int, n: int, total: int, prompt: int) -> int:
        """``Sides._chunk``, ending inside the Mamba block where it starts when it
        starts inside one (after a load ending there), the prompt's last chunk too:
        else vLLM caches a wrong state (``test_a_load_ending_inside_a_mamba_block_...``)."""
        n = super()._chunk(start, n, total, prompt)
        return min(n, self.step - start % self.step) if start % self.step else n

    def do(self, op: str, a: Any, b: Any) -> None:
        from vllm.v1.request import RequestStatus

        if op not in ("load", "land"):
            if op in ("extend", "decode", "free"):  # (a load in flight: its request waits)
                live = sorted(r for r in self.reqs[0] if r not in self.loading)  # (a free while loading:
                if not live:  # vLLM frees such blocks in another order, a lead in the report of session 30)
                    return
                a = sorted(self.reqs[0]).index(live[a % len(live)])
            super().do(op, a, b)
            if op == "free":
                self.loading = {r: e for r, e in self.loading.items() if r in self.reqs[0]}
                self.short = free_order(self.ms[0]) != free_order(self.ms[1])  # (the run ends: below)
            return
        self.serial += 1
        for m in self.ms:
            m.new_step_starts()
        if op == "land":
            if not self.loading:
                return
            rid = sorted(self.loading)[a % len(self.loading)]
            end = self.loading.pop(rid)
            for m, reqs in zip(self.ms, self.reqs, strict=True):
                r = reqs[rid]
                m.cache_blocks(r, end)
                r.status = RequestStatus.RUNNING
            return
        e, n, delay = b
        rid, got = f"r{self.serial}", []
        for m, reqs in zip(self.ms, self.reqs, strict=True):
            r = self.make_request(m, rid, a)
            blocks, hit, r.shared_prefix_boundary = m.get_computed_blocks(r)
            ext = min(e, len(a) - hit - 1)
            if ext <= 0:
                return
            new = 0 if delay else self._chunk(hit + ext, min(n, len(a) - hit - ext), len(a), len(a))
            try:
                out = m.allocate_slots(r, new, hit, blocks, num_external_computed_tokens=ext,
                                       delay_cache_blocks=delay)
            except ValueError:  # (vLLM's pool short: its Mamba group may reserve one block
                assert m is self.ms[0]  # where it takes two, the load's and the step's)
                self.short = True
                return
            got.append((hit, ext, out is not None))  # (vLLM's answer leaves the load's blocks out)
            if out is not None:
                r.status = RequestStatus.WAITING_FOR_REMOTE_KVS if delay else RequestStatus.RUNNING
                r.num_computed_tokens = hit + ext + new
                reqs[rid] = r
                if delay:
                    self.loading[rid] = hit + ext
        if got[0][2] != got[1][2] and self.small:  # (at the pool's edge vLLM counts the hit's Mamba
            self.short = True  # block, which it then skips, and not the load's: prefixkv its need)
            return
        assert got[0] == got[1], got
        self.loads += got[0][2]
        self.state_blocks(rid, got[0][0] + got[0][1])

    def state_blocks(self, rid: str, end: int) -> None:
        """Both sides' Mamba tables hold a block where the load ends (the connector
        writes the state there), and neither finds a prefix past the hit before it lands."""
        if rid not in self.reqs[0]:
            return
        for m in self.ms:
            ids = m.get_block_ids(rid)
            for g, spec in enumerate(m.kv_cache_config.kv_cache_groups):
                if type(spec.kv_cache_spec).__name__ == "MambaSpec":
                    b = spec.kv_cache_spec.block_size
                    assert ids[g][-(-end // b) - 1] != 0, (g, end, ids[g])


def free_order(m: Any) -> list[int]:
    """The manager's free list, first taken first (vLLM's linked list; prefixkv's view of
    it, free_links.py). At one block size beside Mamba and a window, prefixkv frees the
    blocks no hit can use first (groups/free_order.py), where vLLM frees group by group:
    the ids later admissions take differ from there on, so a run ends at the first free
    whose order differs (as test_vllm_mamba_sizes.py's at the first spare)."""
    return _walk(m)[0]


# (loads and landings weighed up: ``one_of`` draws a branch of OP's four as often)
OPS = st.lists(st.one_of(OP, LOAD, LAND, LOAD.map(tuple), LAND.map(tuple)), min_size=6, max_size=30)


@pytest.mark.parametrize("small", [False, True])
@pytest.mark.parametrize("layout", [*MAMBA_LAYOUTS, *ONE_SIZE, *(f"partial hits: {k}" for k in PARTIAL)])
@settings(max_examples=30, deadline=None)
@given(ops=OPS, probe=PROMPT)
def test_loads_beside_mamba_give_vllms_tables_and_hits(layout, small, ops, probe):
    partial = layout.startswith("partial hits: ")
    groups = (PARTIAL[layout[len("partial hits: "):]] if partial
              else {**MAMBA_LAYOUTS, **ONE_SIZE}[layout])
    sides = LoadSides(groups, sum(-(-MAX_LEN // b) for b, _ in groups) + 3 if small else 400, partial=partial)
    sides.small = small
    for op in ops:  # (``Sides.drive``, up to vLLM's shortage, if any: ``LoadSides.short``)
        sides.do(*op)
        if sides.short:
            return
        sides.compare(probe)
        sides.ms[1].core.check_invariants()
        if any(sides.ms[1].core._index.twins):
            return


def _tables(sides: LoadSides, rid: str) -> list[Any]:
    tables = [[list(g) for g in m.get_block_ids(rid)] for m in sides.ms]
    assert tables[0] == tables[1]
    return tables[0]


def _hit(sides: LoadSides, tokens: list[int]) -> int:
    hits = []
    for m in sides.ms:
        sides.serial += 1
        hits.append(m.get_computed_blocks(sides.make_request(m, f"p{sides.serial}", tokens))[1])
    assert hits[0] == hits[1], hits
    return int(hits[0])


def test_a_load_that_lands_later_takes_the_block_its_state_goes_to():
    # full attention and Mamba at 16: a 40-token prompt loads 32 tokens asynchronously
    # (vLLM's scheduler: no new token, delay_cache_blocks). The Mamba group takes the
    # block the state at 32 goes to (entry 1; entry 0, the state at 16, none), full
    # attention its 2 blocks and the third for the rest; nothing of the load is found
    # before it lands, the state at 32 after (cache_blocks); the request then goes on
    prompt = list(range(40))
    sides = LoadSides(ONE_SIZE["full16+mamba16"])
    sides.do("load", prompt, (32, 0, True))
    assert _tables(sides, "r1") == [[1, 2], [0, 3]]
    assert _hit(sides, prompt[:32] + [99] * 9) == 0
    sides.do("land", 0, 0)
    assert _hit(sides, prompt[:32] + [99] * 9) == 32
    sides.do("extend", 0, 8)
    assert _tables(sides, "r1") == [[1, 2, 4], [0, 3, 5]]
    sides.compare(prompt)


def test_a_load_computed_on_in_its_step_keeps_both_states():
    # full attention at 8 beside Mamba at 16 (vLLM's partial hits): the local hit of 16
    # (a prompt cached before) and a load of 16 to 32, then 16 tokens computed in the
    # same step: Mamba takes the block where the load ends (the state at 32, cached
    # as vLLM caches it) and the one where the step ends, not the hit's; the load's
    # blocks come first, group after group, as vLLM takes them
    sides = LoadSides(PARTIAL["full8+mamba16"], partial=True)
    sides.do("add", list(range(20)), 16)
    sides.do("free", 0, 0)
    sides.do("load", list(range(50)), (16, 16, False))
    assert _tables(sides, "r3") == [[1, 2, 4, 5, 7, 8], [0, 6, 9]]
    assert _hit(sides, list(range(32)) + [99] * 9) == 32
    assert _hit(sides, list(range(48)) + [99] * 9) == 48


@pytest.mark.parametrize("what", ["eagle", "lookahead"])
def test_a_load_beside_mamba_and_eagle_or_lookahead_is_refused_by_name(what):
    from prefixkv.integrations.vllm import KVCacheManager
    from prefixkv.integrations.vllm.layout import UnsupportedByPrefixKV

    from .test_vllm_block_sizes_reference import _request, _spec
    from .test_vllm_plugin import config

    kwargs = {"use_eagle": True} if what == "eagle" else {"num_hash_lookahead_tokens": 2}
    # (delay_cache_blocks beside lookahead hashing is refused on its own: a step computed)
    m = KVCacheManager(config(_spec(8, None), _spec(16, "mamba"), num_blocks=64), max_model_len=256,
                       scheduler_block_size=16, hash_block_size=8, **kwargs)
    r = _request("a", list(range(40)), 8)
    with pytest.raises(UnsupportedByPrefixKV, match="loaded tokens beside a Mamba group with EAGLE"):
        m.allocate_slots(r, 16, num_external_computed_tokens=16)
    assert m.block_pool.get_num_free_blocks() == 63 and not m.live_request_ids()


def test_evict_blocks_beside_mamba_takes_blocks_no_request_holds():
    # blocks no live request holds: taken, left as they are (as beside any group:
    # prefixkv's evict_blocks uncaches the blocks live requests hold, whose KV a load
    # failed to write; vLLM's drops these too, the hit of 32 then 16); a block a live
    # request holds beside a Mamba group: refused by name, nothing changed
    from prefixkv.integrations.vllm.layout import UnsupportedByPrefixKV

    sides = LoadSides(ONE_SIZE["full16+mamba16"])
    prompt = list(range(40))
    sides.do("add", prompt, 16)
    sides.do("extend", 0, 16)
    sides.do("extend", 0, 8)
    mamba = _tables(sides, "r1")[1]
    sides.do("free", 0, 0)
    m = sides.ms[1]
    m.block_pool.evict_blocks({mamba[1]})
    assert m.get_computed_blocks(sides.make_request(m, "p", prompt))[1] == 32
    sides.do("add", prompt, 8)
    held = _tables(sides, "r5")[1][1]
    with pytest.raises(UnsupportedByPrefixKV, match="on blocks a live request holds"):
        m.block_pool.evict_blocks({held})
    assert m.get_computed_blocks(sides.make_request(m, "q", prompt))[1] == 32


def test_a_load_ending_inside_a_mamba_block_caches_no_state_there():
    # full attention and Mamba at 16: a load of 1 token, then a step to 32 (vLLM's
    # scheduler cuts it so: its block-aligned split starts past the load). The Mamba block
    # of the load holds the state after 1 token; vLLM's cache_blocks caches it as the
    # state after 16: a request sharing 16 tokens resumes from it there (a wrong state:
    # vLLM's own invariant, "slot p holds the state after exactly (p + 1) * block_size
    # tokens", broken by the load). prefixkv records the step's state (after 32) only
    sides = LoadSides(ONE_SIZE["full16+mamba16"])
    prompt = list(range(100, 140))
    vllm, ours = sides.ms
    for m, reqs in zip(sides.ms, sides.reqs, strict=True):
        r = sides.make_request(m, "a", prompt)
        assert m.allocate_slots(r, 31, 0, None, num_external_computed_tokens=1) is not None
        reqs["a"] = r
    assert _tables(sides, "a") == [[1, 3], [2, 4]]
    probe = prompt[:16] + [7] * 20
    blocks, hit, _ = vllm.get_computed_blocks(sides.make_request(vllm, "p", probe))
    assert hit == 16 and [list(g) for g in blocks.get_block_ids()] == [[1], [2]]  # (vLLM's: wrong)
    assert ours.get_computed_blocks(sides.make_request(ours, "p", probe))[1] == 0
    probe = prompt[:32] + [7] * 20
    assert _hit(sides, probe) == 32  # (the step's state, right on both sides)


def test_a_load_that_failed_beside_mamba_is_refused_by_name():
    # vLLM's scheduler, a load of 32 failed from 16 on: cache_blocks(16) (the tokens
    # that landed), then it resumes the request from 16, whose state no block holds
    # (vLLM's table: its null block there). prefixkv refuses by name, nothing changed;
    # the load landing whole goes on; a request freed while loading is forgotten
    from prefixkv.integrations.vllm.layout import UnsupportedByPrefixKV

    sides = LoadSides(ONE_SIZE["full16+mamba16"])
    prompt = list(range(40))
    sides.do("load", prompt, (32, 0, True))
    m, r = sides.ms[1], sides.reqs[1]["r1"]
    with pytest.raises(UnsupportedByPrefixKV, match="failed load beside a Mamba group"):
        m.cache_blocks(r, 16)
    assert m._mamba.loading == {"r1": 32} and _hit(sides, prompt) == 0
    sides.do("land", 0, 0)
    assert not m._mamba.loading and _hit(sides, prompt) == 32
    sides.do("load", prompt[:32] + [5] * 20, (16, 0, True))
    assert len(m._mamba.loading) == 1 and len(sides.reqs[1]) == 2
    rid = next(iter(m._mamba.loading))
    m.free(sides.reqs[1].pop(rid))
    assert not m._mamba.loading

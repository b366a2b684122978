"""A write of vLLM's free count (``block_pool.free_block_queue.num_free_blocks = n``),
which vLLM's tests use to run the pool dry: prefixkv reserves the blocks the write hides
(free_count.py). prefixkv's plug-in and vLLM's own manager run the same steps side by
side (an exact scene, then seeded random admissions, growth, frees and writes): whether
each allocation fits, the free count and the usage agree after every step; prefixkv's
pool keeps its invariants and every block it holds. Needs vllm installed."""

from __future__ import annotations

import os
import random
from typing import Any

import pytest

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")

from .test_vllm_hybrid_reference import _window  # noqa: E402
from .test_vllm_plugin import full  # noqa: E402
from .test_vllm_reference import BS, _managers, _request  # noqa: E402
from .vllm_steps import admit as _admit  # noqa: E402
from .vllm_steps import random_step  # noqa: E402


def _counts(m: Any) -> tuple[int, int, float]:
    pool = m.block_pool
    return pool.free_block_queue.num_free_blocks, pool.get_num_free_blocks(), round(m.usage, 6)


def test_a_pool_run_dry_then_given_back_is_vllms():
    """Exact values (11 blocks, 10 usable): a request of 3 blocks; the count written 0
    (7 reserved): its next block does not fit, a new request neither; it is freed (3
    blocks back: the count reads 3, as vLLM's counter); 5 written (5 of the 10 free
    reserved: 6 blocks do not fit); then 10: the reservation ends. The prompt's blocks
    stay cached throughout (the write takes and evicts nothing)."""
    seen = []
    for m in (s.m for s in _managers(11)):
        steps = []
        a = _admit(m, "a", list(range(3 * BS)))
        steps.append(_counts(m))
        m.block_pool.free_block_queue.num_free_blocks = 0
        steps.append(_counts(m))
        a.append_output_token_ids(7)
        steps.append(m.allocate_slots(a, 1) is None)
        steps.append(_admit(m, "b", [90] * 5) is None)
        m.free(a)
        steps.append(_counts(m))
        m.block_pool.free_block_queue.num_free_blocks = 5
        steps.append(_counts(m))
        steps.append(_admit(m, "c", [91] * (6 * BS)) is None)  # (6 blocks: more than 5)
        steps.append(m.get_computed_blocks(_request("d", [*range(3 * BS), 5], None))[1])
        m.block_pool.free_block_queue.num_free_blocks = 10
        steps.append(_counts(m))
        steps.append(_admit(m, "c", [91] * (6 * BS)) is None)
        seen.append(steps)
    assert seen[0] == seen[1]
    assert seen[0] == [(7, 7, 0.3), (0, 0, 1.0), True, True, (3, 3, 0.7), (5, 5, 0.5), True, 3 * BS,
                       (10, 10, 0.0), False]


def test_a_write_of_more_than_is_free_ends_the_reservation():
    """prefixkv shows no block it does not have (vLLM's counter would claim 20)."""
    m = _managers(11)[0].m
    q = m.block_pool.free_block_queue
    _admit(m, "a", list(range(3 * BS)))
    q.num_free_blocks = 2
    assert _counts(m) == (2, 2, 0.8)
    q.num_free_blocks = 20
    assert _counts(m) == (7, 7, 0.3)
    assert _admit(m, "b", [90] * (7 * BS)) is not None
    m.core.check_invariants()


@pytest.mark.parametrize("bad", [-1, 1.5, None, "3"])
def test_a_bad_count_is_refused_before_any_change(bad):
    from prefixkv.errors import RequestError

    m = _managers(11)[0].m
    _admit(m, "a", list(range(3 * BS)))
    before = _counts(m)
    with pytest.raises(RequestError, match="num_free_blocks"):
        m.block_pool.free_block_queue.num_free_blocks = bad
    assert _counts(m) == before
    assert "allocate_slots" not in vars(m)  # (nothing installed either)


def test_reserved_blocks_add_to_the_reservation():
    """vLLM's ``reserved_blocks`` (kept free by the call) on top of the written count."""
    for m in (s.m for s in _managers(11)):
        m.block_pool.free_block_queue.num_free_blocks = 6
        assert _admit(m, "a", list(range(4 * BS)), reserved_blocks=3) is None  # (4 + 3 > 6)
        assert _admit(m, "a", list(range(4 * BS)), reserved_blocks=2) is not None
        assert _counts(m) == (2, 2, 0.8)


@pytest.mark.parametrize("layout", ["full", "full and window"])
@pytest.mark.parametrize("seed", range(4))
def test_writes_of_the_count_agree_with_vllms_through_random_steps(seed, layout):
    rnd = random.Random(seed)
    specs = (full(BS),) if layout == "full" else (full(BS), _window(2 * BS))
    sides = [s.m for s in _managers(24 if layout == "full" else 40, specs)]
    live: dict[str, list[Any]] = {}
    writes = 0
    for step in range(50):
        op = rnd.random()
        if op < 0.15:  # (at most what is free: vLLM's counter past that claims blocks it lacks)
            n = rnd.randrange(sides[0].block_pool.get_num_free_blocks() + 1)
            for m in sides:
                m.block_pool.free_block_queue.num_free_blocks = n
            writes += 1
        else:
            random_step(rnd, sides, live, step)
        assert _counts(sides[0]) == _counts(sides[1]), f"seed {seed}, step {step}"
        sides[0].core.check_invariants()
    assert writes >= 3


from hypothesis import settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule  # noqa: E402


class FreeCountMachine(RuleBasedStateMachine):
    """Both managers (one full-attention group, 16 blocks) under admissions, growth,
    frees and writes of the free count (at most what is free): every call fits on both
    or on neither, the counts agree, and prefixkv's pool keeps its invariants."""

    def __init__(self) -> None:
        super().__init__()
        self.sides = [s.m for s in _managers(16)]
        self.live: dict[str, list[Any]] = {}
        self.n = 0

    @rule(prefix=st.sampled_from([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9], []]),
          tail=st.lists(st.integers(0, 40), min_size=1, max_size=10), chunk=st.sampled_from([3, BS, 20]))
    def admit(self, prefix: list[int], tail: list[int], chunk: int) -> None:
        self.n += 1
        rid = f"r{self.n}"
        made = [_admit(m, rid, prefix + tail, chunk) for m in self.sides]
        assert (made[0] is None) == (made[1] is None)
        if made[0] is not None:
            self.live[rid] = made

    @precondition(lambda self: self.live)
    @rule(data=st.data(), n=st.sampled_from([1, 3, 5]))
    def grow(self, data: Any, n: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        fits = []
        for m, r in zip(self.sides, self.live[rid], strict=True):
            if r.num_computed_tokens == r.num_tokens:
                r.append_output_token_ids(7)
            k = min(n, r.num_tokens - r.num_computed_tokens)
            fits.append(m.allocate_slots(r, k) is not None)
            if fits[-1]:
                r.num_computed_tokens += k
        assert fits[0] == fits[1]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: Any) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        for m, r in zip(self.sides, self.live.pop(rid), strict=True):
            m.free(r)

    @rule(data=st.data())
    def write(self, data: Any) -> None:
        n = data.draw(st.integers(0, self.sides[0].block_pool.get_num_free_blocks()))
        for m in self.sides:
            m.block_pool.free_block_queue.num_free_blocks = n

    @invariant()
    def counts_agree(self) -> None:
        assert _counts(self.sides[0]) == _counts(self.sides[1])
        self.sides[0].core.check_invariants()


FreeCountMachine.TestCase.settings = settings(max_examples=25, deadline=None, stateful_step_count=30)
test_free_count_machine = FreeCountMachine.TestCase

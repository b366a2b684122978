"""``add_request``'s common case records a miss's new run through ``_store_run`` called
directly, with its event deferred inline, and makes its ``Admission`` inline: no
``store``, ``EventLog.defer`` or ``admission_of`` frame a step (each is a code object and
a frame, cold after the forward pass; benchmarks/results/events-r27.md). What it
records, announces and answers is the general path's (tests/test_lean_admission.py
compares the two; here, against a list of ids' admission)."""

from collections import Counter
from collections.abc import Callable

from prefixkv import KVCacheManager
from prefixkv.bench.opcodes import count_opcodes

BS = 4


def calls(run: Callable[[], object]) -> set[str]:
    """The qualified names of the Python functions ``run`` calls."""
    seen: Counter[str] = Counter()
    count_opcodes(run, calls=seen)
    return {name.rsplit(":", 1)[-1] for name in seen}


def cached(events: bool) -> KVCacheManager:
    """A manager holding a 5-block prompt's blocks, cached and free."""
    m = KVCacheManager(64, BS, seed=1, enable_events=events)
    m.add_request("a", m.prepare(list(range(20))))
    m.free("a")
    m.take_events()
    return m


def test_a_miss_run_is_recorded_with_no_store_or_defer_frame() -> None:
    for events in (True, False):
        m, ref = cached(events), cached(events)
        tokens = list(range(12)) + list(range(100, 121))  # 3 blocks hit, 5 new full ones
        p = m.prepare(tokens)
        out: list[object] = []
        seen = calls(lambda: out.append(m.add_request("b", p)))  # noqa: B023
        assert "ContentRecorder._store_run" in seen and "ContentRecorder._record_run" in seen
        assert "ContentRecorder.store" not in seen and "EventLog.defer" not in seen
        assert "admission_of" not in seen
        want = ref.add_request("b", tokens)  # (ids: the general path, ``store`` called)
        assert out == [want] and want is not None and want.num_cached_tokens == 12
        assert want.num_new_tokens == 21 and want.block_ids == m.get_block_ids("b")
        assert m.get_block_ids("b") == ref.get_block_ids("b")
        assert m.take_events() == ref.take_events()
        assert m.lookup(tokens) == ref.lookup(tokens) == 32
        m.check_invariants()


def test_two_new_blocks_or_fewer_go_through_store_as_before() -> None:
    m = cached(True)
    p = m.prepare(list(range(12)) + list(range(100, 109)))  # 3 hit, 2 new full, 1 partial
    seen = calls(lambda: m.add_request("b", p))
    assert "ContentRecorder.store" in seen and "ContentRecorder._store_run" not in seen
    m.check_invariants()

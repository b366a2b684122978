"""``Prompt.spare``: an iterator over the copy of the tokens that ``prepare`` made for the
first admission, taken with ``for tokens in p.spare: break`` (one ``FOR_ITER``, no call:
``list.pop``'s C path was cold in an admission, benchmarks/results/events-r24.md). One
taker whatever the threads; an admission the pool refuses gives it back unwritten
(``Prompt._give_back``), on the common path and the general one alike."""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator

from prefixkv import KVCacheManager
from prefixkv.core.prompt import Prompt
from prefixkv.groups import GroupSpec, HybridKVCacheManager


def spares(p: Prompt) -> list[object]:
    return list(copy.copy(p.spare))


def test_the_spare_is_an_iterator_over_one_copy() -> None:
    m = KVCacheManager(32, 4, seed=0)
    p = m.prepare(list(range(1, 23)))
    assert isinstance(p.spare, Iterator)
    (spare,) = spares(p)
    assert spare == p.tokens and spare is not p.tokens
    assert m.add_request("a", p) is not None and m._requests["a"].tokens is spare
    assert spares(p) == []
    m.add_request("b", p)  # a later admission copies
    assert m._requests["b"].tokens is not spare and m._requests["b"].tokens == p.tokens
    m.check_invariants()


def test_one_taker_whatever_the_threads() -> None:
    """Many managers of one configuration admit one Prompt at once: exactly one request
    holds the spare; every other request has an array of its own."""
    ms = [KVCacheManager(64, 4, seed=0) for _ in range(8)]
    for _ in range(20):
        p = ms[0].prepare(list(range(1, 40)))
        (spare,) = spares(p)
        start = threading.Barrier(len(ms))

        def admit(m: KVCacheManager, p: Prompt = p, start: threading.Barrier = start) -> None:
            start.wait()
            m.add_request("r", p)

        threads = [threading.Thread(target=admit, args=(m,)) for m in ms]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        arrays = [m._requests["r"].tokens for m in ms]
        assert sum(a is spare for a in arrays) == 1
        assert len({id(a) for a in arrays}) == len(ms) and all(a == p.tokens for a in arrays)
        for m in ms:
            m.free("r")
            m.check_invariants()


def test_a_refused_admission_gives_the_spare_back() -> None:
    # the common path (a plain manager) and the general one (keep_free: ``_admit``)
    for kw in ({}, {"keep_free": 1}):
        m = KVCacheManager(8, 4, seed=0)
        m.add_request("big", list(range(100, 125)))  # 7 of the 8 blocks
        p = m.prepare(list(range(1, 10)))  # 3 blocks: refused
        (spare,) = spares(p)
        assert m.add_request("x", p, **kw) is None
        assert spares(p) == [spare] and spare == p.tokens
        m.free("big")
        assert m.add_request("x", p, **kw) is not None and m._requests["x"].tokens is spare
        m.check_invariants()


def test_the_hybrid_manager_takes_the_spare_once() -> None:
    m = HybridKVCacheManager([GroupSpec("full_attention"), GroupSpec("sliding_window", 8)], 32, 4)
    p = m.prepare(list(range(1, 23)))
    (spare,) = spares(p)
    m.add_request("a", p)
    m.add_request("b", p)
    assert spares(p) == [] and m.num_tokens("a") == m.num_tokens("b") == 22
    m.append_tokens("a", [7])
    assert spare[-1] == 7 and p.token_ids == tuple(range(1, 23))

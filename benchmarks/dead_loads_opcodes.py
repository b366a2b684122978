"""Bytecodes of the scheduler calls that dead loads touch, with a host tier (deadload-r16).

A ``KVCacheManager`` of 128 blocks of 16 tokens and 128 host slots, its pool full of
cached content (every miss evicts). Counted, each in a fresh manager: the free of a
request of 32 blocks (no loads of its own) in a step without loads and in a step whose
plan holds 32 loads; the admission of 32 host hits (the loads stated); a miss of 32
blocks that evicts, in a step without loads and in one with 32 loads (the eviction asks
whether a load writes an evicted block); a miss that evicts the whole pool, with the
32 loaded blocks of a request freed in the step (their loads leave); ``uncache_blocks``
of one loaded block in its step (its load leaves the plan). Deterministic: counted with ``sys.settrace``
(``prefixkv.bench.opcodes``), not timed; run it against two trees to compare:

    PYTHONPATH=src python benchmarks/dead_loads_opcodes.py
"""

from __future__ import annotations

from collections.abc import Callable

from prefixkv import KVCacheManager
from prefixkv.bench.opcodes import count_opcodes

BS = 16
N = 32  # blocks per prompt


def prompt(k: int) -> list[int]:
    """``N`` full blocks and one token, its own tokens for each ``k``."""
    return [k * 1000 + i for i in range(N * BS + 1)]


def manager() -> KVCacheManager:
    """A pool full of cached content, prompt(0)'s blocks offloaded to host slots."""
    m = KVCacheManager(4 * N, BS, seed=0, host_blocks=4 * N)
    for k in range(5):  # prompt(0) first: evicted (offloaded) by the later ones
        m.add_request(f"f{k}", prompt(k))
        m.take_kv_ops()
        m.free(f"f{k}")
    assert m.lookup(prompt(0)) == N * BS  # (host hits)
    return m


def with_loads(m: KVCacheManager) -> KVCacheManager:
    """The step under way holds prompt(0)'s 32 host hits' loads."""
    adm = m.add_request("h", prompt(0))
    assert adm is not None and adm.num_cached_tokens == N * BS
    return m


def freed(m: KVCacheManager) -> KVCacheManager:
    """The request holding the step's loads freed before the step ran (its hits stay
    cached, findable, their loads in the plan)."""
    m.free("h")
    return m


def held(m: KVCacheManager) -> KVCacheManager:
    """A request of 32 blocks admitted in an earlier step, live."""
    m.add_request("q", prompt(9))
    m.take_kv_ops()
    return m


def cases() -> list[tuple[str, Callable[[], KVCacheManager], Callable[[KVCacheManager], object]]]:
    return [
        ("free, 32 blocks, no loads in the step", lambda: held(manager()),
         lambda m: m.free("q")),
        ("free, 32 blocks, 32 loads in the step", lambda: with_loads(held(manager())),
         lambda m: m.free("q")),
        ("admission, 32 host hits (loads stated)", manager,
         lambda m: m.add_request("h", prompt(0))),
        ("miss evicting 32, no loads in the step", manager,
         lambda m: m.add_request("z", prompt(7))),
        ("miss evicting 32, 32 loads in the step", lambda: with_loads(manager()),
         lambda m: m.add_request("z", prompt(7))),
        ("miss evicting all 128, 32 of them loaded in the step (freed)", lambda: freed(with_loads(manager())),
         lambda m: m.add_request("z", list(range(4 * N * BS)))),
        ("uncache_blocks of 1 loaded block in its step", lambda: with_loads(manager()),
         lambda m: m.uncache_blocks([m.get_block_ids("h")[N - 1]])),
    ]


def main() -> None:
    print("| call | bytecodes |")
    print("|---|---:|")
    for name, setup, call in cases():
        m = setup()
        n = count_opcodes(lambda m=m, call=call: call(m))
        print(f"| {name} | {n:,} |")


if __name__ == "__main__":
    main()

"""Bytecodes a call of the paths the orphan fix touches (``ContentIndex.uncache`` and its
walk of descendants, ``store``), on this tree's ``src`` or another's, counted with
``sys.settrace`` opcode events (deterministic, whatever the load; C work such as a dict
probe is not counted, a Python loop over a dict's values is).

    PYTHONPATH=src python benchmarks/orphans_cost.py [--cached 0,1000,10000] [--events]

Cases, each on a pool with ``--cached`` other contents cached (keyed: one first block
each, so the walk's pass over the keyed contents sees them all):

- ``free``: a request of 33 tokens (8 full blocks, all new) freed normally;
- ``admit``: the same prompt admitted (8 new blocks recorded: ``store``);
- ``decode``: 16 tokens appended one by one to a live request (one block filled:
  ``store_filled``);
- ``admit-fork``: a prompt sharing the first 2 of a cached 8-block prompt's blocks, then
  6 new ones (the cached block 2 displaced from block 1's chained child: keyed, and noted
  as block 1's child on a tree with ``index/kids.py``);
- ``fork-stream``: 3000 such forks of one cached prompt, each admitted and freed (the
  pool full: each evicts), bytecodes per fork (on a tree with ``index/kids.py``, its
  sweeps of stale keys included);
- ``abort``: ``free(..., num_computed_tokens=0)`` of a freshly admitted request (8 of its
  own blocks forgotten, no descendant);
- ``rewind-hit``: a request that hit block 0 of a cached 8-block prompt rewinds to 0
  (block 0 forgotten; on the fixed tree, its 7 cached descendants go too).

``--groups LIVE`` runs ``free``, ``admit``, ``decode``, ``abort`` and ``rewind-hit`` on
``HybridKVCacheManager`` (full attention beside a 32-token window) instead, with LIVE
other live requests of 128 full blocks each (their prefixes fill its prefix table).

``--chain LIVE,BLOCKS,DEPTHS`` (e.g. ``1000,128,1/4/16``) measures ``uncache_blocks`` of
one block instead, on each manager (``core``: ``KVCacheManager``; ``full`` and
``full+window``: ``HybridKVCacheManager``): LIVE live requests of BLOCKS full blocks each;
among them ``b``, whose block 0 is a spare of ``a``'s and whose later blocks were computed
on it, and a chain of DEPTH requests, each hitting one more block of the one before (the
first hits b's block 1) and computing the rest of its blocks on it. The call names b's
block 0. Bytecodes (traced; and those of ``computed_on`` alone) and wall time (untraced,
one call: each needs a fresh build) per call, and the hit of the last link's prompt
after it (the same in both builds).
``--host SLOTS`` (e.g. ``1000,10000``, at least 400) measures a host tier's paths
instead, on a ``KVCacheManager`` of 136 blocks with a tier of SLOTS slots, filled by
prompts of 8 blocks (each evicted, so offloaded, by the later ones): ``offload`` a fresh
prompt's admission, whose evictions offload a cached prompt's 8 blocks; ``host-hit`` an
admission that finds its blocks in slots (loads); ``uncache``: ``uncache_blocks`` of a
live request's block 0, loaded from a slot, whose prompt's 7 later blocks are in slots
under it (the rest of the tier under other first blocks). Each with the tier chaining
(as it starts), and not (after a device block was cut off from its parent's content:
every slot keyed).

``--recent``: the other live requests are admitted first (a, b and the chain are the
latest, as a failed load's request is); ``--null``: on ``HybridKVCacheManager`` the call
names the null block too (a window's released entries in vLLM's block table are its
id; no request holds it, the manager does).
"""

from __future__ import annotations

import argparse
import time

from prefixkv import KVCacheManager
from prefixkv.bench.opcodes import count_opcodes
from prefixkv.groups import HybridKVCacheManager, full_attention, sliding_window

BS = 4


def manager(cached: int, events: bool) -> KVCacheManager:
    m = KVCacheManager(cached + 64, BS, seed=0, enable_events=events)
    for i in range(cached):  # one first block each: keyed contents
        m.add_request(("c", i), [10_000 + i] * BS + [1])
        m.free(("c", i))
    m.take_events()
    return m


def prompt(tag: int) -> list[int]:
    return [tag * 100 + j for j in range(8 * BS)] + [7]


def basic(m: KVCacheManager | HybridKVCacheManager, out: dict[str, int]) -> None:
    """``free``, ``admit`` and ``decode`` on ``m``, into ``out``."""
    m.add_request("f", prompt(1))
    out["free"] = count_opcodes(lambda: m.free("f"))
    out["admit"] = count_opcodes(lambda: m.add_request("g", prompt(2)))
    m.free("g")
    m.add_request("d", prompt(3))
    out["decode"] = count_opcodes(lambda: [m.append_tokens("d", [5]) for _ in range(16)])
    m.free("d")


def forgets(m: KVCacheManager | HybridKVCacheManager, out: dict[str, int]) -> None:
    """``abort`` and ``rewind-hit`` on ``m``, into ``out``."""
    m.add_request("x", prompt(4))
    out["abort"] = count_opcodes(lambda: m.free("x", num_computed_tokens=0))
    m.add_request("p", prompt(5))
    m.free("p")
    m.add_request("h", prompt(5)[:BS] + [99])
    out["rewind-hit"] = count_opcodes(lambda: m.rewind("h", 0))
    m.free("h")
    m.check_invariants()


def cases(cached: int, events: bool) -> dict[str, int]:
    out = {}
    m = manager(cached, events)
    basic(m, out)
    m.add_request("q", prompt(6))
    m.free("q")
    fork = prompt(6)[:2 * BS] + [9_000 + j for j in range(6 * BS)] + [7]
    out["admit-fork"] = count_opcodes(lambda: m.add_request("k", fork))
    m.free("k")
    s = KVCacheManager(cached + 64, BS, seed=0, enable_events=events)
    s.add_request("s", prompt(6))
    s.free("s")

    def forks() -> None:
        for i in range(3000):
            s.add_request(i, prompt(6)[:2 * BS] + [10_000 * (i + 1) + j for j in range(6 * BS)]
                          + [7])
            s.free(i)
    out["fork-stream"] = count_opcodes(forks) // 3000
    s.check_invariants()
    forgets(m, out)
    return out


LAYOUTS = {"full": [full_attention()], "full+window": [full_attention(), sliding_window(32)]}


def chain_manager(kind: str, live: int, blocks: int, depth: int, recent: bool = False,
                  null: bool = False
                  ) -> tuple[KVCacheManager | HybridKVCacheManager, list[int], list[int]]:
    """The ``--chain`` scene: the manager, the block ids to name (b's block 0, per group;
    with ``null``, the null block's too) and the last link's prompt."""
    n = live * (blocks + 2) + 64
    m: KVCacheManager | HybridKVCacheManager = (
        KVCacheManager(n, BS, seed=0) if kind == "core"
        else HybridKVCacheManager(LAYOUTS[kind], n, BS, seed=0))
    tail = blocks * BS + 1

    def fresh(tag: int, k: int) -> list[int]:
        return [1_000_000 + tag * 10_000 + j for j in range(k)]

    def others() -> None:
        for i in range(live - depth - 2):
            m.add_request(("x", i), fresh(100 + i, tail))
    if recent:
        others()
    x0 = [1, 2, 3, 4]
    m.add_request("a", x0 + [0])
    m.add_request("b", x0)  # no hit: its block 0 is a spare of a's
    m.append_tokens("b", fresh(0, tail - BS))
    prev = x0 + fresh(0, tail - BS)
    for i in range(1, depth + 1):  # link i hits blocks 0..i: block i computed by link i-1
        prev = prev[:(i + 1) * BS] + fresh(i, tail - (i + 1) * BS)
        m.add_request(("c", i), prev)
    if not recent:
        others()
    ids = m.get_block_ids("b")
    named = [ids[0]] if kind == "core" else [t[0] for t in ids]  # type: ignore[union-attr]
    if null and isinstance(m, HybridKVCacheManager) and m.null_block_id is not None:
        named.append(m.null_block_id)
    return m, named, prev + [0]


def host_cases(slots: int, chaining: bool) -> dict[str, int]:
    m = KVCacheManager(136, BS, seed=0, host_blocks=slots)
    if not chaining:  # (a block cut off from its parent's content: the tier keys every slot)
        m.add_request("cut", [1] * 2 * BS + [1])
        m.uncache_blocks([m.get_block_ids("cut")[0]])
        m.free("cut")
    out: dict[str, int] = {}

    def fill(tag: int) -> list[int]:  # (first block [tag]*BS, 7 blocks fresh, one token)
        return [tag] * BS + [tag * 100 + j for j in range(7 * BS)] + [7]
    n = slots // 8 + 1
    for i in range(n):  # each prompt's blocks evicted (offloaded) by the later ones'
        m.add_request(("f", i), fill(10 + i))
        m.take_kv_ops()
        m.free(("f", i))
    m.take_kv_ops()
    out["offload"] = count_opcodes(lambda: m.add_request("o", fill(10 ** 6)))
    m.take_kv_ops()
    m.free("o")
    m.take_kv_ops()
    out["host-hit"] = count_opcodes(lambda: m.add_request("h", fill(10 + n - 20)))
    m.take_kv_ops()
    m.free("h")
    m.take_kv_ops()
    m.add_request("hold", [10 + n - 30] * BS + [1])  # a prompt in slots: its first block
    m.take_kv_ops()  # loaded, held; its 7 others stay in slots, under it
    m.check_invariants()
    first = m.get_block_ids("hold")[0]
    before = len(m._host)  # type: ignore[arg-type]
    out["uncache"] = count_opcodes(lambda: m.uncache_blocks([first]))
    out["slots dropped"] = before - len(m._host)  # type: ignore[arg-type]
    m.check_invariants()
    return out


def group_cases(live: int) -> dict[str, int]:
    m = HybridKVCacheManager(LAYOUTS["full+window"], live * 130 + 64, BS, seed=0)
    for i in range(live):
        m.add_request(("l", i), [2_000_000 + i * 1_000 + j for j in range(128 * BS + 1)])
    out: dict[str, int] = {}
    basic(m, out)
    forgets(m, out)
    return out


def own_ops(m: KVCacheManager | HybridKVCacheManager, named: list[int]) -> int:
    """Bytecodes of ``computed_on`` alone in ``m.uncache_blocks(named)`` (which it runs)."""
    import prefixkv.core.manager as core_manager
    import prefixkv.groups.manager as groups_manager
    module = core_manager if isinstance(m, KVCacheManager) else groups_manager
    real, ops = module.computed_on, [0]

    def counted(tables, *rest):  # type: ignore[no-untyped-def]
        tables = list(tables)
        ops[0] = count_opcodes(lambda: real(tables, *rest))
        return real(tables, *rest)
    module.computed_on = counted  # type: ignore[assignment]
    try:
        m.uncache_blocks(named)
    finally:
        module.computed_on = real  # type: ignore[assignment]
    return ops[0]


def chain_cases(live: int, blocks: int, depths: list[int], recent: bool, null: bool) -> None:
    print(f"recent: {recent}  null named: {null}")
    print("| manager | depth | bytecodes | computed_on's | wall ms | hit of the last link after |")
    print("|---|---|---|---|---|---|")
    for kind in ("core", *LAYOUTS):
        for d in depths:
            m, named, last = chain_manager(kind, live, blocks, d, recent, null)
            ops = count_opcodes(lambda m=m, named=named: m.uncache_blocks(named))  # type: ignore[misc]
            hit = m.lookup(last)
            own = own_ops(*chain_manager(kind, live, blocks, d, recent, null)[:2])
            m, named, last = chain_manager(kind, live, blocks, d, recent, null)
            t = time.perf_counter()
            m.uncache_blocks(named)
            ms = (time.perf_counter() - t) * 1e3
            assert m.lookup(last) == hit
            print(f"| {kind} | {d} | {ops} | {own} | {ms:.2f} | {hit} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cached", default="0,1000,10000")
    ap.add_argument("--events", action="store_true")
    ap.add_argument("--chain", default=None)
    ap.add_argument("--groups", default=None)
    ap.add_argument("--host", default=None)
    ap.add_argument("--recent", action="store_true")
    ap.add_argument("--null", action="store_true")
    a = ap.parse_args()
    import prefixkv
    print(f"src: {prefixkv.__file__}  events: {a.events}")
    if a.groups is not None:
        print("| live requests | " + " | ".join(group_cases(0)) + " |")
        for live in map(int, a.groups.split(",")):
            print(f"| {live} | " + " | ".join(map(str, group_cases(live).values())) + " |")
        return
    if a.host is not None:
        print("| host slots | chaining | " + " | ".join(host_cases(400, True)) + " |")
        print("|---" * 6 + "|")
        for n in map(int, a.host.split(",")):
            for chaining in (True, False):
                r = host_cases(n, chaining)
                print(f"| {n} | {chaining} | " + " | ".join(map(str, r.values())) + " |")
        return
    if a.chain is not None:
        live, blocks, depths = a.chain.split(",")
        chain_cases(int(live), int(blocks), [int(d) for d in depths.split("/")], a.recent,
                    a.null)
        return
    print("| cached contents | " + " | ".join(cases(0, a.events)) + " |")
    for c in map(int, a.cached.split(",")):
        r = cases(c, a.events)
        print(f"| {c} | " + " | ".join(str(v) for v in r.values()) + " |")


if __name__ == "__main__":
    main()

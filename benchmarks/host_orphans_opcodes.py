"""Bytecodes of evictions with a host tier, where the slots they take may be the last
copy of a parent's content (orphan-r17: ``tiers/host_orphans.py``).

A ``KVCacheManager`` of 4 x 32 blocks of 16 tokens. Counted, each in a fresh manager:

- a miss of 32 blocks with no host tier (the path the withdrawal must not touch);
- a miss of 32 blocks whose evictions offload into 32 empty host slots;
- a miss of 32 blocks whose offloads take 32 cached slots, a run of 32 chained slots
  under no other slot (the steady state: one dict probe a slot taken);
- the same where those 32 slots are the parents of 32 slots of a later run (a prefix
  loaded from them, its tail computed on it, both evicted: the tail offloaded under the
  prefix's slots, which were refreshed first): the prefix's contents leave every tier,
  so the 32 tail slots are withdrawn (before: kept, announced, unreachable).

Deterministic: counted with ``sys.settrace`` (``prefixkv.bench.opcodes``), not timed; run
it against two trees to compare:

    PYTHONPATH=src python benchmarks/host_orphans_opcodes.py
"""

from __future__ import annotations

from collections.abc import Callable

from prefixkv import KVCacheManager
from prefixkv.bench.opcodes import count_opcodes
from prefixkv.core.block import Block
from prefixkv.event_log import EventLog
from prefixkv.tiers import HostTier

BS = 16
N = 32  # blocks per prompt


def prompt(k: int, n: int = N) -> list[int]:
    """``n`` full blocks and one token, its own tokens for each ``k``."""
    return [k * 100_000 + i for i in range(n * BS + 1)]


def full(host: int, events: bool = False) -> KVCacheManager:
    """A pool of 4N blocks full of cached content (every miss evicts); ``host`` slots."""
    m = KVCacheManager(4 * N, BS, seed=0, host_blocks=host, enable_events=events)
    for k in range(1, 5):
        m.add_request(f"f{k}", prompt(k, N - 1))
        m.take_kv_ops()
        m.free(f"f{k}")
    return m


def cached_run() -> KVCacheManager:
    """32 host slots, all cached: the blocks of the prompts evicted last, chained runs."""
    m = full(N)
    for k in (5, 6):
        m.add_request(f"g{k}", prompt(k, N - 1))
        m.take_kv_ops()
        m.free(f"g{k}")
    assert m._host is not None and m._host.num_free == N and not m._host._empty
    return m


def run(k: int, n: int, parent: int, first_cid: int) -> list[Block]:
    """``n`` evicted device blocks of one chain under content ``parent``, tail first (as
    the pool evicts them), content ids from ``first_cid`` on."""
    return [Block(i, key=bytes([k, i]) * 32, parent_cid=parent if i == 0 else first_cid + i - 1,
                  content_id=first_cid + i, step=0) for i in range(n)][::-1]


def parent_slots() -> HostTier:
    """A tier of 64 slots, all cached: a prefix's 32 slots, the least recently used, and
    32 slots of its tail, keyed under the prefix's last content: both evicted in one
    batch, the tail offloaded into new slots, the prefix found in its slots (refreshed,
    so unpinned before the tail's). No device block holds the prefix's contents."""
    tier = HostTier(2 * N, EventLog(10_000))
    prefix = run(1, N, 0, 1)
    tier.demote(prefix, 1)
    tier.end_step()
    tier.demote(run(2, N, N, N + 1) + prefix, 2)
    tier.end_step()
    assert tier.num_free == 2 * N and not tier._empty
    tier._sink.take()
    return tier


def cached_slots() -> HostTier:
    """A tier of 64 slots, all cached: two chained runs of 32, offloaded one step apart
    (the first the least recently used, children first): no slot under another run."""
    tier = HostTier(2 * N, EventLog(10_000))
    tier.demote(run(1, N, 0, 1), 1)
    tier.end_step()
    tier.demote(run(2, N, 0, N + 1), 2)
    tier.end_step()
    assert tier.num_free == 2 * N and not tier._empty
    tier._sink.take()
    return tier


def offload(tier: HostTier) -> None:
    """32 evicted blocks of a new first content's chain, offloaded into the 32 least
    recently used slots."""
    tier.demote(run(3, N, 0, 1000), 3)


def cases() -> list[tuple[str, Callable[[], KVCacheManager], Callable[[KVCacheManager], object]]]:
    return [
        ("miss evicting 32, no host tier", lambda: full(0),
         lambda m: m.add_request("z", prompt(9, N - 1))),
        ("miss evicting 32 into 32 empty slots", lambda: full(4 * N),
         lambda m: m.add_request("z", prompt(9, N - 1))),
        ("miss evicting 32 into 32 cached slots (no slot under them)", cached_run,
         lambda m: m.add_request("z", prompt(9, N - 1))),
    ]


def tier_cases() -> list[tuple[str, Callable[[], HostTier]]]:
    return [
        ("demote of 32 into 32 cached slots, none under them", cached_slots),
        ("demote of 32 into 32 cached parent slots (a run of 32 under them)", parent_slots),
    ]


def emptied(tier: HostTier | None) -> int:
    """The tier's empty slots (0 without a tier)."""
    return len(tier._empty) if tier is not None else 0


def main() -> None:
    print("| call | bytecodes | slots withdrawn (emptied) |")
    print("|---|---:|---:|")
    for name, setup, call in cases():
        m = setup()
        before = emptied(m._host)
        n = count_opcodes(lambda m=m, call=call: call(m))
        print(f"| {name} | {n:,} | {max(0, emptied(m._host) - before)} |")
    for name, make in tier_cases():
        tier = make()
        before = emptied(tier)
        n = count_opcodes(lambda tier=tier: offload(tier))
        print(f"| {name} | {n:,} | {emptied(tier) - before} |")


if __name__ == "__main__":
    main()

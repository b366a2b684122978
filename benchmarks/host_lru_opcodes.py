"""Bytecodes of the host tier's calls that order its LRU leaves first (hostlru-r18): an
eviction that finds parents in their slots while it offloads their children into new
ones (the parents are requeued behind the children at the unpin), an admission's
``hold`` of a chain (pinned last first), a store fetch's ``reserve`` (the keys of the
slots it takes are kept, for the device probe of ``cut_off``), and evictions that lose
32 contents while every slot is pinned (the pinned slots' parents are read once a step:
``_pinned_parents``). Each on a bare ``HostTier`` of 64 slots (1024 where named),
32-block runs. Deterministic: counted with ``sys.settrace``
(``prefixkv.bench.opcodes``), not timed; run it against two trees to compare:

    PYTHONPATH=src python benchmarks/host_lru_opcodes.py
"""

from __future__ import annotations

from collections.abc import Callable

from prefixkv.bench.opcodes import count_opcodes
from prefixkv.core.block import Block
from prefixkv.event_log import EventLog, NullSink
from prefixkv.tiers import HostTier

N = 32


def run(k: int, n: int, parent: int, first_cid: int, step: int = 0) -> list[Block]:
    """``n`` evicted device blocks of one chain under content ``parent``, tail first (as
    the pool evicts them), content ids from ``first_cid`` on."""
    return [Block(i, key=bytes([k, i]) * 32, parent_cid=parent if i == 0 else first_cid + i - 1,
                  content_id=first_cid + i, step=step) for i in range(n)][::-1]


def tier_with_prefix(events: bool) -> HostTier:
    """64 slots: a prefix of 32 cached (content ids 1-32), loaded once (so keyed, as the
    slots of content that went up to the device are), 32 empty."""
    tier = HostTier(2 * N, EventLog(10_000) if events else NullSink())
    tier.demote(run(1, N, 0, 1), 1)
    tier.end_step()
    chain = [tier.find(0, bytes([1, 0]) * 32, b"")]
    while len(chain) < N:
        chain.append(chain[-1].child)  # type: ignore[arg-type]
    tier.hold(chain)  # type: ignore[arg-type]
    tier.end_step()
    tier.take_offloads()
    assert len(tier.by_chunk) == N and not tier.num_chained
    return tier


def refresh_parents(tier: HostTier) -> None:
    """A tail of 32 under the prefix (new slots) and the prefix (found: refreshed), one
    eviction, then the step's end (the unpin)."""
    tier.demote(run(2, N, N, N + 1, 1) + run(1, N, 0, 1, 1), 2)
    tier.end_step()


def refresh_parents_per_block(tier: HostTier) -> None:
    """As ``refresh_parents``, a block a call (the pool's eviction with events)."""
    for b in run(2, N, N, N + 1, 1) + run(1, N, 0, 1, 1):
        tier.demote((b,), 2)
    tier.end_step()


def chain_of_64() -> HostTier:
    """64 slots, all cached: the prefix and its tail (under its last content)."""
    tier = tier_with_prefix(False)
    tier.demote(run(2, N, N, N + 1, 1), 2)
    tier.end_step()
    return tier


def hold_chain() -> Callable[[], object]:
    """An admission loading the whole chain of 64 cached slots, then the step's end."""
    tier = chain_of_64()
    by_cid = {s.content_id: s for s in tier.slots}
    slots = [by_cid[cid] for cid in range(1, 2 * N + 1)]

    def call() -> None:
        tier.hold(slots)
        tier.end_step()
    return call


def lose_32(slots: int, per_block: bool) -> Callable[[], object]:
    """32 evicted contents, lost: every one of ``slots`` slots is pinned by this step's
    offloads (a batch, or a block a call as the pool evicts with events on)."""
    tier = HostTier(slots, EventLog(100_000))
    tier.demote([Block(i, key=i.to_bytes(4, "little") * 16, parent_cid=0, content_id=1 + i)
                 for i in range(slots)], 1)
    lost = run(3, N, 0, 100_000)

    def call() -> None:
        for batch in ([b] for b in lost) if per_block else [lost]:
            tier.demote(batch, 1)
    return call


Setup = Callable[[], Callable[[], object]]


def cases() -> list[tuple[str, Setup]]:
    def on(make: Callable[[], HostTier], fn: Callable[[HostTier], object]) -> Setup:
        def setup() -> Callable[[], object]:
            tier = make()
            return lambda: fn(tier)
        return setup
    return [
        ("demote 32 new under 32 refreshed parents + end_step",
         on(lambda: tier_with_prefix(False), refresh_parents)),
        ("the same, a block a call, events on",
         on(lambda: tier_with_prefix(True), refresh_parents_per_block)),
        ("hold of a chain of 64 cached slots + end_step", hold_chain),
        ("reserve of 32 cached slots (no events, no chain)", on(chain_of_64, lambda t: t.reserve(N))),
        ("32 lost, every slot pinned, a batch (64 slots)", lambda: lose_32(2 * N, False)),
        ("32 lost, every slot pinned, a block a call (64 slots)", lambda: lose_32(2 * N, True)),
        ("32 lost, every slot pinned, a block a call (1024 slots)", lambda: lose_32(1024, True)),
    ]


def main() -> None:
    print("| call | bytecodes |")
    print("|---|---:|")
    for name, setup in cases():
        n = count_opcodes(setup())
        print(f"| {name} | {n:,} |")


if __name__ == "__main__":
    main()

"""Host hit tokens under shared prefixes when the host tier is smaller than the working
set (hostlru-r18): how many host slots go because the slot holding their parent's
content was taken first (withdrawn as unreachable: ``tiers/host_orphans.py``), and what
the tier serves.

A ``KVCacheManager`` of ``DEVICE`` blocks of 16 tokens over a host tier of ``HOST``
slots. Requests: one of ``GROUPS`` shared prefixes (``PREFIX`` blocks) followed by one
of ``SUFFIXES`` suffixes of its group (``SUFFIX`` blocks) and one token, chosen with
Zipf-like weights (a seeded ``random.Random``); ``LIVE`` requests at a time, one
admitted and its plan taken per step, the oldest freed. Deterministic: counts, not
times. Run it against two trees to compare:

    PYTHONPATH=src python benchmarks/host_lru_hits.py
"""

from __future__ import annotations

import random
import sys

from prefixkv import KVCacheManager

BS = 16
DEVICE = 40
GROUPS, PREFIX = 8, 4
SUFFIXES, SUFFIX = 6, 4
LIVE = 3
STEPS = 4000


def prompt(g: int, s: int) -> list[int]:
    """Prefix ``g`` (its own tokens), then suffix ``s`` of group ``g``, then a token."""
    pre = [g * 1_000_000 + i for i in range(PREFIX * BS)]
    suf = [g * 1_000_000 + 100_000 * (s + 1) + i for i in range(SUFFIX * BS)]
    return pre + suf + [7]


def run(host: int, seed: int, events: bool) -> tuple[int, int, int, int]:
    """(tokens asked, device hit tokens, host hit tokens, slots withdrawn) of one run
    (``events``: with events, the pool evicts a block at a time)."""
    m = KVCacheManager(DEVICE, BS, seed=0, host_blocks=host, enable_events=events)
    tier = m._host
    assert tier is not None
    withdrawn = [0]
    forget = tier.forget_under

    def counted(lost: set[int]) -> list:  # type: ignore[type-arg]
        out = forget(lost)
        withdrawn[0] += len(out)
        return out

    tier.forget_under = counted  # type: ignore[method-assign]
    rng = random.Random(seed)
    groups = [1 / (g + 1) for g in range(GROUPS)]
    suffixes = [1 / (s + 1) for s in range(SUFFIXES)]
    live: list[str] = []
    for step in range(STEPS):
        g = rng.choices(range(GROUPS), groups)[0]
        s = rng.choices(range(SUFFIXES), suffixes)[0]
        rid = f"r{step}"
        m.add_request(rid, prompt(g, s))
        m.take_kv_ops()
        m.take_events()
        live.append(rid)
        if len(live) >= LIVE:
            m.free(live.pop(0))
    st = m.stats
    return st.queries, st.hits - st.host_hits, st.host_hits, withdrawn[0]


def main() -> None:
    hosts = [int(x) for x in sys.argv[1:]] or [32, 64, 96, 128]
    print("| events | host slots | seed | tokens asked | device hits | host hits | slots withdrawn |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for events in (False, True):
        for host in hosts:
            for seed in (1, 2, 3):
                q, dev, hh, w = run(host, seed, events)
                print(f"| {'on' if events else 'off'} | {host} | {seed} | {q:,} | {dev:,} | {hh:,} | {w:,} |")


if __name__ == "__main__":
    main()

"""A floor under the fleet's TTFT proxy that no route within an imbalance bound can go
below (``replicas.py``'s proxy, docs/router.md, "Is the proxy TTFT?").

Every request's proxy is at least the prompt tokens it computes when first admitted (its
step's batch holds them). Two things no route avoids:

- *compulsory misses*: the tokens of a request after the prefix all requests share,
  beyond the longest run of full blocks it shares with some other request that may run
  before it (any request but itself and its own later chat turns, which come after it),
  and at least one token;
- *one copy per replica*: replicas start empty, so each replica that gets a request
  computes the prefix all requests share (its full blocks) once.

A route whose imbalance (max / mean requests per replica) is at most ``imbalance``
sends requests to at least ``ceil(R / floor(imbalance * R / N))`` of N replicas. The
floor is the mean of these tokens over the R requests.
"""

from __future__ import annotations

import math
from collections import defaultdict

from .workloads import BenchRequest, Workload


def replicas_used(requests: int, replicas: int, imbalance: float) -> int:
    """The fewest replicas a route within ``imbalance`` can send ``requests`` to."""
    most = math.floor(imbalance * requests / replicas)  # requests one replica may get
    return min(replicas, math.ceil(requests / most)) if most else replicas


def ttft_floor(workload: Workload, replicas: int, imbalance: float, block_size: int = 16) -> float:
    """The lowest mean TTFT proxy (tokens) a route within ``imbalance`` can have on
    ``workload`` at ``replicas`` replicas of ``block_size`` (module doc)."""
    reqs = workload.requests
    chains = [_chain(r, block_size) for r in reqs]
    holders: dict[int, set[int]] = defaultdict(set)
    for i, chain in enumerate(chains):
        for key in chain:
            holders[key].add(i)
    later = _later_turns(reqs)
    shared = _shared_blocks(reqs, block_size)  # counted per replica, not per request
    computed = 0
    for i, r in enumerate(reqs):
        run = shared
        for key in chains[i][shared:len(r.prompt) // block_size]:
            if not any(j != i and j not in later[i] for j in holders[key]):
                break
            run += 1
        computed += max(1, len(r.prompt) - run * block_size)
    copies = replicas_used(len(reqs), replicas, imbalance) * shared * block_size
    return (computed + copies) / len(reqs)


def _chain(r: BenchRequest, bs: int) -> list[int]:
    """Keys of the full blocks of ``r``'s prompt and output, each standing for its whole
    prefix (Python's tuple hash chained: a collision could only lengthen a run, which
    lowers the floor, so the floor stays a floor)."""
    tokens = r.prompt + r.output
    keys, key = [], 0
    for i in range(len(tokens) // bs):
        key = hash((key, tokens[i * bs:(i + 1) * bs]))
        keys.append(key)
    return keys


def _later_turns(reqs: tuple[BenchRequest, ...]) -> list[set[int]]:
    """Per request, the indexes of the requests that wait (transitively) for it."""
    index = {r.rid: i for i, r in enumerate(reqs)}
    after: dict[int, list[int]] = defaultdict(list)
    for i, r in enumerate(reqs):
        if r.after is not None:
            after[index[r.after]].append(i)
    out = []
    for i in range(len(reqs)):
        seen: set[int] = set()
        todo = list(after[i])
        while todo:
            j = todo.pop()
            if j not in seen:
                seen.add(j)
                todo += after[j]
        out.append(seen)
    return out


def _shared_blocks(reqs: tuple[BenchRequest, ...], bs: int) -> int:
    """Full blocks of the prefix every prompt shares (fewer than any prompt's length, so
    that each prompt still computes a token of its own)."""
    first = reqs[0].prompt
    n = min(len(r.prompt) for r in reqs) - 1
    for r in reqs:
        n = next((k for k in range(n) if r.prompt[k] != first[k]), n)
    return n // bs

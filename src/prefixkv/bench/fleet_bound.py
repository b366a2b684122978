"""A floor under the fleet's TTFT proxy that no route within an imbalance bound can go
below (``replicas.py``'s proxy, docs/router.md, "Is the proxy TTFT?").

A lower bound, not an estimate. The argument, under the simulation's rules (each
replica a ``KVCacheManager`` that starts empty, no shared store; a request's proxy is
counted from its first admission):

1. A request's proxy is at least the prompt tokens it computes at its first admission
   (that step's batch holds them).
2. Those tokens are at least its *compulsory* ones: the tokens after the prefix every
   prompt shares (``shared`` full blocks), beyond the longest run of full blocks that
   some other request may have cached first (any request but itself and the chat turns
   that wait for it, which are routed only after it finished), and at least one token.
3. The first request admitted on a replica finds its pool empty and computes its whole
   prompt: the ``shared`` blocks on top of its compulsory tokens, which never include
   them. So the sum over requests is at least the compulsory tokens plus ``shared``
   blocks once per replica used.
4. A route whose imbalance (max / mean requests routed per replica, as ``FleetResult``
   measures it) is at most ``imbalance`` sends a replica at most
   ``floor(imbalance * R / N)`` of the R requests, so it uses at least
   ``ceil(R / that)`` replicas.

The floor is that sum over R. Every step above can only understate: other requests'
prefill and the decode tokens batched with a request are left out (so the best route's
proxy sits above the floor by those), any other request counts as a possible cache
(where many requests share a prefix beyond the common one, as in the skewed workload,
none of them is charged for it and the floor is loose), extra keys are ignored and a
hash collision in ``_chain`` can only lengthen a run. Where one route's prefill per
request equals the floor, the floor is tight in its prefill part: on chat at 8 replicas
the cost route reaches it on seeds 0-9, keeping every session on its replica.
``tests/bench/test_replicas.py`` checks it against random routes within the bound.
"""

from __future__ import annotations

import math
from collections import defaultdict

from .errors import check_int, check_real
from .limits import MAX_BLOCK_SIZE, MAX_REPLICAS
from .workloads import BenchRequest, Workload


def replicas_used(requests: int, replicas: int, imbalance: float) -> int:
    """The fewest replicas a route within ``imbalance`` can send ``requests`` to. Raises
    BenchError for ``requests`` not an int >= 0, ``replicas`` not an int in
    1..``limits.MAX_REPLICAS``, ``imbalance`` not a finite number >= 1."""
    check_int("requests", requests, 0)
    check_int("replicas", replicas, 1, MAX_REPLICAS)
    check_real("imbalance", imbalance, 1.0)
    most = math.floor(imbalance * requests / replicas)  # requests one replica may get
    return min(replicas, math.ceil(requests / most)) if most else replicas


def ttft_floor(workload: Workload, replicas: int, imbalance: float, block_size: int = 16) -> float:
    """A lower bound (module doc) on the mean TTFT proxy, in tokens, and on the prefill
    computed per request, of every route with imbalance at most ``imbalance`` on
    ``workload`` at ``replicas`` replicas of ``block_size``. Raises BenchError, before
    any work, as ``replicas_used`` does and for ``block_size`` not an int in
    1..``limits.MAX_BLOCK_SIZE``."""
    replicas_used(0, replicas, imbalance)  # its checks
    check_int("block_size", block_size, 1, MAX_BLOCK_SIZE)
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

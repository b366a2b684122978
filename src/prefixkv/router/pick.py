"""The router's picking: a prompt's hashes in wire form, the runs the index gives each
candidate, and the scorer's choice (router.py's module doc: the policies and the score).

``Router.prompt_hashes``, ``cached_tokens`` and ``route`` are the calls; they hand their
router here, whose settings, index, tallies and load book these functions read and count
in (one thread, as the router's own calls).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..hashing import block_hashes
from .scorer import ReplicaView

if TYPE_CHECKING:
    from .router import Router

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class Choice:
    """The replica picked and how many prompt tokens the index says it holds.
    ``lossy``: the replica's index is marked lossy (``Router.lossy``: a batch of its
    events was lost, removals perhaps among them), so ``cached_tokens`` may overstate
    what it holds: an upper bound no longer, only what its index says. The scorer
    credited that run at its ``lossy_weight``."""

    replica: str
    cached_tokens: int
    lossy: bool = False


def prompt_hashes(router: Router, token_ids: Sequence[int], extra: object) -> list[int | bytes]:
    """``Router.prompt_hashes``: the full-block hashes with the router's settings."""
    digests = block_hashes(token_ids, router.block_size, hash_mode=router.hash_mode,
                           seed=router.seed, extra=extra,
                           hash_lookahead_tokens=router.hash_lookahead_tokens)
    router._hash_check.learn(extra)  # type: ignore[arg-type]  # (checked: a LoRA's path)
    if router.hash_format == "bytes":
        return digests  # type: ignore[return-value]
    return [int.from_bytes(d, "big") & _MASK64 for d in digests]


def cached_tokens(router: Router, token_ids: Sequence[int], extra: object) -> dict[str, int]:
    """``Router.cached_tokens``: each replica's run of the prompt, in tokens."""
    runs = router.index.prefix_runs(prompt_hashes(router, token_ids, extra), router.replicas)
    return {r: runs.get(r, (0, 0))[0] * router.block_size for r in router.replicas}


def route(router: Router, now: float, token_ids: Sequence[int], extra: object) -> Choice:
    """``Router.route`` after its clock reading ``now``: pick among the live replicas
    (all when none is) by the router's policy, tell the index, count the request."""
    candidates = router._live(now) or list(router.replicas)
    k = len(candidates)
    candidates = [candidates[(router._turn + i) % k] for i in range(k)]  # rotate the ties
    hashes = prompt_hashes(router, token_ids, extra)
    if router.policy == "round-robin":
        pick, run = candidates[0], 0
    elif router.policy == "least-loaded":
        pick, run = min(candidates, key=router.in_flight.__getitem__), 0
    else:
        runs = router.index.prefix_runs(hashes, candidates) if hashes else {}
        views = [view(router, r, len(hashes), runs.get(r, (0, 0))) for r in candidates]
        pick = candidates[router.scorer.pick(views, router._turn)]
        run = runs.get(pick, (0, 0))[0]
    router.index.routed(pick, hashes)  # first: what it raises leaves the tallies as they were
    router._turn += 1
    router.in_flight[pick] += 1
    router.routed[pick] += 1
    router.loads.routed(pick, len(hashes) - run, len(hashes), now)
    return Choice(pick, run * router.block_size, router.lossy[pick] > 0)


def view(router: Router, replica: str, n: int, runs: tuple[int, int]) -> ReplicaView:
    """What the scorer sees of ``replica`` for a prompt of ``n`` blocks: its runs
    (all media, GPU alone) and its load."""
    loads, rep = router.loads, router.loads.reported.get(replica)
    return ReplicaView(replica, n, runs[0], runs[1], router.in_flight[replica],
                       loads.prefill_blocks(replica), loads.active_blocks(replica),
                       loads.capacity.get(replica), None if rep is None else rep.kv_usage,
                       router.routed[replica], router.lossy[replica])

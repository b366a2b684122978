"""A fleet by simulation: N managers behind the router, driven by a workload.

Every replica is a ``KVCacheManager`` with the pool a single replica gets in
``prefixkv bench``; routing is decided by ``prefixkv.router.Router`` (the code a real
router runs), fed with each replica's events through the vLLM wire format after every
step (``encode_batch`` -> ``decode_batch`` -> ``Router.apply``). One step::

    arrivals (``rate`` per replica, in workload order, skipping a chat turn whose
    previous turn has not finished) -> route each -> every replica admits what fits (FIFO, at most
    ``max_running``), decodes one token per running request (preempting its newest
    request when the pool is full), frees finished ones -> events to the router

Reported per (workload, N, policy): fleet hit rate (hit / queried prompt tokens of new
requests, summed over replicas), prefill tokens computed, and load imbalance (max / mean
requests routed per replica).
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field

from ..fleet.wire import encode_batch
from ..core.manager import KVCacheManager
from ..results import StoreWait
from ..router import Router, decode_batch
from .workloads import BenchRequest, Workload

POLICIES = ("round-robin", "least-loaded", "prefix")


@dataclass
class FleetResult:
    """Counts of one simulated run."""

    workload: str
    replicas: int
    route: str
    queries: int = 0
    hits: int = 0
    prefill_computed: int = 0
    steps: int = 0
    preemptions: int = 0
    routed: list[int] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    @property
    def imbalance(self) -> float:
        """max / mean requests routed per replica (1.0 = perfectly even)."""
        mean = sum(self.routed) / len(self.routed)
        return max(self.routed) / mean if mean else 1.0

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "hit_rate": self.hit_rate, "imbalance": self.imbalance}


class _Replica:
    def __init__(self, name: str, num_blocks: int, block_size: int) -> None:
        self.name = name
        self.mgr = KVCacheManager(num_blocks, block_size, hash_mode="sha256", enable_events=True)
        self.waiting: deque[BenchRequest] = deque()
        self.running: dict[str, list] = {}  # rid -> [request, tokens decoded]
        self.preempted: set[str] = set()  # re-admissions count apart in the stats


def simulate(workload: Workload, replicas: int, route: str, *, block_size: int = 16,
             pool_blocks: int | None = None, rate: float = 0.5, max_running: int = 64,
             **router_options: float) -> FleetResult:
    """Run ``workload`` through ``replicas`` simulated replicas routed by ``route`` (one
    of POLICIES). ``pool_blocks``: each replica's pool (default: the workload's pool).
    ``rate``: new requests per replica per step. ``router_options``: Router keywords
    (load_weight, balance, ...). Raises ValueError for an unknown route,
    ``replicas`` < 1, ``rate`` <= 0, or a request that cannot run alone in a pool."""
    if route not in POLICIES or replicas < 1 or not rate > 0:
        raise ValueError(f"need route in {POLICIES}, replicas >= 1, rate > 0; got "
                         f"{route!r}, {replicas}, {rate}")
    num_blocks = pool_blocks or workload.pool_tokens // block_size
    fleet = [_Replica(f"r{i}", num_blocks, block_size) for i in range(replicas)]
    by_name = {r.name: r for r in fleet}
    router = Router([r.name for r in fleet], block_size=block_size, policy=route,
                    **router_options)
    res = FleetResult(workload.name, replicas, route)
    pending = deque(workload.requests)
    finished: set[str] = set()
    credit = 0.0
    while pending or any(r.waiting or r.running for r in fleet):
        res.steps += 1
        credit = min(credit + rate * replicas, float(replicas * max_running))
        for req in list(pending) if credit >= 1 else ():
            if req.after is not None and req.after not in finished:
                continue  # the next turn waits for its answer; later sessions go first
            pending.remove(req)
            by_name[router.route(req.prompt, req.extra).replica].waiting.append(req)
            credit -= 1
            if credit < 1:
                break
        for rep in fleet:
            for rid in _step(rep, res, max_running):
                router.finish(rep.name)
                finished.add(rid)
            _, events, _ = decode_batch(encode_batch(rep.mgr.take_events(), block_size=block_size))
            router.apply(rep.name, events)
        if res.steps > 10_000_000:  # pragma: no cover - a bug, not a workload
            raise RuntimeError("simulation does not terminate")
    for rep in fleet:
        stats = rep.mgr.stats
        res.queries += stats.queries
        res.hits += stats.hits
    res.routed = [router.routed[r.name] for r in fleet]
    return res


def _step(rep: _Replica, res: FleetResult, max_running: int) -> list[str]:
    """Admit, decode one token each, free the finished; returns the finished ids."""
    mgr = rep.mgr
    while rep.waiting and len(rep.running) < max_running:
        req = rep.waiting[0]
        adm = mgr.add_request(req.rid, req.prompt, extra=req.extra,
                              resumed=req.rid in rep.preempted)
        assert not isinstance(adm, StoreWait), "the fleet's replicas have no shared store"
        if adm is None:
            if not rep.running:
                raise ValueError(f"request {req.rid!r} does not fit alone in a pool of "
                                 f"{mgr.num_blocks} blocks")
            break
        rep.waiting.popleft()
        rep.running[req.rid] = [req, 0]
        res.prefill_computed += adm.num_new_tokens
    done = []
    for rid in list(rep.running):
        state = rep.running.get(rid)
        if state is None:
            continue
        req, pos = state
        while mgr.append_tokens(rid, req.output[pos:pos + 1]) is None:
            victim = next(reversed(rep.running))  # newest first, as the bench replay does
            vreq, vpos = rep.running.pop(victim)
            mgr.free(victim)
            res.preemptions += 1
            rep.preempted.add(victim)
            rep.waiting.appendleft(BenchRequest(vreq.rid, vreq.prompt + vreq.output[:vpos],
                                                vreq.output[vpos:], vreq.extra, vreq.after))
            if victim == rid:
                break
        else:
            state[1] = pos + 1
            if state[1] == len(req.output):
                del rep.running[rid]
                mgr.free(rid)
                done.append(rid)
    return done

"""A fleet by simulation: N managers behind the router, driven by a workload.

Every replica is a ``KVCacheManager`` with the pool a single replica gets in
``prefixkv bench``; routing is decided by ``prefixkv.router.Router`` (the code a real
router runs), fed with each replica's events through the vLLM wire format after every
step (``encode_batch`` -> ``decode_batch`` -> ``Router.apply``). One step::

    arrivals (``rate`` per replica, in workload order, skipping a chat turn whose
    previous turn has not finished) -> route each -> every replica admits what fits (FIFO, at most
    ``max_running``), decodes one token per running request (preempting its newest
    request when the pool is full), frees finished ones -> events and a load report
    (KV usage, queue depth) to the router

Routes: the router's policies ``round-robin``, ``least-loaded`` and ``prefix`` (its
default scorer, prefix affinity under a load cap); ``pure-prefix``: the longest cached
run alone (no load term, no cap); ``cost``: ``CostScorer`` (Dynamo's
cost, each replica's pool as its capacity); ``cost-approx``: the same with no events,
the router's ``ApproxIndex`` (TTL ``approx_ttl`` steps) guessing from its own decisions.

Reported per (workload, N, route): fleet hit rate (hit / queried prompt tokens of new
requests, summed over replicas), prefill tokens computed, load imbalance (max / mean
requests routed per replica), and the TTFT proxy, in tokens: the work of the steps a
request's replica runs from the step it is routed there to the step that computes its
prefill, both included, each step charged for its whole batch (the prompt tokens it
computes, re-admissions included, plus one token per request that was running before
it and decodes); mean and 90th percentile. Why this models TTFT: docs/router.md.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass, field

from ..core.manager import KVCacheManager
from ..errors import PromptTooLongError
from ..fleet.wire import encode_batch
from ..results import StoreWait
from ..router import Router, decode_batch
from ..router.approx import ApproxIndex
from ..router.load import ReplicaLoad
from ..router.scorer import AffinityScorer, CostScorer
from .errors import BenchError, shorten
from .limits import MAX_BLOCK_SIZE, MAX_POOL_BLOCKS, MAX_REPLICAS
from .workloads import BenchRequest, Workload

POLICIES = ("round-robin", "least-loaded", "pure-prefix", "prefix", "cost", "cost-approx")


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
    ttft: dict[str, int] = field(default_factory=dict, repr=False)  # TTFT proxy per request

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    @property
    def imbalance(self) -> float:
        """max / mean requests routed per replica (1.0 = perfectly even)."""
        mean = sum(self.routed) / len(self.routed)
        return max(self.routed) / mean if mean else 1.0

    @property
    def ttft_mean(self) -> float:
        """The TTFT proxy's mean over requests (module doc), in tokens."""
        return sum(self.ttft.values()) / len(self.ttft) if self.ttft else 0.0

    @property
    def ttft_p90(self) -> int:
        q = sorted(self.ttft.values())
        return q[int(0.9 * (len(q) - 1))] if q else 0

    def to_dict(self) -> dict[str, object]:
        out = {**asdict(self), "hit_rate": self.hit_rate, "imbalance": self.imbalance,
               "ttft_mean": self.ttft_mean, "ttft_p90": self.ttft_p90}
        del out["ttft"]
        return out


@dataclass(slots=True)
class _Running:
    """A request admitted on a replica and how many of its output tokens it decoded."""

    req: BenchRequest
    decoded: int = 0


class _Replica:
    def __init__(self, name: str, num_blocks: int, block_size: int) -> None:
        self.name = name
        self.mgr = KVCacheManager(num_blocks, block_size, hash_mode="sha256", enable_events=True)
        self.waiting: deque[BenchRequest] = deque()
        self.running: dict[str, _Running] = {}  # admission order: the newest is last
        self.preempted: set[str] = set()  # re-admissions count apart in the stats
        self.work = 0  # tokens in every batch this replica has run (the TTFT proxy's clock)
        # per request routed here, until its first admission: ``work`` when it came
        self.since: dict[str, int] = {}


def _check(route: str, replicas: int, block_size: int, pool_blocks: int | None, rate: float,
           max_running: int, approx_ttl: float) -> None:
    if route not in POLICIES:
        raise BenchError(f"route must be one of {', '.join(POLICIES)}, got {shorten(route)}")
    counts = dict(replicas=(replicas, MAX_REPLICAS), block_size=(block_size, MAX_BLOCK_SIZE),
                  pool_blocks=(1 if pool_blocks is None else pool_blocks, MAX_POOL_BLOCKS),
                  max_running=(max_running, None))
    for name, (value, most) in counts.items():
        if type(value) is not int or value < 1 or (most is not None and value > most):
            bound = f" <= {most:,}" if most is not None else ""
            raise BenchError(f"{name} must be an int >= 1{bound}, got {shorten(value)}")
    for name, number in (("rate", rate), ("approx_ttl", approx_ttl)):
        if type(number) not in (int, float) or not (math.isfinite(number) and number > 0):
            raise BenchError(f"{name} must be a finite number > 0, got {shorten(number)}")


def simulate(workload: Workload, replicas: int, route: str, *, block_size: int = 16,
             pool_blocks: int | None = None, rate: float = 0.5, max_running: int = 64,
             approx_ttl: float = 200.0, **router_options: object) -> FleetResult:
    """Run ``workload`` through ``replicas`` simulated replicas routed by ``route`` (one
    of POLICIES). ``pool_blocks``: each replica's pool (default: the workload's pool).
    ``rate``: new requests per replica per step. ``approx_ttl``: steps an ``ApproxIndex``
    guess lasts (``cost-approx``). ``router_options``: Router keywords (load_weight,
    balance, scorer, ...). Raises BenchError (a ValueError), before any replica is made,
    for an unknown route, ``replicas`` not an int in 1..``limits.MAX_REPLICAS``, a
    ``block_size`` (at most ``limits.MAX_BLOCK_SIZE``), ``pool_blocks`` or ``max_running``
    not an int >= 1, a ``rate`` or
    ``approx_ttl`` not a finite number > 0; and for a request that cannot run alone in a
    pool."""
    _check(route, replicas, block_size, pool_blocks, rate, max_running, approx_ttl)
    num_blocks = pool_blocks or max(1, workload.pool_tokens // block_size)
    fleet = [_Replica(f"r{i}", num_blocks, block_size) for i in range(replicas)]
    by_name = {r.name: r for r in fleet}
    res = FleetResult(workload.name, replicas, route)
    router = _router(route, [r.name for r in fleet], block_size, num_blocks, res, approx_ttl,
                     router_options)
    events = route != "cost-approx"  # an engine that publishes none
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
            rep = by_name[router.route(req.prompt, req.extra).replica]
            rep.since[req.rid] = rep.work
            rep.waiting.append(req)
            credit -= 1
            if credit < 1:
                break
        for rep in fleet:
            for rid in _step(rep, res, max_running):
                router.finish(rep.name)
                finished.add(rid)
            batch = rep.mgr.take_events()
            if events:
                router.apply(rep.name, decode_batch(encode_batch(batch, block_size=block_size))[1])
            router.report_load(rep.name, ReplicaLoad(
                rep.mgr.usage, len(rep.waiting), sum(len(r.prompt) for r in rep.waiting),
                num_blocks))
        if res.steps > 10_000_000:  # pragma: no cover - a bug, not a workload
            raise RuntimeError("simulation does not terminate")
    for rep in fleet:
        stats = rep.mgr.stats
        res.queries += stats.queries
        res.hits += stats.hits
    res.routed = [router.routed[r.name] for r in fleet]
    return res


def _router(route: str, names: list[str], block_size: int, num_blocks: int, res: FleetResult,
            approx_ttl: float, options: dict[str, object]) -> Router:
    """The router a route names; ``cost-approx``'s index counts time in steps."""
    if route == "pure-prefix":
        options = {"scorer": AffinityScorer(load_weight=0.0, balance=float(len(names))),
                   **options}
    if route in ("cost", "cost-approx"):
        options = {"scorer": CostScorer(prefill_weight=2.0, balance=1.1), **options}
        if route == "cost-approx":
            options["index"] = ApproxIndex(approx_ttl, clock=lambda: float(res.steps))
    return Router(names, block_size=block_size, policy="round-robin" if route == "round-robin"
                  else "least-loaded" if route == "least-loaded" else "prefix",
                  capacity=dict.fromkeys(names, num_blocks), **options)  # type: ignore[arg-type]


def _step(rep: _Replica, res: FleetResult, max_running: int) -> list[str]:
    """Admit, decode one token each, free the finished; returns the finished ids. The
    step's batch (prompt tokens computed + tokens decoded by requests admitted before it)
    is added to ``rep.work``, and each request admitted for the first time gets its TTFT
    proxy: ``rep.work`` now less ``rep.work`` when it was routed."""
    mgr = rep.mgr
    batch = 0
    first: list[str] = []  # admitted for the first time in this step
    while rep.waiting and len(rep.running) < max_running:
        req = rep.waiting[0]
        try:
            adm = mgr.add_request(req.rid, req.prompt, extra=req.extra,
                                  resumed=req.rid in rep.preempted)
        except PromptTooLongError:
            adm = None  # never fits: the error below, as when it does not fit alone
        assert not isinstance(adm, StoreWait), "the fleet's replicas have no shared store"
        if adm is None:
            if not rep.running:
                raise BenchError(f"request {req.rid!r} does not fit alone in a pool of "
                                 f"{mgr.num_blocks} blocks")
            break
        rep.waiting.popleft()
        rep.running[req.rid] = _Running(req)
        res.prefill_computed += adm.num_new_tokens
        batch += adm.num_new_tokens
        if req.rid in rep.since:
            first.append(req.rid)
    done = []
    for rid in list(rep.running):
        state = rep.running.get(rid)
        if state is None:
            continue
        req, pos = state.req, state.decoded
        while mgr.append_tokens(rid, req.output[pos:pos + 1]) is None:
            victim = next(reversed(rep.running))  # newest first, as the bench replay does
            vstate = rep.running.pop(victim)
            vreq, vpos = vstate.req, vstate.decoded
            mgr.free(victim)
            res.preemptions += 1
            rep.preempted.add(victim)
            rep.waiting.appendleft(BenchRequest(vreq.rid, vreq.prompt + vreq.output[:vpos],
                                                vreq.output[vpos:], vreq.extra, vreq.after))
            if victim == rid:
                break
        else:
            state.decoded = pos + 1
            batch += pos > 0  # a request's first token comes from its prefill's forward pass
            if state.decoded == len(req.output):
                del rep.running[rid]
                mgr.free(rid)
                done.append(rid)
    rep.work += batch
    for rid in first:
        res.ttft[rid] = rep.work - rep.since.pop(rid)
    return done

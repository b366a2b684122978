"""Random runs of two vLLM 0.33 replicas (vLLM's own Scheduler, or its AsyncScheduler
pipelined as vLLM's engine core runs it; pools small enough to
preempt) sharing one real Redis that misbehaves. Replica A serves requests (prefixes of
two prompts, two tenants, aborts at random steps) and saves them; then stored values are
corrupted, swapped between keys, replaced by another Redis type or deleted, the server
may restart empty; then B serves requests over the same prefixes (loading, failing
loads, recomputing) while A serves more, aborts again at random steps. After every step,
every computed full block of every running request holds its own tokens' KV, byte for
byte; at the end every block of both replicas is back."""

from __future__ import annotations

import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixkv.store.server import LocalRedis

from .. import skip_module_without_vllm
from ..spoil import spoil_one
from .replica import BLOCK, Replica
from .test_async_loads import free_blocks, kv_is

skip_module_without_vllm()

_BASES = [[(i * k + 3) % 997 + 1 for i in range(6 * BLOCK)] for k in (7, 11)]

# (base prompt, its length, tokens of its own after it, output tokens, tenant, abort at
# this step of its replica or never)
_request = st.tuples(st.integers(0, 1),
                     st.sampled_from([6 * BLOCK, 5 * BLOCK + 1, 3 * BLOCK + 7, 2 * BLOCK, 7]),
                     st.integers(0, BLOCK + 5), st.integers(1, BLOCK + 3),
                     st.sampled_from([None, None, "t1"]),
                     st.sampled_from([None, None, None, 0, 1, 2, 3, 5, 8]))
_spoil = st.tuples(st.sampled_from(["flip", "swap", "list", "delete"]), st.integers(0, 1 << 16))


def _check_running(replica: Replica) -> None:
    for r in replica.scheduler.running:
        full = r.num_computed_tokens // BLOCK
        replica.tables[r.request_id] = replica.block_ids(r.request_id)
        assert kv_is(replica, r.request_id, list(r.all_token_ids), full), (r.request_id, full)


class _Run:
    """The replicas, their requests' abort steps, and the steps each has run."""

    def __init__(self, replicas: list[Replica]) -> None:
        self.replicas = replicas
        self.aborts: list[dict[str, int]] = [{}, {}]
        self.steps = [0, 0]
        self.names = 0
        self.check = _check_running
        self.prompts: list[tuple[list[int], str | None]] = []  # (tokens, salt) added

    def targets(self) -> list[bytes]:
        """The store keys of the full blocks of every prompt added so far."""
        from .test_store_faults import keys_of

        replica = self.replicas[0]
        return [k for tokens, salt in self.prompts
                for k in keys_of(replica, tokens, len(tokens) // BLOCK, salt)]

    def add(self, which: int, spec: tuple) -> None:
        base, length, own, out, salt, abort_at = spec
        tokens = _BASES[base][:length] + [(self.names * 13 + j) % 997 + 1 for j in range(own)]
        name = f"q{self.names}"
        self.names += 1
        self.prompts.append((tokens, salt))
        self.replicas[which].add(name, tokens, max_tokens=out, salt=salt)
        if abort_at is not None:
            self.aborts[which][name] = self.steps[which] + abort_at

    def step(self, which: int) -> None:
        from vllm.v1.request import RequestStatus

        replica = self.replicas[which]
        for name, at in list(self.aborts[which].items()):
            if at <= self.steps[which]:
                del self.aborts[which][name]
                replica.scheduler.finish_requests(name, RequestStatus.FINISHED_ABORTED)
        replica.step()
        self.steps[which] += 1
        self.check(replica)

    def drain(self, which: tuple[int, ...]) -> None:
        deadline = time.monotonic() + 60
        while any(self.replicas[i].scheduler.has_requests() for i in which):
            assert time.monotonic() < deadline, "requests still held"
            for i in which:
                if self.replicas[i].scheduler.has_requests():
                    self.step(i)
            time.sleep(0.001)
        for i in which:
            self.replicas[i].worker.worker.flush()

    def play(self, server: LocalRedis, first, spoils, restart: int, second) -> None:
        """A serves ``first``; ``spoils`` spoil stored values (and the server restarts
        when ``restart`` is 0); then both serve ``second``; every block goes back."""
        idle = [free_blocks(r) for r in self.replicas]
        for spec in first:
            self.add(0, spec)
        self.drain((0,))
        client = self.replicas[0].worker.worker._link.backend.client
        for how, pick in spoils:
            spoil_one(client, how, pick, self.targets())
        if restart == 0:
            server.stop()
            server.start()
        for which, spec in second:  # (mostly B, A serves more too; an int: the prompt
            if isinstance(spec, int):  # of one of A's first requests, served again)
                spec = (*first[spec % len(first)][:5], None)
            self.add(0 if which == 2 else 1, spec)
        self.drain((0, 1))
        for replica, blocks in zip(self.replicas, idle, strict=True):
            assert free_blocks(replica) == blocks
            replica.scheduler.shutdown()
            replica.worker.shutdown()


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(first=st.lists(_request, min_size=1, max_size=3),
       spoils=st.lists(_spoil, max_size=3), restart=st.integers(0, 7),
       second=st.lists(st.tuples(st.integers(0, 2), st.one_of(st.integers(0, 2), _request)),
                       min_size=1, max_size=4),
       layouts=st.sampled_from([("LBNHC", "LBHNC"), ("LBHNC", "LBNHC")]))
def test_random_faults_never_put_other_kv_in_a_running_request(model, first, spoils, restart,
                                                               second, layouts):
    with LocalRedis() as server:
        run = _Run([Replica(model, server.url, layout=lay, num_blocks=14, lookup_timeout=1.0,
                            timeout=1.0) for lay in layouts])
        run.play(server, first, spoils, restart, second)


class _Pipelined(Replica):
    """A replica on vLLM's own AsyncScheduler, stepped as vLLM's engine core runs it
    (step N+1 scheduled and run before step N's output is processed). Its stand-in
    forward writes a position whose token is not known yet (sampled by the step whose
    output is still in flight) with the token the stand-in sampler always gives (7)."""

    def __init__(self, *args: object, **kw: object) -> None:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.structured_output import StructuredOutputManager

        super().__init__(*args, **kw)
        self.config.scheduler_config.async_scheduling = True
        self.scheduler = AsyncScheduler(vllm_config=self.config, kv_cache_config=self.kv_config,
                                        structured_output_manager=StructuredOutputManager(
                                            self.config),
                                        block_size=BLOCK, log_stats=True)
        self.pending = None

    def forward(self, out) -> None:
        from .replica import kv_value

        starts = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for req_id, n in out.num_scheduled_tokens.items():
            request, ids = self.scheduler.requests[req_id], self.block_ids(req_id)
            self.tables[req_id] = ids
            tokens = list(request.all_token_ids)
            for pos in range(starts[req_id], starts[req_id] + n):
                token = tokens[pos] if pos < len(tokens) else 7
                for layer, name in enumerate(sorted(self.kv)):
                    self.kv[name][ids[pos // BLOCK], :, pos % BLOCK] = kv_value(token, pos, layer)

    def step(self, after_schedule=None):
        from .test_async_held_blocks import _work

        out = self.scheduler.schedule()
        ran = _work(self, out) if out.total_num_scheduled_tokens or out.kv_connector_metadata else None
        if self.pending is not None:
            self.scheduler.update_from_output(*self.pending)
        self.pending = (out, ran) if ran is not None else None
        return out


def _check_pipelined(replica: Replica) -> None:
    for r in replica.scheduler.running:
        full = r.num_computed_tokens // BLOCK
        tokens = list(r.all_token_ids)
        tokens += [7] * (full * BLOCK - len(tokens))  # (sampled, not delivered yet)
        replica.tables[r.request_id] = replica.block_ids(r.request_id)
        assert kv_is(replica, r.request_id, tokens, full), (r.request_id, full)


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(first=st.lists(_request, min_size=1, max_size=3),
       spoils=st.lists(_spoil, max_size=3), restart=st.integers(0, 7),
       second=st.lists(st.tuples(st.integers(0, 2), st.one_of(st.integers(0, 2), _request)),
                       min_size=1, max_size=4))
def test_random_faults_under_async_scheduling(model, first, spoils, restart, second):
    """As above, both replicas on vLLM's AsyncScheduler, pipelined."""
    with LocalRedis() as server:
        run = _Run([_Pipelined(model, server.url, layout=lay, num_blocks=14, lookup_timeout=1.0,
                               timeout=1.0) for lay in ("LBNHC", "LBHNC")])
        run.check = _check_pipelined
        run.play(server, first, spoils, restart, second)

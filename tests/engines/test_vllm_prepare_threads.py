"""Prepared prompts under real threads: vLLM 0.33's own ``EngineCore`` (tests/engines/
vllm_engine.py) builds requests on an input thread, which prepares each prompt for
prefixkv, while the scheduler's thread (this one) schedules, takes outputs, preempts
(the pool is small), aborts and resumes streaming sessions.

Twins: two engines with prefixkv's ``Scheduler`` run the same stream; the first's
requests are built with prefixkv's preparing hasher, the second's with vLLM's hasher
alone (every admission reads the ids, as before prepared prompts). Each step both must
schedule alike (tokens per request, computed tokens of new requests, preemptions). And
a model of the KV (what each scheduled token wrote into which block) checks, in the
first engine, that every block a new or resumed request starts with holds that
request's own tokens: a stale Prompt must never give a hit on other content. The GIL
switch interval is cut so that the input thread's ``prepare`` interleaves with the
scheduler's admissions, frees and evictions. Needs vllm installed."""

from __future__ import annotations

import os
import queue
import random
import sys
import threading
from typing import Any

import pytest

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")

from .vllm_engine import BS, PREFIXKV, engine_core, engine_request  # noqa: E402

STEPS = 70
MAX_LEN = 256


class Fed:
    """An engine and its input thread: ``preprocess_add_request`` on each request it is
    sent, as vLLM's input thread does, the built ``Request`` queued for the scheduler."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.inbox: queue.Queue[Any] = queue.Queue()
        self.built: queue.Queue[Any] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="input", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (sent := self.inbox.get()) is not None:
            try:
                self.built.put(self.engine.preprocess_add_request(sent)[0])
            except BaseException as e:  # handed to the scheduler's thread
                self.built.put(e)

    def take(self) -> Any:
        r = self.built.get(timeout=60)
        if isinstance(r, BaseException):
            raise r
        return r


class KVModel:
    """What each block of an engine holds: block id -> the token ids written into it
    (and the request's cache salt), from the steps' scheduler outputs."""

    def __init__(self, engine: Any) -> None:
        self.sched = engine.scheduler
        self.held: dict[int, tuple[Any, ...]] = {}

    def check_hits(self, out: Any) -> int:
        """Each new or resumed request's blocks under its computed tokens hold its own
        tokens; returns how many such blocks were checked."""
        checked = 0
        cached = out.scheduled_cached_reqs
        starts = [(n.req_id, n.num_computed_tokens) for n in out.scheduled_new_reqs]
        starts += [(rid, cached.num_computed_tokens[i]) for i, rid in enumerate(cached.req_ids)
                   if rid in cached.resumed_req_ids]
        for rid, computed in starts:
            r = self.sched.requests[rid]
            ids = self.sched.kv_cache_manager.get_block_ids(rid)[0]
            toks = list(r.all_token_ids)
            for j in range(computed // BS):
                want = (r.cache_salt, *toks[j * BS:(j + 1) * BS])
                assert self.held.get(ids[j]) == want, (
                    f"wrong KV: {rid} starts with block {ids[j]} holding {self.held.get(ids[j])}, "
                    f"its block {j} is {want}")
                checked += 1
        return checked

    def wrote(self, out: Any) -> None:
        """The step ran: each scheduled request wrote its scheduled positions."""
        for rid, n in out.num_scheduled_tokens.items():
            r = self.sched.requests[rid]
            end = r.num_computed_tokens  # (vLLM advanced it when it scheduled)
            ids = self.sched.kv_cache_manager.get_block_ids(rid)[0]
            toks = list(r.all_token_ids)
            for j in range((end - n) // BS, end // BS):
                self.held[ids[j]] = (r.cache_salt, *toks[j * BS:(j + 1) * BS])


def _outputs(out: Any, step: int) -> Any:
    """The model's answer: one sampled token per request whose scheduled tokens reach the
    end of what it knows (a few token values, so outputs repeat prompts' content)."""
    from vllm.v1.outputs import ModelRunnerOutput

    rids = sorted(out.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=rids, req_id_to_index={r: i for i, r in enumerate(rids)},
                             sampled_token_ids=[[(hash(r) + step) % 5] for r in rids])


def _stream(seed: int) -> list[list[tuple[str, dict[str, Any]]]]:
    """Per step, the requests that arrive (id, ``engine_request`` fields): prompts cut
    from a few shared documents, some salted, some streaming sessions with a next chunk
    later, and aborts (``("abort", {"id": ...})``)."""
    rnd = random.Random(seed)
    docs = [[rnd.randrange(5) for _ in range(120)] for _ in range(3)]
    steps: list[list[tuple[str, dict[str, Any]]]] = [[] for _ in range(STEPS)]
    for i in range(40):
        at = rnd.randrange(STEPS - 10)
        doc = rnd.choice(docs)
        tokens = doc[:rnd.randrange(1, 100)] + [rnd.randrange(5) for _ in range(rnd.randrange(4))]
        kw: dict[str, Any] = {"tokens": tokens, "max_tokens": rnd.randrange(1, 40),
                              "cache_salt": rnd.choice([None, None, "t1"])}
        kind = rnd.random()
        if kind < 0.15:  # a streaming session: a next chunk, then the end
            kw["resumable"] = True
            steps[at].append((f"s{i}", kw))
            more = {**kw, "tokens": [rnd.randrange(5) for _ in range(rnd.randrange(1, 30))]}
            steps[at + rnd.randrange(1, 5)].append((f"s{i}", more))
            steps[at + rnd.randrange(6, 10)].append((f"s{i}", {**more, "resumable": False}))
        else:
            steps[at].append((f"r{i}", kw))
            if kind > 0.9:
                steps[at + rnd.randrange(0, 6)].append(("abort", {"id": f"r{i}"}))
    return steps


def _engines() -> tuple[Fed, Fed]:
    from prefixkv.integrations.vllm.prepared import PreparingHasher

    prepared, ids = (engine_core(PREFIXKV, num_blocks=20, max_model_len=MAX_LEN) for _ in range(2))
    assert isinstance(prepared.request_block_hasher, PreparingHasher)
    ids.request_block_hasher = ids.request_block_hasher.vllm_hasher  # vLLM's own: the ids path
    return Fed(prepared), Fed(ids)


@pytest.mark.parametrize("seed", [1, 2])
def test_prompts_prepared_on_the_input_thread_schedule_as_the_ids_and_never_hit_other_content(seed):
    fed = _engines()
    model = KVModel(fed[0].engine)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    checked = preempted = 0
    try:
        for step, arrivals in enumerate(_stream(seed)):
            for rid, kw in arrivals:  # sent to both input threads, which build them meanwhile
                if rid != "abort":
                    for f in fed:
                        f.inbox.put(engine_request(rid, list(kw["tokens"]), max_tokens=kw["max_tokens"],
                                                   cache_salt=kw["cache_salt"],
                                                   resumable=kw.get("resumable", False)))
            for rid, kw in arrivals:
                for f in fed:
                    if rid == "abort":
                        f.engine.scheduler.finish_requests(kw["id"], _aborted())
                    else:
                        f.engine.scheduler.add_request(f.take())
            outs = [f.engine.scheduler.schedule() for f in fed]
            seen = [(dict(o.num_scheduled_tokens), sorted((n.req_id, n.num_computed_tokens)
                                                           for n in o.scheduled_new_reqs),
                     sorted(o.preempted_req_ids or ())) for o in outs]
            assert seen[0] == seen[1], (step, seen)
            preempted += len(seen[0][2])
            model.wrote(outs[0])  # (a step's K/V is written before any is read: a hit may
            checked += model.check_hits(outs[0])  # be on blocks another request computes now)
            for f, o in zip(fed, outs, strict=True):
                f.engine.scheduler.update_from_output(o, _outputs(o, step))
            fed[0].engine.scheduler.kv_cache_manager.core.check_invariants()
    finally:
        sys.setswitchinterval(interval)
        for f in fed:
            f.inbox.put(None)
    prompts = fed[0].engine.scheduler.kv_cache_manager.prepared_prompts
    assert prompts.prepared > 30 and prompts.taken > 30, (prompts.prepared, prompts.taken)
    assert checked > 20 and preempted, (checked, preempted)
    assert fed[1].engine.scheduler.kv_cache_manager.prepared_prompts.prepared == 0


def _aborted() -> Any:
    from vllm.v1.request import RequestStatus

    return RequestStatus.FINISHED_ABORTED

"""The engine loop: schedule, run the model, sample, fork, finish, record.

One ``step()``::

    schedule (allocate / preempt)  ->  run the allocator's plan (take_kv_ops: offloads
    to the host tier, loads from it, fork copies)  ->  forward pass  ->  sample where a
    sequence's known tokens are all computed  ->  fork n > 1 samples after their first
    token  ->  free finished sequences  ->  drain stats and events (the events unbuilt:
    ``StepRecord.pending_events``, for a publisher's thread to build)

Forks and frees after the forward pass are the next step's scheduling: their copies and
evictions are in the next step's plan.

Generated blocks are cached by the allocator as ``append_tokens`` fills them; the engine
only has to append every sampled token.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Hashable
from collections.abc import Sequence as Seq

import torch

from prefixkv.allocator import Allocator
from prefixkv.errors import RequestError
from prefixkv.event_log import PendingEvents
from prefixkv.extra_keys import ExtraKeys, check_extra
from prefixkv.groups import HybridKVCacheManager
from prefixkv.hashing import encode_tokens

from .outputs import GenerateResult, RequestMetrics, RequestOutput, SampleOutput, StepRecord
from .runner import Runner, SeqBatchEntry
from .scheduler import Scheduler
from .sequence import SampleSeq, SamplingParams, Status


class Engine:
    """Continuous batching of requests over ``runner`` with blocks from ``allocator``.

    Args:
        runner: owns the model and a cache of at least ``allocator.num_blocks`` blocks of
            ``allocator.block_size`` slots, and host caches of as many slots as the
            allocator's host tier (``ModelRunner(host_blocks=...)``); for a
            ``HybridKVCacheManager``, a ``HybridModelRunner`` with the same groups.
        allocator: ``KVCacheManager`` (caching on or off), any ``prefixkv.Allocator``, or
            a ``HybridKVCacheManager``: the engine hands its block ids (one table, or one
            per group) to the runner as they are, and calls nothing group-specific.
        max_num_seqs: running sequences at most. max_num_batched_tokens: token budget of
            a step. chunked_prefill: split prompts over steps (needs ``extend``).
        max_model_len: a sequence stops at this many tokens (default: the model's
            ``max_position``, or the allocator's ``max_model_len`` if smaller).

    Raises ValueError when runner and allocator disagree on block size or count, or on
    the layer groups (one has groups, the other none or others).
    """

    def __init__(self, runner: Runner, allocator: Allocator | HybridKVCacheManager, *,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048, chunked_prefill: bool = False,
                 max_model_len: int | None = None) -> None:
        if allocator.block_size != runner.block_size or allocator.num_blocks > runner.num_blocks:
            raise ValueError(
                f"allocator has {allocator.num_blocks} blocks of {allocator.block_size}; the "
                f"runner's cache has {runner.num_blocks} blocks of {runner.block_size}")
        groups = (getattr(allocator, "groups", None), getattr(runner, "groups", None))
        if groups[0] != groups[1]:
            raise ValueError(f"allocator has layer groups {groups[0]}, the runner {groups[1]}")
        self.runner = runner
        self.allocator = allocator
        self.scheduler = Scheduler(allocator, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens,
                                   chunked_prefill=chunked_prefill)
        limits = [runner.model.cfg.max_position, max_model_len, getattr(allocator, "max_model_len", None)]
        self.max_model_len = min(x for x in limits if x is not None)
        self._groups: dict[Hashable, list[SampleSeq]] = {}
        self._finished: list[RequestOutput] = []
        self._ids = itertools.count()
        self._steps = 0
        self._last_events = PendingEvents.built([])  # the last step's, maybe unbuilt

    def add_request(self, prompt_token_ids: Seq[int], params: SamplingParams | None = None, *,
                    request_id: Hashable | None = None, extra: ExtraKeys | None = None) -> Hashable:
        """Queue a request; returns its id (a fresh int unless given). Its sequences are
        ``(request_id, sample_index)`` in the allocator. The prompt is checked and
        prepared now (``KVCacheManager.prepare``: encoded, cut and, where the manager
        needs it, hashed), off ``step``, which admits the Prompt. Raises ValueError for an
        empty prompt, one of ``max_model_len`` tokens or more, token ids that are not ints
        in ``[0, vocab_size)`` of the model (TokenError), extra keys that do not fit the
        prompt or that the allocator refuses (ExtraKeysError), params that are not
        SamplingParams, or an id in use or unhashable (RequestError): checked here, so
        that no queued request can make every later ``step`` raise."""
        seq = self._new_seq(prompt_token_ids, params, request_id, extra)
        self._queue([seq])
        return seq.request_id

    def _queue(self, seqs: list[SampleSeq]) -> None:
        for seq in seqs:
            self._groups[seq.request_id] = [seq]
            self.scheduler.waiting.append(seq)

    def _new_seq(self, prompt_token_ids: Seq[int], params: SamplingParams | None,
                 request_id: Hashable | None, extra: ExtraKeys | None) -> SampleSeq:
        """The checked first sequence of a request (``add_request``'s checks), prepared,
        not queued."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {params!r}")
        rid = next(self._ids) if request_id is None else request_id
        try:
            taken = rid in self._groups
        except Exception as exc:  # (unhashable, or its __hash__/__eq__ raised)
            raise RequestError(f"request id must be hashable, got {rid!r} ({exc!r})") from None
        if taken:
            raise RequestError(f"request {rid!r} is already in the engine")
        encoded = encode_tokens(prompt_token_ids, self.runner.model.cfg.vocab_size)
        prompt = encoded.tolist()
        if not 0 < len(prompt) < self.max_model_len:
            raise ValueError(f"prompt of {len(prompt)} tokens; need 1..{self.max_model_len - 1}")
        check_extra(extra, len(prompt))
        # prepared here, where the prompt arrives, not in the step: the step's admission
        # only looks it up and allocates (the baselines have no ``prepare``)
        prepare = getattr(self.allocator, "prepare", None)
        # (given the encoded array, ``prepare`` copies it instead of encoding the list again)
        prepared = prepare(encoded, extra=extra) if prepare is not None else None
        seq = SampleSeq(rid, 0, prompt, params, extra, time.perf_counter())
        seq.prepared = prepared
        return seq

    def has_unfinished(self) -> bool:
        """Whether any request is still waiting or running (``step`` has work)."""
        return bool(self._groups)

    def take_finished(self) -> list[RequestOutput]:
        """Requests finished since the previous call, in finishing order."""
        out, self._finished = self._finished, []
        return out

    def step(self) -> StepRecord:
        """Run one scheduling + forward + sampling step; see the module docstring."""
        t0 = time.perf_counter()
        sched, alloc = self.scheduler, self.allocator
        batch, preempted = sched.schedule()
        # The allocator's plan: offloads, loads, then fork copies (a copy into a freed
        # child's block is already dropped from it).
        sched.take_copies()
        self.runner.run_kv_ops(alloc.take_kv_ops())
        num_prefill = num_decode = forks = 0
        if batch:
            logits = self.runner.execute([
                SeqBatchEntry(alloc.get_block_ids(s.seq.seq_id), s.num_computed, s.new_token_ids)
                for s in batch])
            greedy = logits.argmax(dim=-1).tolist()  # one host sync for the whole batch
            now = time.perf_counter()
            for item, row, top in zip(batch, logits, greedy, strict=True):
                seq, n = item.seq, len(item.new_token_ids)
                seq.num_computed += n
                if item.is_prefill:
                    num_prefill += n
                    seq.num_prefill_computed += n
                else:
                    num_decode += n
                if seq.first_scheduled is None:
                    seq.first_scheduled = t0
                if seq.num_computed < seq.num_known:
                    continue  # mid-prefill chunk: no token to sample yet
                seq.output.append(top if seq.generator is None else seq.sample(row))
                if seq.first_token is None:
                    seq.first_token = now
                group = self._groups[seq.request_id]
                new = self._fork_children(seq, row) if seq.params.n > len(group) else []
                forks += sum(c.status is Status.RUNNING for c in new)
                for s in [seq, *new]:
                    reason = s.finish_check(self.max_model_len)
                    if reason is not None:
                        self._finish(s, reason, now)
        self._steps += 1
        return StepRecord(
            step=self._steps, num_seqs=len(batch), num_prefill_tokens=num_prefill,
            num_decode_tokens=num_decode, preempted=tuple(preempted), forks=forks,
            num_free_blocks=alloc.num_free_blocks,
            usage=alloc.usage, stats=alloc.take_stats(), pending_events=self._take_events(),
            seconds=time.perf_counter() - t0)

    def _take_events(self) -> PendingEvents:
        """The step's events, unbuilt where the allocator can hand them off; the previous
        step's batch is built first if nobody has (bounded memory; a publisher's thread
        built it during the forward pass, and then this costs nothing)."""
        self._last_events.build()
        take = getattr(self.allocator, "take_pending_events", None)
        self._last_events = (take() if take is not None
                             else PendingEvents.built(self.allocator.take_events()))
        return self._last_events

    def _fork_children(self, parent: SampleSeq, logits: torch.Tensor) -> list[SampleSeq]:
        """Samples 1..n-1 of ``parent``'s request, each with its own first token drawn
        from the parent's first logits, sharing its blocks through ``fork``."""
        group = self._groups[parent.request_id]
        children = []
        for i in range(len(group), parent.params.n):
            child = SampleSeq(parent.request_id, i, parent.prompt, parent.params, parent.extra,
                             parent.arrival)
            child.first_scheduled, child.first_token = parent.first_scheduled, parent.first_token
            child.num_cached_tokens = parent.num_cached_tokens
            child.output.append(child.sample(logits))
            group.append(child)
            self.scheduler.fork(parent, child)
            children.append(child)
        return children

    def _finish(self, seq: SampleSeq, reason: str, now: float) -> None:
        self.scheduler.finish(seq)
        seq.finish_reason, seq.finished = reason, now
        group = self._groups[seq.request_id]
        if len(group) == seq.params.n and all(s.status is Status.FINISHED for s in group):
            del self._groups[seq.request_id]
            self._finished.append(_request_output(group))

    def generate(self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams] | None = None,
                 *, extra: ExtraKeys | Seq[ExtraKeys | None] | None = None,
                 on_step: Callable[[StepRecord], None] | None = None) -> GenerateResult:
        """Run ``prompts`` (token id lists) to completion, together with anything already
        queued; ``params``/``extra`` are one for all or one per prompt. ``on_step`` sees
        every StepRecord (tests call ``check_invariants()`` there). Returns the outputs
        of these prompts in order, every step taken and the wall time. Raises as
        ``add_request`` for any prompt, before any is queued."""
        t0 = time.perf_counter()
        k = len(prompts)
        ps = [params] * k if params is None or isinstance(params, SamplingParams) else list(params)
        xs = [extra] * k if extra is None or isinstance(extra, ExtraKeys) else list(extra)
        if len(ps) != k or len(xs) != k:
            raise ValueError(f"{k} prompts but {len(ps)} params and {len(xs)} extra keys")
        seqs = [self._new_seq(p, sp, None, x) for p, sp, x in zip(prompts, ps, xs, strict=True)]
        self._queue(seqs)  # (all checked: none is queued if one is refused)
        ids = [seq.request_id for seq in seqs]
        steps, done = [], {}
        while self.has_unfinished():
            rec = self.step()
            steps.append(rec)
            if on_step is not None:
                on_step(rec)
            for out in self.take_finished():
                done[out.request_id] = out
        return GenerateResult(tuple(done[i] for i in ids), tuple(steps), time.perf_counter() - t0)


def _request_output(group: list[SampleSeq]) -> RequestOutput:
    head = group[0]
    first_token, first_scheduled = head.first_token, head.first_scheduled
    finished = [s.finished for s in group]
    reasons = [s.finish_reason for s in group]
    assert first_token is not None and first_scheduled is not None, "a finished request ran"
    assert None not in finished and None not in reasons, "every sample of the group finished"
    metrics = RequestMetrics(
        num_prompt_tokens=len(head.prompt), num_cached_tokens=head.num_cached_tokens or 0,
        num_prefill_tokens=sum(s.num_prefill_computed for s in group),
        num_preemptions=sum(s.num_preemptions for s in group),
        ttft=first_token - head.arrival, prefill_time=first_token - first_scheduled,
        e2e=max(f for f in finished if f is not None) - head.arrival)
    samples = tuple(SampleOutput(s.index, tuple(s.output), r)
                    for s, r in zip(group, reasons, strict=True) if r is not None)
    return RequestOutput(head.request_id, tuple(head.prompt), samples, metrics)

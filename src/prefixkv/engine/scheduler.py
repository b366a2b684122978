"""Continuous-batching scheduler over any allocator following ``prefixkv.Allocator``.

Each step, under a token budget::

    1. running sequences, oldest admission first: a decode appends its pending token
       (``append_tokens``), an unfinished prefill takes its next chunk (``extend``);
       on a None result the most recently admitted running sequence is preempted
       (possibly the one asking) and the call is retried;
    2. waiting sequences, FIFO with preempted ones in front: ``add_request`` looks the
       prefix up and allocates atomically; on None admission stops for this step
       (running sequences are never preempted to admit new ones: that would thrash).

Every call is part of the ``prefixkv.Allocator`` protocol, including ``extend`` (chunked
prefill), ``lookup`` (budget check before admission) and ``preempt``; a
``HybridKVCacheManager`` takes the same calls (only its block ids, which the scheduler
never reads, come one table per group).
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import cast

from prefixkv.allocator import Allocator
from prefixkv.errors import PromptTooLongError
from prefixkv.groups import HybridKVCacheManager
from prefixkv.results import BlockCopy, StoreWait

from .sequence import SampleSeq, Status


@dataclass(frozen=True, slots=True)
class Scheduled:
    """A sequence's work this step: ``new_token_ids`` at positions ``num_computed ..``."""

    seq: SampleSeq
    num_computed: int
    new_token_ids: list[int]
    is_prefill: bool


class Scheduler:
    """Waiting/running queues and the allocator calls that move sequences between them.

    Raises ValueError when a limit is below 1.
    """

    def __init__(self, allocator: Allocator | HybridKVCacheManager, *, max_num_seqs: int,
                 max_num_batched_tokens: int,
                 chunked_prefill: bool) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(f"max_num_seqs ({max_num_seqs}) and max_num_batched_tokens "
                             f"({max_num_batched_tokens}) must be >= 1")
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.waiting: collections.deque[SampleSeq] = collections.deque()
        self.running: list[SampleSeq] = []  # admission order: running[-1] is preempted first
        self._copies: dict[Hashable, tuple[BlockCopy, ...]] = {}
        self._admissions = 0

    def schedule(self) -> tuple[list[Scheduled], list[Hashable]]:
        """This step's work and the ids of sequences preempted to make room.

        Raises RuntimeError when a waiting sequence cannot be admitted although no block
        is held by anyone (the pool is smaller than that sequence).
        """
        budget = self.max_num_batched_tokens
        out: list[Scheduled] = []
        preempted: list[Hashable] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            item = self._grow(seq, budget)
            while item is None and seq.status is Status.RUNNING:
                victim = self.running[-1]
                self.preempt(victim)
                preempted.append(victim.seq_id)
                if victim is not seq:
                    item = self._grow(seq, budget)
            if item is None:
                break  # seq preempted itself: it was the last running one
            out.append(item)
            budget -= len(item.new_token_ids)
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            item = self._admit(self.waiting[0], budget, bool(out))
            if item is None:
                break
            self.waiting.popleft()
            out.append(item)
            budget -= len(item.new_token_ids)
        return out, preempted

    def _grow(self, seq: SampleSeq, budget: int) -> Scheduled | None:
        if seq.num_known > seq.num_computed:  # the next prefill chunk
            n = min(seq.num_known - seq.num_computed, budget)
            if self.allocator.extend(seq.seq_id, n) is None:
                return None
            return Scheduled(seq, seq.num_computed, seq.tokens[seq.num_computed:seq.num_computed + n], True)
        new = [seq.output[-1]]  # the pending token sampled last step
        if self.allocator.append_tokens(seq.seq_id, new) is None:
            return None
        seq.num_known += 1
        return Scheduled(seq, seq.num_computed, new, False)

    def _admit(self, seq: SampleSeq, budget: int, others: bool) -> Scheduled | None:
        alloc = self.allocator
        tokens, resumed = seq.tokens, seq.num_preemptions > 0
        # the Prompt prepared on arrival while the sequence is its prompt alone (not once
        # it has output: a preempted or forked-late sample re-admits its tokens); only an
        # allocator with ``prepare`` made one, and it takes it where it takes token ids
        given: Sequence[int] = tokens
        extra = seq.extra
        if seq.prepared is not None and not seq.output:
            given, extra = cast("Sequence[int]", seq.prepared), None
        try:
            if self.chunked_prefill:
                adm = alloc.add_request(seq.seq_id, given, extra=extra,
                                        num_new_tokens=budget, resumed=resumed)
            else:
                uncached = len(tokens) - alloc.lookup(given, extra=extra)
                if others and uncached > budget:
                    return None  # alone in a step, a prompt may exceed the budget
                adm = alloc.add_request(seq.seq_id, given, extra=extra, resumed=resumed)
            never = False
        except PromptTooLongError:
            adm, never = None, True
        if adm is None:
            if not self.running or never:
                raise RuntimeError(
                    f"sequence {seq.seq_id!r} of {len(tokens)} tokens does not fit in an empty "
                    f"pool of {alloc.num_blocks} blocks of {alloc.block_size}")
            return None
        assert not isinstance(adm, StoreWait), "this engine's allocator has no shared store"
        self._start(seq)
        seq.num_computed = adm.num_cached_tokens
        seq.num_known = len(tokens)
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = adm.num_cached_tokens
        end = adm.num_cached_tokens + adm.num_new_tokens
        return Scheduled(seq, adm.num_cached_tokens, tokens[adm.num_cached_tokens:end], True)

    def _start(self, seq: SampleSeq) -> None:
        seq.status = Status.RUNNING
        seq.admitted = self._admissions
        self._admissions += 1
        self.running.append(seq)

    def fork(self, parent: SampleSeq, child: SampleSeq) -> bool:
        """Make ``child`` (its first token already sampled) share ``parent``'s KV. When
        the allocator is short, the child waits at the front of the queue instead and
        will be admitted with its own tokens (hitting the parent's cached blocks)."""
        res = self.allocator.fork(parent.seq_id, child.seq_id)
        if res is None:
            self.waiting.appendleft(child)
            return False
        self._start(child)
        child.num_computed, child.num_known = parent.num_computed, parent.num_known
        if res.copies:
            self._copies[child.seq_id] = res.copies
        return True

    def take_copies(self) -> list[BlockCopy]:
        """Block copies owed to live forked children; to make before the next forward."""
        out = [c for cs in self._copies.values() for c in cs]
        self._copies.clear()
        return out

    def preempt(self, seq: SampleSeq) -> None:
        """Release a running sequence's blocks and queue it first for re-admission."""
        known = self.allocator.preempt(seq.seq_id)
        assert list(known) == seq.tokens[:len(known)], (seq.seq_id, len(known))
        self.running.remove(seq)
        self._copies.pop(seq.seq_id, None)
        seq.status = Status.WAITING
        seq.num_computed = seq.num_known = 0
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: SampleSeq) -> None:
        """Free a finished sequence (running, or waiting after a fork fallback)."""
        if seq.status is Status.RUNNING:
            self.allocator.free(seq.seq_id)
            self.running.remove(seq)
            self._copies.pop(seq.seq_id, None)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED

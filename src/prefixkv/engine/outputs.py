"""What the engine hands back: finished requests with their metrics, and one record per
step with the allocator's stats and events drained during it."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from prefixkv.event_log import PendingEvents
from prefixkv.events import Event
from prefixkv.stats import PrefixCacheStats


@dataclass(frozen=True, slots=True)
class SampleOutput:
    """One sample of a request: its generated tokens and why it stopped (``"length"``
    or ``"stop"``)."""

    index: int
    token_ids: tuple[int, ...]
    finish_reason: str


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """Per-request measurements (seconds from ``time.perf_counter``).

    ``num_cached_tokens``: prompt tokens served from the cache at its first admission.
    ``num_prefill_tokens``: tokens computed by prefills of all its samples, including
    recomputation after preemption (decode tokens are not counted).
    ``ttft``: arrival to first sampled token. ``prefill_time``: first scheduling to first
    sampled token. ``e2e``: arrival to the last sample finishing.
    """

    num_prompt_tokens: int
    num_cached_tokens: int
    num_prefill_tokens: int
    num_preemptions: int
    ttft: float
    prefill_time: float
    e2e: float


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """A finished request: its prompt, its ``n`` samples in index order, its metrics."""

    request_id: Hashable
    prompt_token_ids: tuple[int, ...]
    samples: tuple[SampleOutput, ...]
    metrics: RequestMetrics

    @property
    def token_ids(self) -> tuple[int, ...]:
        """Sample 0's tokens (the only sample when ``n == 1``)."""
        return self.samples[0].token_ids


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One engine step.

    ``num_prefill_tokens`` / ``num_decode_tokens``: tokens computed in the forward pass
    (prefill chunks, re-admissions after preemption and fork fallbacks count as prefill).
    ``preempted``: sequence ids preempted while scheduling. ``forks``: children forked.
    ``stats``: the allocator's ``take_stats()``; ``usage``: fraction of blocks in use
    after scheduling. ``pending_events``: the step's events, taken unbuilt
    (``take_pending_events()``; built already for an allocator without that call): hand
    it to ``EventPublisher.publish`` and its thread builds them, so the engine's thread
    computes no chain hash; ``events`` builds them on first read, on the reader's thread.
    A batch nobody built is built by the engine at the end of the next step (so at most
    one waits unbuilt, and what it holds is freed).
    """

    step: int
    num_seqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    preempted: tuple[Hashable, ...]
    forks: int
    num_free_blocks: int
    usage: float
    stats: PrefixCacheStats
    pending_events: PendingEvents
    seconds: float

    @property
    def events(self) -> tuple[Event, ...]:
        """The step's events, oldest first, as ``take_events()`` returns them (built
        here on first read unless a publisher's thread built them already)."""
        return tuple(self.pending_events.build())


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """``outputs`` in prompt order, every step taken, and their totals."""

    outputs: tuple[RequestOutput, ...]
    steps: tuple[StepRecord, ...]
    seconds: float

    @property
    def num_prefill_tokens(self) -> int:
        """Prefill tokens computed over all steps (recomputation included)."""
        return sum(s.num_prefill_tokens for s in self.steps)

    @property
    def num_decode_tokens(self) -> int:
        """Decode tokens computed over all steps."""
        return sum(s.num_decode_tokens for s in self.steps)

    @property
    def num_preemptions(self) -> int:
        """Sequences preempted over all steps (one sequence may count several times)."""
        return sum(len(s.preempted) for s in self.steps)

    @property
    def stats(self) -> PrefixCacheStats:
        """Prefix-cache stats summed over the steps."""
        total = PrefixCacheStats()
        for s in self.steps:
            total = total + s.stats
        return total

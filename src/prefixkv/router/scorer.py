"""How the router picks among candidate replicas: a ``Scorer`` sees one ``ReplicaView``
per candidate (its predicted cached run for the prompt and its load) and returns the
position of the one to use. Two scorers:

- ``AffinityScorer`` (the default): prefix affinity under a bounded-load cap on requests
  in flight (see ``Router``).
- ``CostScorer``: the cost of serving the prompt there, in blocks, as NVIDIA Dynamo's KV
  router weighs it::

      cost = (prefill_weight * (queued prefill blocks + blocks of the prompt not cached)
              + active blocks + blocks of the prompt) / capacity

  with replicas whose published KV usage is at or above ``busy_threshold`` left out
  (unless every candidate is), optionally bounded load first (``balance``: a cap on
  requests in flight, ``under_cap`` rounded down; a cap on requests routed where every
  candidate caches the same, ``under_share``; the one candidate caching more of the
  prompt than all others picked; ``CostScorer``'s doc), and the pick the lowest cost
  (``temperature`` 0) or
  drawn with probability ``softmax(-cost / (temperature * mean cost))``. Dividing by
  each replica's capacity (its pool, in blocks) lets a larger replica carry more. Costs
  are compared in one unit: where some candidates state a capacity and others do not,
  one that does not is costed as if its pool were the mean of those stated (a cost in
  blocks beside costs in pools would make it look hundreds of times as loaded); where
  none does, costs are in blocks.

Both credit a replica's cached run the same way (``credited``): a GPU block 1, a CPU
block ``cpu_weight``, and the whole times ``lossy_weight`` (default 0.5) while the
replica's index is marked lossy (``ReplicaView.lossy`` > 0: a batch of its events was
lost, removals perhaps among them, so its run may name blocks it no longer holds) until
the index is emptied (``Router.forget``, an ``AllBlocksCleared``). A stale long run so
loses to a sound replica's real run over half its length; 0 counts a lossy replica's
hits as misses, 1 ignores the mark.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ..errors import PrefixKVError
from .options import check_int, check_number


class ScorerError(PrefixKVError):
    """A scorer option out of range."""


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """One candidate for one prompt of ``prompt_blocks`` full blocks. ``run``/``gpu_run``:
    its leading run of them held on any medium / on the GPU (the index's prediction).
    ``in_flight``: requests the router sent there, not finished. ``prefill_blocks`` and
    ``active_blocks``: its load (``LoadBook``); ``capacity``: its pool in blocks, None when
    unknown; ``kv_usage``: as last published, None when never; ``routed``: requests the
    router sent there since it started, finished or not; ``lossy``: batches of its events
    lost (undecodable) since its index was last emptied (``Router.lossy``: > 0, ``run``
    may overstate what it holds; the built-in scorers discount its run by their
    ``lossy_weight``, module doc)."""

    replica: str
    prompt_blocks: int
    run: int
    gpu_run: int
    in_flight: int
    prefill_blocks: float
    active_blocks: float
    capacity: int | None
    kv_usage: float | None
    routed: int = 0
    lossy: int = 0


def credited(v: ReplicaView, cpu_weight: float, lossy_weight: float) -> float:
    """Blocks of the prompt ``v`` caches as the built-in scorers count them (module doc):
    ``gpu_run + cpu_weight * (run - gpu_run)``, times ``lossy_weight`` when ``v.lossy``."""
    cached = v.gpu_run + cpu_weight * (v.run - v.gpu_run)
    return cached * lossy_weight if v.lossy else cached


def _fraction(name: str, value: object) -> None:
    """ScorerError unless ``value`` is a number in [0, 1] (a weight of a block)."""
    check_number(name, value, ScorerError, lambda v: 0 <= v <= 1, "a number in [0, 1]")


def _balance(value: object) -> None:
    """ScorerError unless ``value`` is a number >= 1 (inf: no cap)."""
    check_number("balance", value, ScorerError, lambda v: v >= 1, "a number >= 1")


class Scorer(Protocol):
    """Picks the replica for one prompt among the candidates' views."""

    def pick(self, views: Sequence[ReplicaView], turn: int) -> int:
        """The position in ``views`` (non-empty, in the router's rotation order from
        ``turn``) of the replica to route to."""


def default_scorer(scorer: Scorer | None, **tunables: float | None) -> Scorer:
    """``scorer``, or when None an ``AffinityScorer`` with the ``tunables`` that are not
    None (the router's keywords). Raises ScorerError for a tunable out of range or of
    another type, and for tunables given beside a ``scorer`` (they would be ignored)."""
    given = {k: v for k, v in tunables.items() if v is not None}
    if scorer is not None:
        if given:
            raise ScorerError(f"{sorted(given)} tune the default scorer; with scorer= they "
                              f"would be ignored: set them on the scorer")
        return scorer
    try:
        return AffinityScorer(**given)
    except TypeError as exc:  # a str compared to a number, an unknown name
        raise ScorerError(f"scorer tunables {given!r}: {exc}"[:300]) from None


class AffinityScorer:
    """Prefix affinity under a bounded-load cap (the router's historical policy):
    candidates are those with ``in_flight + 1 <= ceil(balance * (total + 1) / N)`` (the
    least loaded always is); score = ``(gpu_run + cpu_weight * (run - gpu_run)) / n -
    load_weight * in_flight / (mean in_flight + 1)``; highest wins, ties to the least
    loaded, then the first in rotation; a lossy replica's runs count ``lossy_weight``
    (module doc). Raises ScorerError unless ``balance >= 1`` (an infinite one: no cap),
    ``load_weight`` is finite and ``>= 0`` (an infinite weight times 0 in flight is NaN),
    ``0 <= cpu_weight <= 1`` and ``0 <= lossy_weight <= 1`` (numbers, not bools)."""

    def __init__(self, *, load_weight: float = 1.0, balance: float = 1.25,
                 cpu_weight: float = 0.5, lossy_weight: float = 0.5) -> None:
        _balance(balance)
        check_number("load_weight", load_weight, ScorerError, lambda v: 0 <= v < math.inf,
                     "a finite number >= 0")
        _fraction("cpu_weight", cpu_weight)
        _fraction("lossy_weight", lossy_weight)
        self.load_weight, self.balance, self.cpu_weight = load_weight, balance, cpu_weight
        self.lossy_weight = lossy_weight

    def pick(self, views: Sequence[ReplicaView], turn: int) -> int:
        """See ``Scorer.pick``: the highest score under the cap (class doc)."""
        total = sum(v.in_flight for v in views)
        mean = total / len(views)
        allowed = under_cap(views, self.balance)
        best, best_key = allowed[0], None
        for i in allowed:
            v = views[i]
            n = max(1, v.prompt_blocks)
            score = credited(v, self.cpu_weight, self.lossy_weight) / n \
                - self.load_weight * v.in_flight / (mean + 1)
            key = (score, -v.in_flight)
            if best_key is None or key > best_key:
                best, best_key = i, key
        return best


def under_cap(views: Sequence[ReplicaView], balance: float, *, tight: bool = False,
              least_mean: float = 0.0) -> list[int]:
    """Positions of the replicas whose ``in_flight + 1 <= cap``, in order; the least
    loaded (first in rotation among equals) is always one. With ``m = (total + 1) / N``
    the requests in flight per replica after this one (or ``least_mean`` if higher):
    ``cap = ceil(balance * m)``, or
    when ``tight``, ``max(ceil(m), floor(balance * m))``: at a few requests per replica,
    rounding up lets one replica take a whole request more than ``balance`` allows (4
    where the mean is 3, at balance 1.1), and a chat session placed there comes back
    there for all its turns."""
    return _capped([v.in_flight for v in views], balance, tight, least_mean)


def under_share(views: Sequence[ReplicaView], balance: float) -> list[int]:
    """Positions of the replicas whose share of the requests routed stays within
    ``balance`` after this one: ``routed + 1 <= max(ceil(m), floor(balance * m))`` with
    ``m = (total routed + 1) / N``; the least routed is always one. Kept under this cap
    by every decision, no replica ends with more than ``balance`` times the mean
    requests routed (once the mean is ``1 / (balance - 1)`` or more, so that rounding
    up to ``ceil(m)`` adds less than ``balance`` does)."""
    return _capped([v.routed for v in views], balance, True)


def _capped(counts: list[int], balance: float, tight: bool, least_mean: float = 0.0
            ) -> list[int]:
    m = max((sum(counts) + 1) / len(counts), least_mean)
    if not math.isfinite(balance * m):  # balance inf, or so large the product overflows
        return list(range(len(counts)))  # no cap (ceil and floor of inf would raise)
    cap = max(math.ceil(m), math.floor(balance * m)) if tight else math.ceil(balance * m)
    least = counts.index(min(counts))
    return [i for i, c in enumerate(counts) if c + 1 <= cap or i == least]


class CostScorer:
    """Dynamo's cost (module doc). ``prefill_weight`` > 0: how much a block still to
    compute weighs against a block held during decode; ``temperature`` >= 0: 0 picks the
    lowest cost (ties: the first in rotation), above 0 samples (``seed`` for the draws);
    ``busy_threshold`` in (0, 1] or None; ``cpu_weight`` in [0, 1]: how much of a block
    cached on the CPU counts as cached; ``balance`` >= 1 or None (Dynamo's cost alone,
    which may send most requests of a hot prefix to the replica holding it): bounded
    load around the cost, in three rules (``hold`` decisions, an int in [1, 2**32], for the
    first);
    ``lossy_weight`` in [0, 1]: how much of a lossy replica's cached run counts (module
    doc), in the cost and in the rules alike:

    1. Only replicas under the cap on requests in flight are candidates (``under_cap``,
       rounded down), its mean held at the highest it was over the last ``hold``
       decisions: as a fleet drains (3 requests in flight on 8 replicas) the cap
       would fall to 1, and a chat turn whose replica still runs another session's
       would be moved off its history.
    2. When all candidates would cache the same run of the prompt, only those among
       them within ``balance`` of the mean requests routed (``under_share``): the cap
       in flight lets a replica whose requests finish sooner take more of them (at 8
       replicas on the system-prompt workload one received 30 of 200 requests,
       imbalance 1.20, while none held more than 1.1 times the mean in flight).
       Where they differ in what they cache, it would move requests off their run.
    3. A candidate that caches more of the prompt than every other candidate and than
       the least-caching replica (a chat session's history) is picked whatever the
       cost: Dynamo's cost moves a session when its replica's active blocks outweigh
       the history's prefill, and the session's later turns then follow it there.

    Raises ScorerError for values out of range or of another type (a bool is not a
    number; an infinite ``prefill_weight`` too: times 0 blocks to compute it is NaN)."""

    def __init__(self, *, prefill_weight: float = 1.0, temperature: float = 0.0,
                 busy_threshold: float | None = 0.95, cpu_weight: float = 0.5,
                 balance: float | None = None, hold: int = 64, seed: int = 0,
                 lossy_weight: float = 0.5) -> None:
        check_number("prefill_weight", prefill_weight, ScorerError, lambda v: 0 < v < math.inf,
                     "a finite number > 0")
        check_number("temperature", temperature, ScorerError, lambda v: v >= 0,
                     "a number >= 0")
        _fraction("cpu_weight", cpu_weight)
        if busy_threshold is not None:
            check_number("busy_threshold", busy_threshold, ScorerError, lambda v: 0 < v <= 1,
                         "a number in (0, 1] or None")
        if balance is not None:
            _balance(balance)
        check_int("hold", hold, ScorerError, 1, 1 << 32)  # (a deque's length: memory)
        _fraction("lossy_weight", lossy_weight)
        self.lossy_weight = lossy_weight
        self.balance = balance
        self._means: deque[float] = deque(maxlen=hold)  # requests in flight per replica
        self.prefill_weight, self.temperature = prefill_weight, temperature
        self.busy_threshold, self.cpu_weight = busy_threshold, cpu_weight
        self._rng = random.Random(seed)

    def cost(self, v: ReplicaView, default_capacity: float | None = None) -> float:
        """The cost of serving the prompt on ``v`` (module doc): in blocks over ``v``'s
        capacity, or over ``default_capacity`` when ``v`` states none (None: in blocks)."""
        blocks = self.prefill_weight * (v.prefill_blocks + v.prompt_blocks - self._cached(v)) \
            + v.active_blocks + v.prompt_blocks
        capacity = v.capacity or default_capacity
        return blocks / capacity if capacity else blocks

    def pick(self, views: Sequence[ReplicaView], turn: int) -> int:
        """See ``Scorer.pick``: the lowest cost, or a draw by cost (module doc)."""
        limit = self.busy_threshold
        allowed = list(range(len(views)))
        if self.balance is not None:
            allowed = self._balanced(views, self.balance)
        if limit is not None:  # busy: at or above the threshold, as last published
            allowed = [i for i in allowed if (u := views[i].kv_usage) is None or u < limit
                       ] or allowed
        if self.balance is not None and (holder := self._holder(views, allowed)) is not None:
            return holder
        stated = [c for i in allowed if (c := views[i].capacity)]
        fill = sum(stated) / len(stated) if stated else None  # one unit for all (module doc)
        costs = [self.cost(views[i], fill) for i in allowed]
        low = min(costs)
        # extreme options can overflow a cost, or the mean, to inf: an infinite cost
        # weighs 0 and the scale is the finite costs' mean (inf - inf would be NaN)
        finite = [c for c in costs if c < math.inf]
        scale = self.temperature * (sum(finite) / len(finite) or 1.0) if finite else 0.0
        if scale == 0 or len(allowed) == 1:  # temperature 0, so small the scale is 0, all inf
            return allowed[costs.index(low)]
        weights = [math.exp(-(c - low) / scale) if c < math.inf else 0.0 for c in costs]
        return self._rng.choices(allowed, weights)[0]

    def _cached(self, v: ReplicaView) -> float:
        """Blocks of the prompt ``v`` caches as credited (``credited``)."""
        return credited(v, self.cpu_weight, self.lossy_weight)

    def _balanced(self, views: Sequence[ReplicaView], balance: float) -> list[int]:
        """Rules 1 and 2 (class doc): under the cap in flight; then, if those all cache
        the same run, under the share cap too, unless none of them is."""
        self._means.append(sum(v.in_flight for v in views) / len(views))
        held = max(self._means) + 1 / len(views)  # as under_cap's m: this request counted
        allowed = under_cap(views, balance, tight=True, least_mean=held)
        if len({self._cached(views[i]) for i in allowed}) > 1:
            return allowed
        share = set(under_share(views, balance))
        return [i for i in allowed if i in share] or allowed

    def _holder(self, views: Sequence[ReplicaView], allowed: list[int]) -> int | None:
        """Rule 3 (class doc): the one candidate caching the most of the prompt, if it
        caches more than every other and than the least-caching replica; else None."""
        cached = [self._cached(views[i]) for i in allowed]
        top = max(cached)
        if cached.count(top) == 1 and top > min(self._cached(v) for v in views):
            return allowed[cached.index(top)]
        return None

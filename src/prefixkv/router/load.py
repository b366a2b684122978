"""What the router knows of each replica's load: what the replica last published (KV
usage, queue depth) plus what the router sent it since, and its own in-flight tally.

A replica publishes a ``ReplicaLoad`` (in production, read from the ``/metrics`` it
already serves: ``from_metrics`` parses vLLM's series names). Between two reports the
router adds each request it routes there, so a burst of routing decisions sees its own
effect at once (as Dynamo's router predicts active blocks between worker updates). A
replica that never reports is estimated from the router's decisions alone: the blocks
of its requests in flight, and their prefill until they finish.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from ..errors import PrefixKVError

MAX_SINCE = 1024  # routing decisions remembered per replica since its report, at most


class LoadError(PrefixKVError):
    """A load report out of range or of the wrong type (a count that is not an int >= 0,
    a usage that is not a real number in 0..1)."""


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """A replica's load as it publishes it. ``kv_usage``: fraction of its KV blocks in use
    (0..1, vLLM's ``vllm:kv_cache_usage_perc``); ``num_waiting``: requests queued, not yet
    admitted (``vllm:num_requests_waiting``); ``waiting_tokens``: their prompt tokens not
    yet computed (None: unknown, estimated from the router's own prefill since the report);
    ``num_blocks``: its pool size (None: the router's ``capacity`` or unknown).
    Raises LoadError for values out of range or of the wrong type (NaN, infinity, a
    fractional or boolean count: they would poison every score with NaN)."""

    kv_usage: float
    num_waiting: int = 0
    waiting_tokens: int | None = None
    num_blocks: int | None = None

    def __post_init__(self) -> None:
        usage = self.kv_usage
        real = isinstance(usage, (int, float)) and not isinstance(usage, bool)
        if not (real and 0.0 <= usage <= 1.0) or not _count(self.num_waiting, 0) or (
                self.waiting_tokens is not None and not _count(self.waiting_tokens, 0)) or (
                self.num_blocks is not None and not _count(self.num_blocks, 1)):
            raise LoadError(f"need 0 <= kv_usage <= 1, integer counts >= 0, num_blocks >= 1; "
                            f"got {self!r}")


def _count(value: object, least: int) -> bool:
    """``value`` is an int (not a bool) of at least ``least``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def from_metrics(text: str, *, num_blocks: int | None = None) -> ReplicaLoad:
    """A ``ReplicaLoad`` from a replica's Prometheus exposition text:
    ``vllm:kv_cache_usage_perc`` (required; the mean over its label sets: vLLM serves one
    per engine of a data-parallel server, each a fraction of that engine's pool) and
    ``vllm:num_requests_waiting`` (summed over its label sets; 0 when absent). A sample
    is ``name{labels} value [timestamp]``, blanks being spaces or tabs (leading ones
    ignored). Raises LoadError, and only LoadError, when the usage series is missing, a
    value does not parse or the series sum past the largest float, and for ``text`` that
    is not a str (an HTTP body not decoded)."""
    if not isinstance(text, str):
        raise LoadError(f"metrics must be a str (decode the body), got {type(text).__name__}")
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for line in text.splitlines():
        line = line.lstrip(" \t")
        if not line or line[0] == "#":
            continue
        words = line.split("{", 1)[0].split(None, 1)
        name = words[0] if words else ""  # (none: a line of labels only, not our series)
        if name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_waiting"):
            # the value follows the labels (whose quoted values may hold anything but
            # the last "}"), or the name when there are none
            try:  # (no "}" after a "{": rindex's ValueError)
                rest = line[line.rindex("}") + 1:] if "{" in line else line[len(name):]
                v = float(rest.split()[0])
            except (IndexError, ValueError) as exc:
                raise LoadError(f"bad metrics line {line[:120]!r}") from exc
            if not math.isfinite(v):
                raise LoadError(f"bad metrics line {line[:120]!r}")
            sums[name] = sums.get(name, 0.0) + v
            counts[name] = counts.get(name, 0) + 1
    usage = "vllm:kv_cache_usage_perc"
    if usage not in sums:
        raise LoadError("no vllm:kv_cache_usage_perc series in the metrics")
    if not all(map(math.isfinite, sums.values())):  # (finite values summing past a float)
        raise LoadError(f"metrics series summing past the largest float: {sums}")
    return ReplicaLoad(sums[usage] / counts[usage],
                       int(sums.get("vllm:num_requests_waiting", 0)), None, num_blocks)


class LoadBook:
    """Per replica: the last report, what was routed there since it was read, and the
    requests in flight (``(prefill blocks, blocks)`` each, oldest first: ``finish`` ends
    the oldest)."""

    def __init__(self, names: tuple[str, ...], block_size: int,
                 capacity: dict[str, int] | None) -> None:
        self.block_size = block_size
        self.capacity = dict(capacity or {})
        self.reported: dict[str, ReplicaLoad] = {}
        # routed to a reported replica since its report was read: (when, prefill, blocks),
        # oldest first, with their sums (a report read at t keeps those routed from t on)
        self.since: dict[str, deque[tuple[float, int, int]]] = {r: deque() for r in names}
        self.since_prefill = dict.fromkeys(names, 0)  # blocks to compute routed since report
        self.since_blocks = dict.fromkeys(names, 0)
        self.open: dict[str, deque[tuple[int, int]]] = {r: deque() for r in names}

    def report(self, replica: str, load: ReplicaLoad, read_at: float | None = None) -> None:
        """``load`` replaces what was known; what was routed there at or after ``read_at``
        (the report was read before it arrived) still adds to it; None: nothing does."""
        self.reported[replica] = load
        since = self.since[replica]
        while since and (read_at is None or since[0][0] < read_at):
            _, prefill, blocks = since.popleft()
            self.since_prefill[replica] -= prefill
            self.since_blocks[replica] -= blocks
        if load.num_blocks is not None:
            self.capacity[replica] = load.num_blocks

    def unreport(self, replica: str) -> None:
        """Forget the report (stale): the estimate is the router's own again."""
        self.reported.pop(replica, None)
        self.since[replica].clear()
        self.since_prefill[replica] = self.since_blocks[replica] = 0

    def routed(self, replica: str, prefill: int, blocks: int, now: float) -> None:
        if replica in self.reported:  # unreported: estimated from ``open`` alone
            since = self.since[replica]
            since.append((now, prefill, blocks))
            if len(since) > MAX_SINCE:  # no report for long: merge the two oldest, kept
                _, p0, b0 = since.popleft()  # until a report read after the later one
                t1, p1, b1 = since.popleft()
                since.appendleft((t1, p0 + p1, b0 + b1))
            self.since_prefill[replica] += prefill
            self.since_blocks[replica] += blocks
        self.open[replica].append((prefill, blocks))

    def finished(self, replica: str) -> None:
        self.open[replica].popleft()

    def prefill_blocks(self, replica: str) -> float:
        """Blocks queued for prefill there: reported waiting tokens (or, unreported, the
        prefill of everything in flight) plus what was routed since the report."""
        rep = self.reported.get(replica)
        if rep is None:
            return float(sum(p for p, _ in self.open[replica]))
        waiting = rep.waiting_tokens / self.block_size if rep.waiting_tokens is not None else 0.0
        return waiting + self.since_prefill[replica]

    def active_blocks(self, replica: str) -> float:
        """Blocks in use there: reported usage times the pool (or, without a report or a
        pool size, the blocks of the requests in flight) plus what was routed since."""
        rep, cap = self.reported.get(replica), self.capacity.get(replica)
        if rep is None or cap is None:
            return float(sum(b for _, b in self.open[replica]))
        return rep.kv_usage * cap + self.since_blocks[replica]

"""``Origins``: what a replica's frames state of the publisher that sent them.

vLLM 0.33's wire (``(topic, seq, [ts, events, data_parallel_rank])``, numbered from 0
in each life of a publisher) names no publisher and no life. Two facts of a frame do not
change within one publisher: its topic frame (a SUB subscription matches a topic
*prefix*, so ``kv-events`` also takes ``kv-events-dp1``; a proxy may merge several
publishers' streams into one socket) and its ``data_parallel_rank`` (each DP rank runs a
publisher of its own), nor across a publisher's restarts. A frame stating another topic
or rank than the first batch applied for the replica is another publisher's. The origin
is kept when the replica's index is forgotten (a gap, a restart): were it learnt again,
a foreign frame arriving first after the forget would become the origin and the
replica's own frames would be refused from then on. What is left (a
publisher with the same topic and rank on the same socket) is told only by its numbers
and the replay buffer's answers (``Subscriber``: ``unsent_frames``, buffered.py); a
restart by the socket's monitor; and, at the one frame the numbers cannot judge (the
next expected one), by its timestamp: a publisher stamps its batches with the wall
clock as it makes them (vLLM's scheduler ``time.time()``, prefixkv's publisher too), so
one stamped earlier than the batch applied last is another publisher's, or the clock
was set back (``earlier``: the subscriber asks the replay buffer which). A stamp that
is no finite number, or more than ``MAX_AHEAD`` seconds ahead of the router's own wall
clock, judges nothing (garbage, or a clock that far off: the next frame is not judged).
"""

from __future__ import annotations

import math
import time

from .decode import DecodeError, RouterEvent, decode_batch

Batch = tuple[float, list[RouterEvent], int | None]
MAX_AHEAD = 3600.0
"""Seconds a batch's stamp may be ahead of the router's wall clock and still judge the
next frame's (module doc)."""


class Origins:
    """Per replica, the topic frame and rank of the first batch applied for it (kept
    when the replica is forgotten); and the decoding of the payload at hand (checked, then applied: decoded
    once)."""

    def __init__(self) -> None:
        self.topic: dict[str, bytes] = {}
        self.rank: dict[str, int | None] = {}
        self.ts: dict[str, float] = {}  # the timestamp of the batch applied last
        self._decoded: tuple[bytes | None, Batch | None] = (None, None)

    def decode(self, payload: bytes) -> Batch | None:
        """``decode_batch(payload)``; None when it raises DecodeError. The last payload's
        answer is kept (the same object again: not decoded twice)."""
        if self._decoded[0] is not payload:
            try:
                self._decoded = payload, decode_batch(payload)
            except DecodeError:
                self._decoded = payload, None
        return self._decoded[1]

    def foreign(self, replica: str, topic: bytes | None, payload: bytes) -> bool:
        """Whether a live frame (``topic`` its first frame, None: not known) states
        another topic or rank than ``replica``'s batches. An undecodable payload, or a
        replica with none applied yet, is not judged here."""
        known = self.topic.get(replica)
        if known is not None and topic is not None and topic != known:
            return True
        if replica not in self.rank:
            return False
        batch = self.decode(payload)
        return batch is not None and batch[2] != self.rank[replica]

    def earlier(self, replica: str, payload: bytes) -> bool:
        """Whether ``payload`` decodes to a batch stamped earlier than the one applied
        last for ``replica`` (module doc). An undecodable payload, a replica with none
        applied, or a stamp that is no number to compare (NaN) is not judged here."""
        last = self.ts.get(replica)
        batch = self.decode(payload) if last is not None else None
        return batch is not None and batch[0] < last  # type: ignore[operator]

    def passed(self, replica: str, payload: bytes) -> None:
        """The replica's stream was followed past ``payload`` without applying it: its
        stamp is the one the next batch is judged by (a clock set back is judged once)."""
        batch = self.decode(payload)
        if batch is not None:
            self._stamp(replica, batch[0])

    def applied(self, replica: str, topic: bytes | None, batch: Batch) -> None:
        """A batch of ``replica``'s was applied (``topic``: its live frame's, None for a
        replayed batch): the first states what its publisher's frames state."""
        self._stamp(replica, batch[0])
        self.rank.setdefault(replica, batch[2])
        if topic is not None:
            self.topic.setdefault(replica, topic)

    def _stamp(self, replica: str, ts: float) -> None:
        if math.isfinite(ts) and ts <= time.time() + MAX_AHEAD:
            self.ts[replica] = ts
        else:  # (garbage, or a clock far off: judges nothing)
            self.ts.pop(replica, None)

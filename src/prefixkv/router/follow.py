"""What ``Subscriber`` keeps per replica, and how it brings a replica up to date: the
last batch applied (its sequence number and payload), the counters, and the recovery
calls that ask the publisher (``_catch_up`` by prefixkv's map request, ``_verify`` by a
vLLM publisher's buffer) and apply or forget. Which of them a live message calls is
decided in ``subscriber.py`` (module doc there).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from .buffered import Held, verify
from .map_replay import ask_map
from .origin import Origins
from .replay_client import Answer, ReplayClient
from .router import Router


class ReplicaFollower:
    """``Subscriber``'s per-replica state and recovery (see ``Subscriber``)."""

    _replay: Mapping[str, ReplayClient]  # replica -> its replay client (``sockets.py``)

    def __init__(self, router: Router, endpoints: Mapping[str, tuple[str, str | None]],
                 replay_timeout: float) -> None:
        self.router = router
        self.replay_timeout_ms = int(replay_timeout * 1000)
        self.last_seq: dict[str, int] = {}
        self.gaps_filled = self.snapshots = self.resyncs = self.restarts = self.bad_batches = 0
        self.bad_replies = self.disconnects = self.errors = self.foreign_frames = 0
        self.unsent_frames = self.duplicates = self.lossy_batches = self.earlier_frames = 0
        self.last_error: str | None = None
        self.connected = dict.fromkeys(endpoints, False)
        self._epoch: dict[str, str] = {}
        self._skip_through: dict[str, int] = {}  # live duplicates of replayed batches
        self._legacy: set[str] = set()  # replicas that answer only the 8-byte request
        self._last_payload: dict[str, bytes] = {}  # what a vLLM publisher is verified by
        self._replayed: dict[str, dict[int, bytes]] = {}  # live duplicates of a verification
        self._unverified: set[str] = set()  # disconnected since their last message
        self._origins = Origins()  # (origin.py: another publisher's frames)
        # held while the index changes, never while a replay is asked: a ``route`` caller
        # takes it too (re-entrant: a caller may hold it around a call that takes it)
        self.lock = threading.RLock()

    def _held(self, replica: str, start: int) -> Held | None:
        """The replica's buffer from ``start`` (buffered.py); None: no replay endpoint, or
        no answer."""
        client = self._replay.get(replica)
        return client.replayed(start) if client else None

    def _unsent(self, replica: str) -> None:
        """A live frame the replica's buffer shows its publisher never sent: not applied,
        counted; the replica is verified (a restarted publisher's buffer lacks it too)."""
        self.unsent_frames += 1
        self._verify(replica)

    def _verify(self, replica: str) -> None:
        """After a disconnect: make sure ``replica`` is the publisher it was (module doc)."""
        self._unverified.discard(replica)
        last = self.last_seq.get(replica)
        if last is not None and (last < 0 or replica in self._legacy and replica not in
                                 self._last_payload):  # nothing applied since it was
            self._forget(replica)  # forgotten (a resync on a cut frame: nothing to compare)
            return
        if last is None or replica not in self._legacy and self._catch_up(replica, last):
            return
        verdict, got = verify(self._replay.get(replica), last, self._last_payload.get(replica))
        with self.lock:  # (the answer applied as one change)
            self._verified(replica, verdict, got)

    def _verified(self, replica: str, verdict: str, got: Held | None) -> None:
        if verdict == "same" and got is not None:
            self._replay_applied(replica, got)
            self.gaps_filled += bool(got)
            return
        self._forget(replica)
        self.restarts += verdict == "new"  # it has nothing at `last`, or something else there
        if got is None:  # no answer, its buffer lost ours, or a new life's history is not whole
            self.resyncs += 1
            return
        self.last_seq[replica] = -1
        self._replay_applied(replica, got)

    def _replay_applied(self, replica: str, batches: list[tuple[int, bytes]]) -> None:
        """Apply what a verification replayed, which may arrive live too (kept to tell
        those duplicates from a restart)."""
        for s, p in batches:
            self._apply(replica, s, p)
        if batches:
            self._replayed[replica] = dict(batches)

    def _catch_up(self, replica: str, last: int | None) -> bool:
        """Bring ``replica`` up to date by the msgpack replay request (map_replay.py);
        False (and the replica is marked legacy) when it answers in vLLM's form (an end
        mark). Nothing usable (no answer in time, bad answers) forgets the replica, which
        follows from this message on (``resyncs``)."""
        client = self._replay.get(replica)
        epoch = self._epoch.get(replica)
        answer, bad = ask_map(client, epoch, 0 if last is None else last + 1, replica
                              ) if client else (None, 0)
        self.bad_replies += bad
        with self.lock:  # (the answer applied as one change)
            return self._caught_up(replica, epoch, answer)

    def _caught_up(self, replica: str, epoch: str | None, answer: Answer | str | None) -> bool:
        if answer is None:
            self._legacy.add(replica)
            return False
        if not isinstance(answer, Answer):  # LOST
            self.resyncs += 1
            self._forget(replica)
            self.last_seq[replica] = -1  # index what comes next: an understatement
            return True
        if epoch is not None and answer.epoch != epoch:
            self.restarts += 1
        self._epoch[replica] = answer.epoch
        if answer.snapshot is not None:
            self.snapshots += 1
            self._forget(replica)
            self._decode_apply(replica, answer.snapshot)
        elif answer.batches:
            self.gaps_filled += 1
            for _, p in answer.batches:
                self._decode_apply(replica, p)
        self.last_seq[replica] = self._skip_through[replica] = answer.next_seq - 1
        return True

    def _forget(self, replica: str) -> None:
        with self.lock:
            self.router.forget(replica)
        for state in (self.last_seq, self._skip_through, self._last_payload, self._replayed):
            state.pop(replica, None)
        # (its origin stays: a restarted or resynced publisher states the same topic and
        # rank, and a foreign frame that came first after a forget would otherwise become
        # the origin and lock the replica's own frames out: origin.py)

    def _apply(self, replica: str, seq: int, payload: bytes, topic: bytes | None = None) -> None:
        """Apply batch ``seq`` (``topic``: the live frame's, when it is the message at hand)."""
        self.last_seq[replica] = seq
        self._last_payload[replica] = payload
        self._decode_apply(replica, payload, topic)

    def _decode_apply(self, replica: str, payload: bytes, topic: bytes | None = None) -> None:
        batch = self._origins.decode(payload)
        if batch is None:  # taken as the replica's (in order, or its publisher's copy):
            self.bad_batches += 1  # its events are lost, removals maybe among them
            self.lossy_batches += 1
            with self.lock:
                self.router.lost(replica)
            return
        self._origins.applied(replica, topic, batch)
        router = self.router
        with self.lock:  # (decoded: its fields checked, so not ``apply``'s checks again)
            router._apply_decoded(replica, batch[1])
            if router._hash_check.due(replica):  # (the first batches of a life: hash_check.py)
                router.check_hashes(replica, payload)

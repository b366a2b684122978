"""``SlotMap``: what a ``RedisStore`` on a Redis Cluster knows of its nodes: the node of
each of the 16384 slots (read with ``CLUSTER SLOTS``, dropped when a node fails or a key
moved), every node a map named (the map is read again from any of them), and the nodes
whose last call failed (asked last). No I/O: the store reads the map and asks the nodes.
"""

from __future__ import annotations

import threading
from typing import Any

from .resp import Address

Rounds = list[list[tuple[Address, list[int]]]]


class SlotMap:
    """``slots``: the node of each slot, None until read (or once dropped); ``nodes``:
    every node a map named, kept when the map is dropped, so a dead URL node does not
    take the store down. Nodes that fail are suspected until they answer a call: they
    are asked last, for the map and for their keys, since a hung node (it accepts and
    never answers) or a host that is down (a connect waits) takes a whole deadline."""

    def __init__(self) -> None:
        self.slots: list[Address] | None = None
        self.nodes: set[Address] = set()
        self._failing: dict[Address, None] = {}  # the most recent failure last
        self._lock = threading.Lock()  # (fetcher threads fail and answer at once)

    def suspect(self, node: Address) -> None:
        """``node`` failed a call with time left to it."""
        with self._lock:
            self._failing.pop(node, None)
            self._failing[node] = None

    def answered(self, node: Address) -> None:
        """``node`` answered all it was asked: no longer suspect."""
        if self._failing:
            with self._lock:
                self._failing.pop(node, None)

    def rounds(self, groups: dict[Address, list[int]]) -> Rounds:
        """The nodes of ``groups`` (node -> key indices) in the rounds a call asks them:
        the suspects after the others have answered (asked first, a host that is down
        took the deadline and left the others' replies unread)."""
        if not self._failing:
            return [list(groups.items())]
        with self._lock:
            failing = set(self._failing)
        rounds = [[g for g in groups.items() if g[0] not in failing],
                  [g for g in groups.items() if g[0] in failing]]
        return [r for r in rounds if r]

    def askers(self, home: Address) -> list[Address]:
        """The nodes to read the map from, in turn: ``home`` (the URL's), then every node
        an earlier map named; the suspects last, the most recent failure last."""
        with self._lock:
            failing = [n for n in self._failing if n == home or n in self.nodes]
        return [n for n in [home, *sorted(self.nodes - {home})] if n not in failing] + failing

    def learn(self, ranges: list[Any], home: Address) -> list[Address]:
        """Take a ``CLUSTER SLOTS`` answer as the map (a master without a host name is
        ``home``'s host) and return it."""
        slots: list[Address] = [home] * 16384
        for lo, hi, master, *_ in ranges:
            host = master[0].decode() or home[1]
            slots[lo:hi + 1] = [("tcp", host, int(master[1]))] * (hi - lo + 1)
        self.slots = slots
        self.nodes.update(slots)
        return slots

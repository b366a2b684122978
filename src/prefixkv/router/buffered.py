"""What a vLLM publisher's replay buffer says of a live frame.

vLLM 0.33's wire names no publisher and no life: the one witness of what the publisher
on a replica's replay endpoint sent is its buffer's answer to the 8-byte request
(``ReplayClient.replayed``), ``held``: ``(seq, payload)`` pairs in the order it sent
them. A frame is that publisher's only if the buffer holds that very pair (the same
number and bytes: a vLLM batch carries its timestamp, so two batches of two lives or two
publishers never share both). These functions read an answer; the subscriber decides.
"""

from __future__ import annotations

from typing import Literal

from .replay_client import ReplayClient

Held = list[tuple[int, bytes]]


def sent(held: Held, seq: int, payload: bytes) -> bool:
    """Whether the buffer holds the frame ``(seq, payload)``."""
    return (seq, payload) in held


def run_to(held: Held, start: int, seq: int, payload: bytes) -> Held | None:
    """The buffer's batches ``start .. seq``, consecutive and ending with this very frame
    ``(seq, payload)``; None when it lost one of them or did not send the frame."""
    run = [b for b in held if start <= b[0] <= seq]
    whole = all(s == k for k, (s, _) in enumerate(run, start))
    return run if whole and run and run[-1] == (seq, payload) else None


def verify(client: ReplayClient | None, last: int, payload: bytes | None
           ) -> tuple[Literal["same", "lost", "new"], Held | None]:
    """Whether the publisher there now is the life whose batch ``last`` (``payload``) was
    applied last: ``("same", the batches after it)``; ``("lost", None)`` when it does not
    answer or its buffer moved past ``last``; ``("new", its history from 0)`` when it has
    nothing at ``last`` or another batch there (the history None when not whole)."""
    got = client.stream(last) if client else None
    if got and got[0] == (last, payload):
        return "same", got[1:]
    if got is None or got and got[0][0] > last:
        return "lost", None
    return "new", client.stream(0) if client else None

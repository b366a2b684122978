"""Asking a prefixkv publisher for what a replica missed: the msgpack map request
(``ReplayClient.ask``) and what to do with an answer that does not have its shape.

``ask_map`` returns a checked ``Answer``, None for a vLLM publisher (it answers the map
with its end mark), or ``LOST`` when nothing usable came: no answer in time (busy or
gone: not a vLLM publisher for all that), or a malformed answer and then no snapshot
either. The subscriber forgets a lost replica and follows from the next message (an
understatement of what it holds, never an overstatement).
"""

from __future__ import annotations

import logging
from typing import Final

from .replay_client import Answer, ReplayClient, ReplayError, ReplayTimeout

_log = logging.getLogger(__name__)
LAST_SEQ: Final = (1 << 64) - 1
"""The largest 8-byte sequence number."""
LOST: Final = "lost"
"""``ask_map``'s answer when nothing usable came (module doc)."""


def ask_map(client: ReplayClient, epoch: str | None, start: int, replica: str = ""
            ) -> tuple[Answer | None | str, int]:
    """``(answer, bad)``: the answer for the batches from ``start`` on (module doc) and
    how many malformed answers came on the way (after the first, a forced snapshot is
    asked; a timeout is not a malformed answer). Past ``LAST_SEQ`` only a snapshot can
    say where the replica is. A new epoch without a snapshot is a malformed answer.
    ``replica``: its name, for the log."""
    try:
        answer = client.ask(epoch, min(start, LAST_SEQ), force_snapshot=start > LAST_SEQ)
        if answer is not None and epoch not in (None, answer.epoch) and answer.snapshot is None:
            raise ReplayError(f"epoch {answer.epoch!r} follows {epoch!r} without a snapshot")
        return answer, 0
    except ReplayTimeout:
        return LOST, 0
    except ReplayError as exc:
        _log.warning("replica %r: bad replay answer (%s); asking for a snapshot", replica, exc)
    try:
        answer = client.ask(epoch, start, force_snapshot=True)
    except ReplayError as again:
        return LOST, 1 + (not isinstance(again, ReplayTimeout))
    return (answer if answer is not None and answer.snapshot is not None else LOST), 1

"""What the router notes of each replica's index beside its content (``Router`` exposes
the counts; ``Subscriber.health`` and the fleet's metrics read them):

- ``block_size_mismatches``: ``Stored`` events that state a block size other than the
  router's. Their hashes cannot match a prompt's, so they are not indexed; the first
  one of a replica is logged as a warning.
- ``hash_mismatches``: ``Stored`` runs whose hashes the router, rehashing their token ids
  as it hashes prompts, found otherwise (hash_check.py: a bounded sample). The replica
  hashes with another mode, seed or hash format: its blocks never match a prompt's.
  They stay indexed (harmless: never met); the first one of a replica is logged as a
  warning.
- ``lossy``: batches of the replica's events lost (undecodable, their place in the
  stream taken) since its index was last emptied. Their removals may be missed, so the
  index may overstate what the replica holds; the scorer sees the count
  (``ReplicaView.lossy``). The index is kept, not emptied: a newer publisher's event type
  in every batch would otherwise empty it at each one. Emptying it (``Router.forget``, an
  ``AllBlocksCleared``) sets the count back to 0: nothing is left to be stale.

Kept apart from scoring: neither changes which blocks a replica is scored by.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

__all__ = ["IndexMarks"]

_log = logging.getLogger("prefixkv.router.router")  # (the logger these warnings always had)


class IndexMarks:
    """The three per-replica counts of the module doc, for ``replicas`` (names the caller
    checked) and the router's ``block_size``. The dicts are created once and only updated
    in place: the router hands them out as its own attributes."""

    def __init__(self, replicas: Sequence[str], block_size: int) -> None:
        self.block_size = block_size
        self.block_size_mismatches = dict.fromkeys(replicas, 0)
        self.hash_mismatches = dict.fromkeys(replicas, 0)
        self.lossy = dict.fromkeys(replicas, 0)

    def mismatched(self, replica: str, block_size: int | None) -> bool:
        """Whether a ``Stored`` of ``replica`` stating ``block_size`` (None: unstated) is
        of another block size than the router's; if so it is counted, and warned of on
        the replica's first."""
        if block_size is None or block_size == self.block_size:
            return False
        if not self.block_size_mismatches[replica]:
            _log.warning("replica %r announces block_size %d, the router hashes prompts in "
                         "blocks of %d: its blocks cannot match and are not indexed",
                         replica, block_size, self.block_size)
        self.block_size_mismatches[replica] += 1
        return True

    def hash_mismatched(self, replica: str, medium: object,
                        lookahead: tuple[int, int] | None = None) -> None:
        """A ``Stored`` run of ``replica`` (on ``medium``) announced hashes other than the
        router's for its token ids (``lookahead``: the tokens after each block its hashes
        cover and the router's, when they differ): counted, warned of on the replica's
        first."""
        if not self.hash_mismatches[replica] and lookahead is not None:
            _log.warning("replica %r announces blocks (medium %r) hashed with %d lookahead "
                         "tokens, the router hashes prompts with %d "
                         "(Router(hash_lookahead_tokens=...)): no prompt will match its "
                         "blocks", replica, str(medium)[:64], *lookahead)
        elif not self.hash_mismatches[replica]:
            _log.warning("replica %r announces block hashes (medium %r) other than the "
                         "router computes for their token ids: it hashes with another "
                         "hash_mode, seed or hash_format, and no prompt will match its "
                         "blocks", replica, str(medium)[:64])
        self.hash_mismatches[replica] += 1

    def lost(self, replica: str) -> None:
        """A batch of ``replica``'s events was lost: its index is one batch lossier."""
        self.lossy[replica] += 1

    def emptied(self, replica: str) -> None:
        """``replica``'s index was emptied: nothing in it is stale any more."""
        self.lossy[replica] = 0

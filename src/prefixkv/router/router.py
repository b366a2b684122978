"""The router: keeps the index from replicas' events and picks a replica per request.

Policy "prefix" (the default), for a prompt of ``n`` full blocks:

1. Hash the prompt as the replicas' managers do (``block_hashes``, same block size,
   hash mode, seed, extra keys) and convert to the wire form (``hash_format``).
2. Candidates: replicas heard from within ``stale_after`` seconds (all of them when none
   is), each seen as a ``ReplicaView``: its leading run of the prompt's blocks (``run``,
   on the GPU alone ``gpu_run``) and its load (``load.LoadBook``: what it last published
   with ``report_load``, plus what the router sent it since).
3. The *scorer* picks one (``scorer.py``). The default, ``AffinityScorer``: among the
   replicas under the bounded-load cap ``ceil(balance * (in_flight_total + 1) /
   num_candidates)``, score = ``(gpu_run + cpu_weight * (run - gpu_run)) / n -
   load_weight * load / (mean load + 1)``, the highest wins, ties go to the least
   loaded, then in rotation. ``CostScorer`` weighs blocks to compute and blocks in use
   as Dynamo's KV router does.
4. The index hears of the decision (``BlockIndex.routed``): an ``ApproxIndex`` learns
   what the replica will hold from it, for engines that publish no events.

"round-robin" and "least-loaded" ignore the index (baselines for the simulation).
The picking itself (hashes, views, the policies) is pick.py's; ``Router.route`` calls it.

Layer groups (hybrid models): the index mirrors one group per replica, its *scored
group*, the first group it announces as full attention since it was last cleared
(scored.py: the rule, and why its run is an upper bound of the replica's hit).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence

from ..errors import PrefixKVError
from ..hashing import block_hashes
from . import pick
from .clock import ForwardClock, real
from .decode import Cleared, Removed, RouterEvent, Stored, event_problem
from .hash_check import HashCheck
from .index import BlockIndex, InProcessIndex
from .load import LoadBook, ReplicaLoad
from .marks import IndexMarks
from .options import INDEX_METHODS, check_blocks, check_int, check_methods, check_names
from .pick import Choice as Choice  # (re-exported: its home before pick.py)
from .scored import FULL_KIND as FULL_KIND  # (re-exported: its home before scored.py)
from .scored import ScoredGroups
from .scorer import Scorer, ScorerError, default_scorer

POLICIES = ("prefix", "round-robin", "least-loaded")


class RouterError(PrefixKVError):
    """A router option out of range, an unknown replica, or ``finish`` without a request."""


class Router:
    """Args:
        replicas: replica names (at least one, distinct, each a non-empty str; not one str).
        block_size, hash_mode, seed: the replicas' manager settings (``block_hashes``).
        hash_lookahead_tokens: the replicas' lookahead keys (``LookaheadKVCacheManager``'s
            ``hash_lookahead_tokens``, vLLM's ``num_hash_lookahead_tokens``; 0: none): a
            prompt's block is hashed with the tokens after it, as such replicas announce
            theirs; a replica hashing with another count is counted in
            ``hash_mismatches`` (hash_check.py).
        hash_format: how the replicas' publishers send hashes, "int" or "bytes".
        index: a BlockIndex, its methods checked (default: a new InProcessIndex).
        policy: one of POLICIES.
        load_weight, balance, cpu_weight, lossy_weight: the default scorer's (module doc,
            ``AffinityScorer``; None: its default). Given with ``scorer``: RouterError (a
            scorer carries its own; they would be ignored).
        scorer: picks among the candidates (default: ``AffinityScorer`` with the four above).
        capacity: each replica's pool in blocks (a report's ``num_blocks`` replaces it).
        stale_after: seconds (>= 0) without a batch after which a replica is silent
            (None: never).
        clock: seconds, monotonic (tests pass a fake one). Staleness counts its forward
            motion: a step back is no time (``clock.py``; ``clock_steps_back``).

    Raises RouterError (bad option) or ConfigError (bad hashing settings) at construction;
    every call that reads the clock raises RouterError, before any change, for a reading
    that is not a finite number.

    Not thread-safe: one thread routes and applies events and loads; with a
    ``Subscriber`` thread feeding it, hold ``subscriber.lock`` around ``route``.
    """

    def __init__(self, replicas: Sequence[str], *, block_size: int, hash_mode: str = "sha256",
                 seed: int | bytes | None = None, hash_format: str = "int",
                 hash_lookahead_tokens: int = 0, index: BlockIndex | None = None, policy: str = "prefix",
                 load_weight: float | None = None, balance: float | None = None,
                 cpu_weight: float | None = None, lossy_weight: float | None = None,
                 stale_after: float | None = None, scorer: Scorer | None = None,
                 capacity: dict[str, int] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        names = check_names("replicas", replicas, RouterError)
        if not callable(clock):
            raise RouterError(f"clock must be a callable returning seconds, got {clock!r}")
        if policy not in POLICIES:
            raise RouterError(f"policy must be one of {POLICIES}, got {policy!r}")
        if hash_format not in ("int", "bytes"):
            raise RouterError(f"hash_format must be 'int' or 'bytes', got {hash_format!r}")
        try:
            scorer = default_scorer(scorer, load_weight=load_weight, balance=balance,
                                    cpu_weight=cpu_weight, lossy_weight=lossy_weight)
        except ScorerError as exc:
            raise RouterError(str(exc)) from exc
        capacity = check_blocks("capacity", capacity, RouterError, names) or None
        if index is not None:
            check_methods("index", index, RouterError, INDEX_METHODS)
        if scorer is not None:
            check_methods("scorer", scorer, RouterError, ("pick",))
        if stale_after is not None and not (real(stale_after) and stale_after >= 0):
            raise RouterError(f"stale_after must be seconds >= 0 or None, got {stale_after!r}")
        check_int("hash_lookahead_tokens", hash_lookahead_tokens, RouterError, 0)
        block_hashes([], block_size, hash_mode=hash_mode, seed=seed)  # ConfigError early
        self.replicas = tuple(names)
        self.block_size, self.hash_mode, self.seed = block_size, hash_mode, seed
        self.hash_lookahead_tokens = hash_lookahead_tokens
        self.hash_format, self.policy = hash_format, policy
        self.index: BlockIndex = InProcessIndex() if index is None else index
        self.scorer: Scorer = scorer
        self.loads = LoadBook(self.replicas, block_size, capacity)
        self.stale_after, self.clock = stale_after, clock
        self._time = ForwardClock(clock, RouterError)  # (clock.py)
        self.in_flight = dict.fromkeys(names, 0)
        self.routed = dict.fromkeys(names, 0)
        self.last_heard: dict[str, float] = {}
        self._marks = IndexMarks(names, block_size)  # the counts beside the index (marks.py)
        self.block_size_mismatches, self.lossy = self._marks.block_size_mismatches, self._marks.lossy
        self.hash_mismatches = self._marks.hash_mismatches
        self._hash_check = HashCheck(names, block_size, hash_mode, seed, hash_format, self._marks,
                                     hash_lookahead_tokens)
        self.hash_checked = self._hash_check.checked
        self._scored = ScoredGroups(self._marks)  # the group indexed per replica (scored.py)
        self._turn = 0

    # ---- what replicas say ---------------------------------------------------------------

    def apply(self, replica: str, events: Iterable[RouterEvent]) -> None:
        """Apply one batch's decoded events from ``replica``, in order, and mark it heard.
        Only the replica's scored group is indexed (module doc). A ``Stored`` that states
        a block size other than the router's is not indexed (its hashes cannot match a
        prompt's): it is counted in ``block_size_mismatches`` and logged once. Raises
        RouterError, before applying any, for an unknown replica, ``events`` that are no
        iterable (or a str), an item that is not a ``Stored``, ``Removed`` or ``Cleared``,
        or one whose fields the decoder would have refused (``decode.event_problem``)."""
        self._known(replica)
        if isinstance(events, (str, bytes)) or not isinstance(events, Iterable):
            raise RouterError(f"apply({replica!r}): events must be a list of router events, "
                              f"got {events!r}"[:200])
        events = list(events)
        odd = [ev for ev in events if not isinstance(ev, (Stored, Removed, Cleared))]
        if odd:
            raise RouterError(f"apply({replica!r}): not a router event: {odd[0]!r}"[:300])
        for ev in events:
            problem = event_problem(ev)
            if problem is not None:
                raise RouterError(f"apply({replica!r}): {problem}, got {ev!r}"[:300])
        self._apply_decoded(replica, events)

    def _apply_decoded(self, replica: str, events: list[RouterEvent]) -> None:
        """``apply`` for a known ``replica``'s events as ``decode_batch`` returns them
        (their fields checked on the wire): the subscriber's path, free of ``apply``'s
        checks. Raises RouterError for a clock reading that is no finite number."""
        heard = self._time()
        self._scored.apply(self.index, replica, events)
        self.last_heard[replica] = heard

    def check_hashes(self, replica: str, payload: bytes) -> None:
        """Rehash the first stored runs of ``replica`` (``payload``: a batch of its
        events, as applied) as the router hashes prompts and compare (hash_check.py):
        a run whose hashes differ is counted in ``hash_mismatches`` and the replica's
        first is logged (it hashes with another mode, seed or format: no prompt will
        match its blocks). ``hash_checked`` counts the blocks compared. Reads nothing once
        the replica's sample is spent (``hash_check.SAMPLE_BLOCKS`` blocks or
        ``SAMPLE_BATCHES`` batches since its first batch or its last ``forget``); the
        subscriber calls it for each batch it applies. Raises RouterError for an unknown
        replica or a ``payload`` that is not bytes; nothing for what the payload holds."""
        self._known(replica)
        if not isinstance(payload, bytes):
            raise RouterError(f"check_hashes({replica!r}): payload must be bytes, "
                              f"got {type(payload).__name__}")
        if self._hash_check.due(replica):
            self._hash_check.check(replica, payload, self._scored.group(replica))

    def scored_group(self, replica: str) -> int | None:
        """The layer group whose blocks the index mirrors for ``replica`` (module doc);
        None before it announced one (events that name no group never set it). Raises
        RouterError for an unknown replica."""
        self._known(replica)
        return self._scored.group(replica)

    def forget(self, replica: str) -> None:
        """Drop what the index says ``replica`` holds (a restart, an unrecoverable gap),
        and sample its hashes again (``check_hashes``: a new life may hash otherwise)."""
        self._known(replica)
        self._scored.clear(self.index, replica)
        self._hash_check.rearm(replica)

    def lost(self, replica: str) -> None:
        """A batch of ``replica``'s events was lost (undecodable, its place in the stream
        taken): its removals may be missed, so the index may overstate what it holds until
        it is emptied (``forget``, an ``AllBlocksCleared``). Counted in ``lossy``, which
        the scorer sees (``ReplicaView.lossy``); nothing is dropped (a newer publisher's
        event type in every batch would otherwise empty the index at each one).
        Raises RouterError for an unknown replica."""
        self._known(replica)
        self._marks.lost(replica)

    def live(self) -> list[str]:
        """Replicas heard from within ``stale_after`` of the clock's forward motion (every
        replica when None). Raises RouterError for a clock reading that is no finite number."""
        return self._live(self._time())

    def _live(self, now: float) -> list[str]:
        if self.stale_after is None:
            return list(self.replicas)
        return [r for r in self.replicas
                if now - self.last_heard.get(r, float("-inf")) <= self.stale_after]

    @property
    def clock_steps_back(self) -> int:
        """How many clock readings were below the one before (counted as no time)."""
        return self._time.steps_back

    def report_load(self, replica: str, load: ReplicaLoad, read_at: float | None = None
                    ) -> None:
        """What ``replica`` publishes of its load (``load.from_metrics`` reads it from its
        ``/metrics``); it replaces the router's estimate of what it sent there before
        ``read_at`` (a reading of the router's ``clock`` when the report was read, taken since
        its last step back, if any; None: now).
        Raises RouterError for an unknown replica, a ``load`` that is not a
        ``ReplicaLoad``, a ``read_at`` or clock reading that is not a finite number."""
        self._known(replica)
        if not isinstance(load, ReplicaLoad):
            raise RouterError(f"report_load({replica!r}): not a ReplicaLoad: {load!r}")
        if read_at is not None and not (real(read_at) and math.isfinite(read_at)):
            raise RouterError(f"report_load({replica!r}): read_at must be a finite time, "
                              f"got {read_at!r}")
        self._time()  # (the last step back, if any, is seen before ``read_at`` is placed)
        self.loads.report(replica, load, None if read_at is None else self._time.at(read_at))

    def drop_load(self, replica: str) -> None:
        """Forget ``replica``'s last report (too old to trust): its load is the router's
        own estimate again, from the requests in flight there. Raises RouterError for
        an unknown replica."""
        self._known(replica)
        self.loads.unreport(replica)

    # ---- picking -------------------------------------------------------------------------

    def prompt_hashes(self, token_ids: Sequence[int], extra: object = None) -> list[int | bytes]:
        """The prompt's full-block hashes in wire form (what the index is keyed by)."""
        return pick.prompt_hashes(self, token_ids, extra)

    def cached_tokens(self, token_ids: Sequence[int], extra: object = None) -> dict[str, int]:
        """Cached prompt tokens per replica (any medium) as the index says; a replica
        with ``lossy[replica] > 0`` may hold fewer (``Choice.lossy``)."""
        return pick.cached_tokens(self, token_ids, extra)

    def route(self, token_ids: Sequence[int], extra: object = None) -> Choice:
        """Pick a replica for a prompt and count it in flight there (``finish`` ends it).
        Raises what ``block_hashes`` raises for a bad prompt or extra keys."""
        now = self._time()  # (a bad reading: RouterError before any change)
        return pick.route(self, now, token_ids, extra)  # (pick.py)

    def finish(self, replica: str) -> None:
        """A request routed to ``replica`` has finished (the oldest one in flight there,
        for the router's load estimate). Raises RouterError if none is in flight there."""
        self._known(replica)
        if self.in_flight[replica] == 0:
            raise RouterError(f"finish({replica!r}) with no request in flight there")
        self.in_flight[replica] -= 1
        self.loads.finished(replica)

    def _known(self, replica: str) -> None:
        # (a name first: ``in`` on an unhashable object raises the dict's TypeError)
        if not isinstance(replica, str) or replica not in self.in_flight:
            raise RouterError(f"unknown replica {replica!r}; known: {list(self.replicas)}")

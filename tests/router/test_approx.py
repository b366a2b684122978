"""ApproxIndex under attack: against a plain model (events and TTL guesses), expiry at
the boundary, a clock that jumps either way, a replica cleared while its guesses live,
and memory under a stream of unique prompts."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from prefixkv.router import ApproxIndex, Router

TTL = 5.0
REPLICAS = ("a", "b")
MEDIA = ("GPU", "CPU")
keys = st.lists(st.integers(0, 5), max_size=4)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _fresh() -> tuple[Clock, ApproxIndex]:
    clock = Clock()
    return clock, ApproxIndex(TTL, clock=clock)


class ApproxModel(RuleBasedStateMachine):
    """held: (replica, hash) -> media an event put it on; guess: (replica, hash) -> the
    time its GPU guess ends (it holds while now < that), set by a routing decision for a
    block no event holds, ended by a store or a GPU removal of it."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.index = ApproxIndex(TTL, clock=self.clock)
        self.held: dict[tuple[str, int], set[str]] = {}
        self.guess: dict[tuple[str, int], float] = {}
        self.now = 0.0  # the clock's forward motion (a step back is no time)

    @rule(replica=st.sampled_from(REPLICAS), hashes=keys)
    def routed(self, replica, hashes):
        self.index.routed(replica, hashes)
        for h in hashes:
            if (replica, h) not in self.held:
                self.guess[(replica, h)] = self.now + TTL

    @rule(replica=st.sampled_from(REPLICAS), hashes=keys, medium=st.sampled_from(MEDIA))
    def store(self, replica, hashes, medium):
        self.index.store(replica, hashes, medium)
        for h in hashes:
            self.guess.pop((replica, h), None)
            self.held.setdefault((replica, h), set()).add(medium)

    @rule(replica=st.sampled_from(REPLICAS), hashes=keys, medium=st.sampled_from(MEDIA))
    def remove(self, replica, hashes, medium):
        self.index.remove(replica, hashes, medium)
        for h in hashes:
            if medium == "GPU":
                self.guess.pop((replica, h), None)
            self.held.get((replica, h), set()).discard(medium)
            if not self.held.get((replica, h), True):
                del self.held[(replica, h)]

    @rule(replica=st.sampled_from(REPLICAS))
    def clear(self, replica):
        self.index.clear(replica)
        self.held = {k: m for k, m in self.held.items() if k[0] != replica}
        self.guess = {k: t for k, t in self.guess.items() if k[0] != replica}

    @rule(dt=st.sampled_from([0.0, 1.0, 2.5, TTL, 7.0, -3.0, -50.0]))
    def tick(self, dt):
        self.clock.t += dt  # a step back is no time passing: now stays
        self.now += max(dt, 0.0)

    def _media(self, replica, h):
        media = set(self.held.get((replica, h), ()))
        if self.guess.get((replica, h), -1.0) > self.now:
            media.add("GPU")
        return media

    @invariant()
    def runs_agree(self):
        prompt = list(range(6))
        want = {}
        for r in REPLICAS:
            run = gpu = 0
            while run < len(prompt) and self._media(r, prompt[run]):
                run += 1
            while gpu < len(prompt) and "GPU" in self._media(r, prompt[gpu]):
                gpu += 1
            if run:
                want[r] = (run, gpu)
        assert self.index.prefix_runs(prompt, REPLICAS) == want
        for r in REPLICAS:
            assert self.index.num_blocks(r) == sum(
                len(self._media(r, h)) for (q, h) in set(self.held) | set(self.guess) if q == r)


ApproxModel.TestCase.settings = settings(max_examples=50, stateful_step_count=30, deadline=None)
TestApproxModel = ApproxModel.TestCase


def test_an_event_on_another_medium_ends_the_guess():
    # the GPU guess under a CPU event lost its TTL and was held forever
    clock, index = _fresh()
    index.routed("a", [1, 2])
    index.store("a", [1], "CPU")
    assert index.prefix_runs([1, 2], ["a"]) == {"a": (2, 0)}  # 1 on the CPU alone now
    index.remove("a", [1], "CPU")
    clock.t = 100.0
    assert index.prefix_runs([1, 2], ["a"]) == {}
    assert index.num_blocks("a") == 0


def test_a_block_held_on_the_gpu_survives_the_removal_of_its_cpu_copy_and_a_guess():
    # removing the CPU copy forgot that an event holds the GPU copy; the next guess then
    # expired it
    clock, index = _fresh()
    index.store("a", [1], "GPU")
    index.store("a", [1], "CPU")
    index.remove("a", [1], "CPU")
    index.routed("a", [1])
    clock.t = 50.0
    assert index.prefix_runs([1], ["a"]) == {"a": (1, 1)}


def test_removing_a_medium_a_guess_is_not_on_keeps_its_ttl():
    clock, index = _fresh()
    index.routed("a", [1])
    index.remove("a", [1], "CPU")
    assert index.prefix_runs([1], ["a"]) == {"a": (1, 1)}
    clock.t = TTL
    assert index.prefix_runs([1], ["a"]) == {}


def test_expiry_is_exactly_at_the_ttl():
    clock, index = _fresh()
    index.routed("a", [1])
    clock.t = TTL - 1e-9
    assert index.prefix_runs([1], ["a"]) == {"a": (1, 1)}
    clock.t = TTL
    assert index.prefix_runs([1], ["a"]) == {}


def test_a_clock_that_jumps_back_or_forward():
    # a step back counted at face value: the guess made at 100 held until 105 of the
    # clock stepped back to 0 (104 s more), and b's, made after the step, waited behind it
    clock, index = _fresh()
    clock.t = 100.0
    index.routed("a", [1])
    clock.t = 0.0  # back: no time passes
    index.routed("b", [2])
    assert index.steps_back == 1
    clock.t = 4.0
    assert index.prefix_runs([1], ["a"]) == {"a": (1, 1)}
    assert index.prefix_runs([2], ["b"]) == {"b": (1, 1)}
    clock.t = 5.0  # TTL of forward motion since both guesses
    assert index.prefix_runs([1], ["a"]) == {} and index.prefix_runs([2], ["b"]) == {}
    index.routed("a", [3])
    clock.t = 1e12  # forward: every guess is gone
    assert index.prefix_runs([3], ["a"]) == {}
    assert index.num_blocks("a") == index.num_blocks("b") == 0
    assert not index._until and not index._queue


def test_a_guess_made_after_a_step_back_expires_on_time():
    # it was queued behind the guesses made before the step and outlived its TTL by the
    # whole step back (a day here)
    clock, index = _fresh()
    clock.t = 86400.0
    index.routed("a", [1])
    clock.t = 0.0
    index.routed("b", [2])
    clock.t = TTL
    assert index.prefix_runs([2], ["b"]) == {}
    assert index.num_blocks("a") == index.num_blocks("b") == 0


def test_a_clock_reading_that_is_not_a_finite_number_is_refused_before_any_change():
    from prefixkv.router import ApproxIndexError

    clock, index = _fresh()
    router = Router(["a", "b"], block_size=4, index=index, clock=lambda: 0.0)
    # round-robin reads the index only to record the guess: it counted the request first
    rr = Router(["a", "b"], block_size=4, index=index, clock=lambda: 0.0, policy="round-robin")
    index.routed("a", [1])
    for bad in (float("nan"), float("inf"), -float("inf"), None, True):
        clock.t = bad  # type: ignore[assignment]
        for call in (lambda: index.routed("b", [2]), lambda: index.prefix_runs([1], ["a"]),
                     lambda: index.num_blocks("a"), lambda: router.route(list(range(8))),
                     lambda: rr.route(list(range(8)))):
            with pytest.raises(ApproxIndexError):
                call()
        for r in (router, rr):
            assert r.in_flight == {"a": 0, "b": 0} and r.routed == {"a": 0, "b": 0}
    clock.t = 1.0
    assert index.prefix_runs([1, 2], ["a", "b"]) == {"a": (1, 1)}
    clock.t = TTL
    assert index.prefix_runs([1], ["a"]) == {}


def test_a_replica_cleared_while_its_guesses_live_and_routed_again():
    clock, index = _fresh()
    router = Router(["a", "b"], block_size=4, index=index, load_weight=0, clock=clock)
    prompt = list(range(16))
    first = router.route(prompt).replica
    clock.t = 1.0
    router.forget(first)
    assert router.cached_tokens(prompt)[first] == 0
    clock.t = 3.0
    index.routed(first, router.prompt_hashes(prompt))  # a newer guess, until 8
    clock.t = TTL + 0.5  # the first guess's queue entry comes due: the newer one stays
    assert router.cached_tokens(prompt)[first] == 16
    clock.t = 8.0
    assert router.cached_tokens(prompt)[first] == 0


def test_memory_stays_bounded_under_unique_prompts():
    clock = Clock()
    index = ApproxIndex(10.0, clock=clock)
    router = Router(["a", "b", "c"], block_size=4, index=index, clock=clock)
    most = 0
    for i in range(2000):
        clock.t = float(i)
        choice = router.route([i * 100 + j for j in range(16)])
        router.finish(choice.replica)
        most = max(most, len(index._until), sum(index.num_blocks(r) for r in "abc"))
        assert len(index._queue) <= 11
    assert most <= 11 * 4


def test_a_hash_twice_in_one_routed_prompt_expires_once():
    # found by ApproxModel: the second deletion of its expiry raised KeyError
    clock, index = _fresh()
    index.routed("a", [0, 0])
    clock.t = TTL
    assert index.prefix_runs([0], ["a"]) == {}


def test_a_ttl_that_is_not_seconds_is_refused():
    from prefixkv.errors import PrefixKVError
    from prefixkv.router import ApproxIndexError

    for bad in (0, -1.0, float("nan"), "5", True, None):
        with pytest.raises(ApproxIndexError):
            ApproxIndex(bad)  # type: ignore[arg-type]
    assert issubclass(ApproxIndexError, PrefixKVError)


def test_an_approx_index_states_what_its_cap_refused():
    # (fleet-r10: its inner InProcessIndex has the per-replica cap; the subscriber's
    # health reads ``refused`` off the router's index, which ApproxIndex did not have)
    from prefixkv.router.index import InProcessIndex

    index = ApproxIndex(60.0, clock=lambda: 0.0)
    index._index = InProcessIndex(max_per_replica=3)
    index.routed("a", [1, 2, 3, 4, 5])
    assert index.refused == {"a": 2} and index.num_blocks("a") == 3


def test_what_the_cap_refuses_is_not_kept_beside_it():
    """The inner index refuses a replica's blocks past its cap, but ApproxIndex kept each
    event-stored one in its own book of media (and each guess in its expiry book) all
    the same: a publisher announcing new blocks without end grew the router's memory
    without bound, past the per-replica cap meant to bound it."""
    from prefixkv.router.index import InProcessIndex

    index = ApproxIndex(60.0, clock=lambda: 0.0)
    index._index = InProcessIndex(max_per_replica=3)
    for i in range(20):
        index.store("a", [10 * i + k for k in range(5)], "GPU")
    index.routed("a", list(range(1000, 1100)))
    index.routed("b", [1, 2])
    assert index.num_blocks("a") == 3 and index.refused == {"a": 197}
    kept = {h for (r, h) in index._held if r == "a"}
    assert kept == {0, 1, 2}                       # what the inner index holds, no more
    assert [k for k in index._until if k[0] == "a"] == []
    assert sum(len(hashes) for _, r, hashes in index._queue if r == "a") == 0
    assert index.prefix_runs([1, 2], ["b"]) == {"b": (2, 2)}  # other replicas unaffected

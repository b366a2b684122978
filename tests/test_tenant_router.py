"""Tenants seen through events and the router. A published ``BlockStored`` names a
block by its chain hash: a salted block's hash must never equal the hash of the same
tokens unsalted or under another salt, or a subscriber, or a tenant reading the
router's ``Choice.cached_tokens``, could tell that another tenant sent a prompt. And the
router must predict, per tenant, exactly what the replica's manager will serve: its
``cached_tokens`` for a request are that request's own keys' hits, never another's."""

from __future__ import annotations

from typing import Any

import pytest

from prefixkv import BlockStored, ExtraKeys, KVCacheManager, MultiModalInput
from prefixkv.fleet.wire import encode_batch
from prefixkv.router import ApproxIndex, Router, decode_batch

BS = 4
PROMPT = list(range(1, 14))  # three full blocks a hit may reach

KEYS: dict[str, ExtraKeys | None] = {
    "none": None,
    "a": ExtraKeys(cache_salt="a"),
    "b": ExtraKeys(cache_salt="b"),
    "a NUL": ExtraKeys(cache_salt="a\x00"),
    "a spelling a tag": ExtraKeys(cache_salt="a" + "L\x00\x00\x00\x00"),
    "LoRA a": ExtraKeys(lora="a"),
    "NFC": ExtraKeys(cache_salt="caf\u00e9"),
    "NFD": ExtraKeys(cache_salt="cafe\u0301"),
    "salted image": ExtraKeys(cache_salt="a", mm=(MultiModalInput("img", 1, 2),)),
}
MODES: dict[str, dict[str, Any]] = {"sha256": dict(hash_mode="sha256"),
                                    "xxhash seeded": dict(hash_mode="xxhash", seed=7)}


def _stored_hashes(mode: dict[str, Any], extra: ExtraKeys | None) -> list[bytes]:
    m = KVCacheManager(16, BS, enable_events=True, **mode)
    m.add_request("r", PROMPT, extra=extra)
    return [h for e in m.take_events() if isinstance(e, BlockStored) for h in e.block_hashes]


@pytest.mark.parametrize("mode", list(MODES))
def test_no_two_tenants_blocks_are_announced_under_one_hash(mode):
    announced = {name: _stored_hashes(MODES[mode], extra) for name, extra in KEYS.items()}
    assert all(len(h) == 3 for h in announced.values())
    owners: dict[bytes, str] = {}
    for name, hashes in announced.items():
        for h in hashes:
            assert owners.setdefault(h, name) == name, (h, owners[h], name)
    # and on the wire (vLLM's 64-bit ints): still one owner per hash
    wire = {name: [int.from_bytes(h, "big") & (2**64 - 1) for h in hashes]
            for name, hashes in announced.items()}
    assert len({i for ints in wire.values() for i in ints}) == 3 * len(KEYS)


def _replica(extra: ExtraKeys | None, **mode: Any) -> KVCacheManager:
    m = KVCacheManager(64, BS, enable_events=True, **(mode or dict(hash_mode="sha256")))
    m.add_request("r", PROMPT, extra=extra)
    return m


@pytest.mark.parametrize("hash_format", ["int", "bytes"])
@pytest.mark.parametrize("writer", list(KEYS))
def test_the_routers_prediction_for_a_tenant_is_its_own_hit(writer, hash_format):
    router = Router(["r0", "r1"], block_size=BS, hash_format=hash_format, load_weight=0)
    m = _replica(KEYS[writer])
    router.apply("r1", decode_batch(encode_batch(m.take_events(), block_size=BS,
                                                 hash_format=hash_format))[1])
    for reader, extra in KEYS.items():
        predicted = router.cached_tokens(PROMPT, extra)
        assert predicted["r1"] == m.lookup(PROMPT, extra=extra), (writer, reader)
        assert predicted == {"r0": 0, "r1": 12 if reader == writer else 0}, (writer, reader)
        choice = router.route(PROMPT, extra)
        assert choice.cached_tokens == (12 if reader == writer else 0), (writer, reader)
        router.finish(choice.replica)


def test_an_approximate_index_learns_a_routed_prompt_for_its_tenant_only():
    """Without events the router guesses from its own decisions (``ApproxIndex``): a
    prompt routed for tenant a is predicted held for a alone."""
    router = Router(["r0", "r1"], block_size=BS, index=ApproxIndex(ttl=60.0, clock=lambda: 0.0))
    first = router.route(PROMPT, KEYS["a"])
    assert first.cached_tokens == 0
    for name, extra in KEYS.items():
        expected = 12 if name == "a" else 0
        assert router.cached_tokens(PROMPT, extra)[first.replica] == expected, name


def test_a_salted_event_names_its_salt_in_clear():
    """security.md section 5: the stream carries every tenant's salt (so a router can
    recompute identities); this pins that down, so the page stays true."""
    m = _replica(ExtraKeys(cache_salt="tenant-7"))
    stored = [e for e in m.take_events() if isinstance(e, BlockStored)]
    assert stored and all(e.extra is not None and e.extra.cache_salt == "tenant-7" for e in stored)

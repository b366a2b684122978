"""Many tenants in one cache: two requests whose extra keys differ (cache salt, LoRA,
multimodal inputs) never share a block, whatever the hash (xxhash, sha256, a callable
that collides on everything, seeds of None, 0 and b"\\x00"), in the plain and the hybrid
manager; the same keys do share (so each case can fail). The pairs are built to collide
where an encoding could be ambiguous: a key's bytes inside another kind's value, a salt
that spells the next tag, a NUL, the same multimodal hash at another offset, keys that
differ on the first block only or the last only."""

from __future__ import annotations

from typing import Any

import pytest

from prefixkv import ExtraKeys, KVCacheManager, MultiModalInput, PromptError
from prefixkv.groups import HybridKVCacheManager, full_attention, sliding_window

BS = 4
PROMPT = list(range(1, 14))  # 3 full blocks a hit may reach


def _mm(h: str | bytes, offset: int, length: int = 2) -> tuple[MultiModalInput, ...]:
    return (MultiModalInput(h, offset, length),)


# (first tenant's keys, second tenant's keys): different KV, never one block
PAIRS: dict[str, tuple[ExtraKeys | None, ExtraKeys | None]] = {
    "none/salt": (None, ExtraKeys(cache_salt="t")),
    "salt/salt": (ExtraKeys(cache_salt="a"), ExtraKeys(cache_salt="b")),
    "salt/lora of the same name": (ExtraKeys(cache_salt="ab"), ExtraKeys(lora="ab")),
    "lora+salt/lora spelling both": (ExtraKeys(lora="x", cache_salt="y"),
                                     ExtraKeys(lora="x" + "S\x01\x00\x00\x00y")),
    "salt/salt with a NUL": (ExtraKeys(cache_salt="a"), ExtraKeys(cache_salt="a\x00")),
    "salt/salt spelling a tag": (ExtraKeys(cache_salt="a"),
                                 ExtraKeys(cache_salt="a" + "L\x00\x00\x00\x00")),
    "image/none": (ExtraKeys(mm=_mm("img", 9)), None),
    "image/another image": (ExtraKeys(mm=_mm("img-1", 1)), ExtraKeys(mm=_mm("img-2", 1))),
    "image/the same image later": (ExtraKeys(mm=_mm("img", 1)), ExtraKeys(mm=_mm("img", 5))),
    "image/longer": (ExtraKeys(mm=_mm("img", 1, 2)), ExtraKeys(mm=_mm("img", 1, 3))),
    "salted image/image": (ExtraKeys(cache_salt="t", mm=_mm("img", 1)), ExtraKeys(mm=_mm("img", 1))),
}

SHARED = {"image/none": 8}  # keys that differ from block 2 on: blocks 0 and 1 are one KV


def _colliding(data: bytes) -> bytes:
    return b"same"


HASHES: dict[str, tuple[Any, Any]] = {
    "xxhash": ("xxhash", None), "sha256": ("sha256", None), "sha256 seed 0": ("sha256", 0),
    "sha256 seed bytes": ("sha256", b"\x00"), "colliding callable": (_colliding, None),
}


def _manager(kind: str, hash_name: str) -> Any:
    mode, seed = HASHES[hash_name]
    if kind == "plain":
        return KVCacheManager(40, BS, hash_mode=mode, seed=seed, enable_events=True)
    return HybridKVCacheManager([full_attention(), sliding_window(6)], 60, BS, hash_mode=mode,
                                seed=seed, enable_events=True)


@pytest.mark.parametrize("kind", ["plain", "hybrid"])
@pytest.mark.parametrize("hash_name", list(HASHES))
@pytest.mark.parametrize("pair", list(PAIRS))
def test_tenants_with_different_keys_never_share_a_block(kind, hash_name, pair):
    first, second = PAIRS[pair]
    m = _manager(kind, hash_name)
    m.add_request("a", PROMPT, extra=first)
    m.free("a")
    assert m.lookup(PROMPT, extra=first) == 12  # the same keys share: the case can fail
    shared = SHARED.get(pair, 0)
    assert m.lookup(PROMPT, extra=second) == shared
    assert m.add_request("b", PROMPT, extra=second).num_cached_tokens == shared
    m.check_invariants()


@pytest.mark.parametrize("kind", ["plain", "hybrid"])
def test_a_prompt_prepared_for_one_tenant_cannot_be_admitted_under_another(kind):
    m = _manager(kind, "sha256")
    salted = m.prepare(PROMPT, extra=ExtraKeys(cache_salt="a"))
    m.add_request("a", PROMPT, extra=ExtraKeys(cache_salt="b"))
    with pytest.raises(PromptError, match="extra= given with a Prompt"):
        m.add_request("b", salted, extra=ExtraKeys(cache_salt="b"))
    assert m.lookup(salted) == 0  # tenant b's blocks: no hit for a's Prompt
    m.free("a")
    m.add_request("c", salted)
    assert m.lookup(PROMPT, extra=ExtraKeys(cache_salt="a")) == 12
    assert m.lookup(PROMPT, extra=ExtraKeys(cache_salt="b")) == 12
    assert m.lookup(PROMPT) == 0
    m.check_invariants()


@pytest.mark.parametrize("kind", ["plain", "hybrid"])
def test_a_prompt_prepared_under_another_seed_is_refused(kind):
    # seeds None and 0 (sha256) name different chains: a Prompt carries its hashes
    a, b = (KVCacheManager(40, BS, hash_mode="sha256", seed=s, enable_events=True) if kind == "plain"
            else HybridKVCacheManager([full_attention(), sliding_window(6)], 60, BS, hash_mode="sha256",
                                      seed=s, enable_events=True) for s in (None, 0))
    with pytest.raises(PromptError, match="another configuration"):
        b.add_request("x", a.prepare(PROMPT))
    b.check_invariants()

"""Tenants through the vLLM plug-in (``prefixkv.integrations.vllm.KVCacheManager``) with
vLLM's own ``Request``: what ``get_computed_blocks`` (and so the admission) reads of a
request's ``cache_salt``, LoRA, multimodal features and prompt embeddings must keep
tenants apart exactly as vLLM's own manager does, on the ids path and on the path of
Prompts prepared on the input thread. Needs vllm (skipped without it)."""

from __future__ import annotations

import os
from typing import Any

import pytest

from engines import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # vLLM's own CPU platform (see vllm_cpu.py)
skip_module_without_vllm()
torch = pytest.importorskip("torch")

BS = 16
PROMPT = list(range(1, 41))  # two full blocks a hit may reach


def _manager(num_blocks: int = 11, hybrid: bool = False, **kw: Any) -> Any:
    """The plug-in over one full-attention group, or (``hybrid``) a full group and a
    32-token sliding window (two tables, a hit every group can serve); ``kw``: more of
    the manager's keywords."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    from prefixkv.integrations.vllm import KVCacheManager

    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["l0"], spec)]
    if hybrid:
        groups.append(KVCacheGroupSpec(["l1"], SlidingWindowSpec(
            block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=32)))
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    return KVCacheManager(config, max_model_len=8192, scheduler_block_size=BS, hash_block_size=BS, **kw)


def _request(rid: str, tokens: list[int], **kw: Any) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    return Request(request_id=rid, prompt_token_ids=tokens, sampling_params=SamplingParams(max_tokens=4),
                   pooling_params=None, **kw)


def _computed(m: Any, rid: str, tokens: list[int], **kw: Any) -> None:
    """Admit a request for its whole prompt and free it: its full blocks stay cached."""
    r = _request(rid, tokens, **kw)
    assert m.allocate_slots(r, len(tokens)) is not None
    m.free(r)


def _hit(m: Any, tokens: list[int], **kw: Any) -> int:
    return m.get_computed_blocks(_request("probe", tokens, **kw))[1]


def _lora(name: str, lora_id: int, path: str = "/adapters/x-v1") -> Any:
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, lora_id, path)


def _embeds(seed: int, rows: int = 40) -> Any:
    return torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4) + seed


def _features(keys: tuple[Any, ...]) -> list[Any]:
    """vLLM multimodal features whose identifiers (a str, as vLLM's are: a client's
    ``multi_modal_uuids`` among them) spell the given keys' hashes as closely as a str
    can (bytes that are no UTF-8 cannot be spelled: their replacement is the closest)."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    def spelled(h: str | bytes) -> str:
        return h if isinstance(h, str) else h.decode("utf-8", "replace")

    return [MultiModalFeatureSpec(data=None, modality="image", identifier=spelled(k.hash),
                                  mm_position=PlaceholderRange(k.offset, k.length)) for k in keys]


# (first tenant's request fields, second tenant's): never one block between them
APART: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "salt/salt": (dict(cache_salt="tenant-a"), dict(cache_salt="tenant-b")),
    "salt/none": (dict(cache_salt="tenant-a"), {}),
    "salt/salt with a NUL": (dict(cache_salt="a"), dict(cache_salt="a\x00")),
    "salt NFC/NFD": (dict(cache_salt="caf\u00e9"), dict(cache_salt="cafe\u0301")),
    "salt/LoRA of the salt's name": (dict(cache_salt="a"), dict(lora_request=_lora("a", 1))),
    "salted LoRA/LoRA": (dict(cache_salt="a", lora_request=_lora("x", 1)),
                         dict(lora_request=_lora("x", 1))),
}


@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize("pair", list(APART))
def test_vllm_requests_of_two_tenants_never_share_a_block(pair, hybrid):
    first, second = APART[pair]
    m = _manager(22 if hybrid else 11, hybrid)
    _computed(m, "a", PROMPT, **first)
    assert _hit(m, PROMPT, **first) == 32  # the same keys share: the case can fail
    assert _hit(m, PROMPT, **second) == 0
    r = _request("b", PROMPT, **second)
    assert m.allocate_slots(r, len(PROMPT)) is not None
    assert m.num_cached_tokens("b") == 32  # its own blocks are cached now, not a's
    firsts = m.get_computed_blocks(_request("c", PROMPT, **first))[0].get_block_ids()[0]
    assert len(firsts) == 2 and not set(m.get_block_ids("b")[0]) & set(firsts)


def test_salted_prompt_embeddings_share_only_within_the_salt():
    m = _manager()
    zeros = [0] * 40
    _computed(m, "a", zeros, prompt_embeds=_embeds(0), cache_salt="a")
    assert _hit(m, zeros, prompt_embeds=_embeds(0), cache_salt="a") == 32
    assert _hit(m, zeros, prompt_embeds=_embeds(0), cache_salt="b") == 0
    assert _hit(m, zeros, prompt_embeds=_embeds(0)) == 0
    assert _hit(m, zeros, cache_salt="a") == 0  # token 0 read where a's model read rows
    assert _hit(m, zeros, prompt_embeds=_embeds(1), cache_salt="a") == 0


def test_a_prepared_prompt_is_not_taken_once_the_requests_salt_changed():
    """The input thread prepares a request's Prompt under its salt; a salt changed
    before admission (a frontend that rewrites it) must not admit that Prompt."""
    m = _manager()
    _computed(m, "a", PROMPT, cache_salt="a")
    r = _request("b", PROMPT, cache_salt="a")
    m.prepared_prompts.hasher(None)(r)
    assert m.prepared_prompts.prepared == 1
    r.cache_salt = "b"
    assert m.get_computed_blocks(r)[1] == 0
    assert m.prepared_prompts.taken == 0
    r.cache_salt = "a"
    assert m.get_computed_blocks(r)[1] == 32 and m.prepared_prompts.taken == 1


def test_an_empty_salt_is_read_as_vllm_reads_it():
    m = _manager()
    _computed(m, "a", PROMPT)
    assert _hit(m, PROMPT, cache_salt="") == 32  # vLLM's manager: no salt, the unsalted hit
    assert _hit(m, PROMPT, cache_salt="a") == 0


def test_a_multimodal_identifier_cannot_spell_a_prompt_embeddings_key():
    from prefixkv.integrations.vllm.requests import extra_keys_of

    m = _manager()
    zeros = [0] * 40
    victim_keys = extra_keys_of(_request("v", zeros, prompt_embeds=_embeds(0)), BS)
    assert victim_keys is not None and len(victim_keys.mm) == 3
    _computed(m, "att", zeros, mm_features=_features(victim_keys.mm))  # image KV, computed
    assert _hit(m, zeros, mm_features=_features(victim_keys.mm)) == 32  # (the case can fail)
    assert _hit(m, zeros, prompt_embeds=_embeds(0)) == 0


def test_the_connectors_lookup_asks_only_the_requests_own_namespace():
    """A core manager (tenant a, salt "a") writes its blocks to the store; the vLLM
    connector's lookup finds them for a vLLM request with salt "a" (the key builders
    agree) and asks no key of a's for a request with another salt or none."""
    from prefixkv import ExtraKeys, KVCacheManager
    from prefixkv.hashing import make_hash_fn
    from prefixkv.integrations.vllm.connector_scheduler import ConnectorScheduler
    from test_tenant_store import DictStore, _computed, _shared

    backend = DictStore()
    puts = _computed(KVCacheManager(8, BS, hash_mode="sha256", host_blocks=4, store=_shared(backend)),
                     backend, "w", PROMPT, ExtraKeys(cache_salt="a"))
    assert len(puts) == 2
    fn, root = make_hash_fn("sha256", None)
    link = _shared(backend).bind("sha256", None, root, BS, None, None)
    sched = ConnectorScheduler(link, backend, BS, fn, root, retry_after=0)
    assert sched.num_new_matched_tokens(_request("a", PROMPT, cache_salt="a"), 0) == (32, True)
    for i, kw in enumerate([dict(cache_salt="b"), {}, dict(cache_salt="a\x00"),
                            dict(cache_salt="a", lora_request=_lora("x", 1))]):
        backend.asked.clear()
        assert sched.num_new_matched_tokens(_request(f"r{i}", PROMPT, **kw), 0) == (0, False), kw
        assert backend.asked and not set(backend.asked) & {p.key for p in puts}, kw


def test_a_lora_name_repointed_at_another_adapter_is_not_served_the_old_kv():
    m = _manager()
    _computed(m, "a", PROMPT, lora_request=_lora("x", 1))
    assert _hit(m, PROMPT, lora_request=_lora("x", 1)) == 32  # (the case can fail)
    assert _hit(m, PROMPT, lora_request=_lora("x", 2, "/adapters/x-v2")) == 0


def test_the_plug_ins_events_name_no_block_of_two_tenants_alike():
    """vLLM's ``BlockStored`` from the plug-in: each tenant's blocks under hashes of its
    own (a subscriber learns nothing of a's prompt from b's or the unsalted stream's
    hashes); the salt is in the first block's keys, in clear, as vLLM publishes it
    (security.md section 5)."""
    from vllm.distributed.kv_events import BlockStored

    m = _manager(40, enable_kv_cache_events=True)
    hashes: dict[str, list[Any]] = {}
    for name, kw in [("a", dict(cache_salt="a")), ("b", dict(cache_salt="b")), ("none", {}),
                     ("lora a", dict(lora_request=_lora("a", 1)))]:
        assert m.allocate_slots(_request(name, PROMPT, **kw), len(PROMPT)) is not None
        stored = [e for e in m.take_events() if isinstance(e, BlockStored)]
        hashes[name] = [h for e in stored for h in e.block_hashes]
        assert len(hashes[name]) == 2
        if "cache_salt" in kw:
            keys = [k for e in stored for k in e.extra_keys]
            assert keys[0] is not None and kw["cache_salt"] in keys[0]
            assert not any(k is not None and kw["cache_salt"] in k for k in keys[1:])
    every = [h for hs in hashes.values() for h in hs]
    assert len(set(every)) == len(every)

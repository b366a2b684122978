"""Both of prefixkv's event paths send vLLM 0.33's per-block ``extra_keys``: the fleet
wire (``prefixkv.fleet.wire``, decoded here with vLLM's own ``KVEventBatch`` msgspec
struct, as a consumer of vLLM's stream decodes it) and the plug-in's events (vLLM's own
``BlockStored`` structs, ``integrations.vllm.events``), each against what vLLM's own
``generate_block_hash_extra_keys`` and ``to_event_extra_keys`` give for the same request.
A bytes multimodal identifier travels as hex (vLLM's identifiers are str: a digest in
hex); a block's prompt-embeddings digest as vLLM sends it, bare bytes after the salt.
Needs vllm installed."""

from __future__ import annotations

import hashlib
import os
from types import SimpleNamespace

import pytest

from prefixkv import ExtraKeys, KVCacheManager, MultiModalInput

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()

BS = 4
PROMPT = list(range(1, 18))  # 4 full blocks


def plain(value):
    """Tuples as lists, recursively (msgpack has one array type)."""
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def digest(i: int) -> bytes:
    return hashlib.sha256(b"block %d" % i).digest()


def vllm_keys(lora, salt, mm, embeds):
    """vLLM's ``extra_keys`` of the prompt's 4 full blocks, one call a block as its
    ``BlockPool.cache_full_blocks`` makes them (the mm index carried)."""
    from vllm.v1.core import kv_cache_utils as utils

    request = SimpleNamespace(
        mm_features=[SimpleNamespace(identifier=i.hex() if isinstance(i, bytes) else i,
                                     mm_position=SimpleNamespace(offset=o, length=n))
                     for i, o, n in mm],
        lora_request=None if lora is None else SimpleNamespace(lora_name=lora, lora_path="/x"),
        cache_salt=salt, prompt_embeds=object() if embeds else None,
        _prompt_embeds_per_block_hashes={(j * BS, (j + 1) * BS): digest(j) for j in range(4)},
        num_tokens=len(PROMPT))
    keys, mm_idx = [], 0
    for j in range(4):
        k, mm_idx = utils.generate_block_hash_extra_keys(request, j * BS, (j + 1) * BS, mm_idx)
        keys.append(k)
    return utils.to_event_extra_keys(keys)


@pytest.mark.parametrize("lora, salt, mm, embeds", [
    (None, "tenant-x", [("img-1", 5, 2)], False),
    ("ad", "s", [("a", 0, 3), (b"\xab\x01", 3, 9), ("c", 14, 2)], False),
    (None, "tenant-x", [], True),                   # a salted embedded prompt
    ("ad", None, [("img-1", 5, 6)], True),          # LoRA, an image and embeddings
])
def test_the_wire_and_the_plugin_send_vllms_extra_keys(lora, salt, mm, embeds):
    import msgspec
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    from prefixkv.fleet.wire import encode_batch
    from prefixkv.integrations.vllm.events import to_vllm_events
    from prefixkv.integrations.vllm.requests import EMBEDS_TAG

    inputs = [MultiModalInput(i, o, n) for i, o, n in mm]
    if embeds:  # as the plug-in keys them (requests.extra_keys_of): one input a block
        inputs += [MultiModalInput(EMBEDS_TAG + digest(j), j * BS, min(BS, len(PROMPT) - j * BS))
                   for j in range(5)]
    mgr = KVCacheManager(16, BS, hash_mode="sha256", enable_events=True)
    mgr.add_request("a", PROMPT, extra=ExtraKeys(lora=lora, cache_salt=salt, mm=tuple(inputs)))
    events = mgr.take_events()
    want = plain(vllm_keys(lora, salt, mm, embeds))
    batch = msgspec.msgpack.Decoder(type=KVEventBatch).decode(encode_batch(events, block_size=BS))
    (wire,) = batch.events
    assert isinstance(wire, BlockStored) and plain(wire.extra_keys) == want
    (plugin,) = to_vllm_events(events, BS, [("full_attention", None)])
    assert isinstance(plugin, BlockStored) and plain(plugin.extra_keys) == want

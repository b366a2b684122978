"""``num_prompt_tokens``, which vLLM 0.33's scheduler passes to
``remove_skipped_blocks`` when a request finishes and prefixkv's plug-in ignores: read by
vLLM's own managers only for the specs prefixkv refuses (R-SWA frees the gap between the
prompt and the decode window; DeepSeek-V4.1's bounded replay and Mamba read it elsewhere),
never by the full-attention, sliding-window and chunked-local managers prefixkv takes the
place of. Needs vllm installed."""

from __future__ import annotations

import os
from typing import Any

import pytest

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")

from .test_vllm_hybrid_reference import _chunked, _window  # noqa: E402
from .test_vllm_plugin import config, full  # noqa: E402
from .test_vllm_reference import BS, MAX_LEN, NULL, _request  # noqa: E402


def _theirs(*specs: Any) -> Any:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)
    return KVCacheManager(config(*specs, num_blocks=40), max_model_len=MAX_LEN,
                          scheduler_block_size=BS, hash_block_size=BS)


def _decoded(m: Any, prompt: int, total: int) -> Any:
    """A request of ``prompt`` tokens decoded, one token a step, up to ``total``."""
    from vllm.v1.request import RequestStatus

    a = _request("a", list(range(prompt)), None)
    assert m.allocate_slots(a, prompt) is not None
    a.status, a.num_computed_tokens = RequestStatus.RUNNING, prompt
    while a.num_computed_tokens < total:
        a.append_output_token_ids(7)
        assert m.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
    return a


def test_rswa_frees_what_its_prompt_length_says_and_prefixkv_refuses_it_by_name():
    # vLLM's RSWASpec is a FullAttentionSpec subclass: were it taken as full attention,
    # prefixkv would hold the gap blocks vLLM's RSWAManager frees once it knows the
    # prompt's length (and hand them to a connector at finish)
    from vllm.v1.kv_cache_interface import RSWASpec

    from prefixkv.integrations.vllm import KVCacheManager, UnsupportedByPrefixKV

    rswa = RSWASpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32, rswa_window=8)
    m = _theirs(rswa)  # (its allocate_slots passes the prompt's length too)
    _decoded(m, 8, 32)
    table = m.get_block_ids("a")[0]
    assert NULL not in table[:2] and table[2:5] == [NULL] * 3 and NULL not in table[5:]
    with pytest.raises(UnsupportedByPrefixKV, match="RSWASpec"):
        KVCacheManager(config(rswa, num_blocks=40), max_model_len=MAX_LEN, scheduler_block_size=BS,
                       hash_block_size=BS)


@pytest.mark.parametrize("specs", [(full(BS),), (full(BS), _window(8)), (_window(5),),
                                   (full(BS), _chunked(8))], ids=["full", "full+window8", "window5",
                                                                  "full+chunked8"])
def test_the_managers_prefixkv_replaces_never_read_the_prompt_length(specs):
    # with or without num_prompt_tokens (and whatever it says), vLLM's own manager frees
    # the same blocks: prefixkv ignoring it cannot release or keep a block differently
    tables = []
    for prompt_len in (None, 8, 1, 31):
        m = _theirs(*specs)
        _decoded(m, 8, 31)
        m.remove_skipped_blocks("a", 31, num_prompt_tokens=prompt_len)
        tables.append((m.get_block_ids("a"), m.block_pool.get_num_free_blocks()))
    assert tables[1:] == tables[:1] * 3

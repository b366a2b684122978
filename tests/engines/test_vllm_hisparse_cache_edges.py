"""prefixkv's HiSparse plug-in manager with caching on (integrations/vllm/hisparse_cache.py)
beside vLLM 0.33's own, on what the random streams of test_vllm_hisparse_cache.py do not
reach: a request that skips reading the cache, a miss (vLLM's empty blocks object), and
the lookups' statistics. Exact values, both managers alike (mutants-r29). Needs vllm."""

from __future__ import annotations

from typing import Any

import pytest

from . import skip_module_without_vllm

skip_module_without_vllm()

from vllm.v1.hisparse.coordinator import get_hisparse_coordinator  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from .hisparse_model import BS, MAX_LEN  # noqa: E402
from .test_vllm_block_sizes_reference import _request  # noqa: E402
from .test_vllm_hisparse import hisparse_config, vllm_manager  # noqa: E402
from .test_vllm_hisparse_manager import _plugin_manager  # noqa: E402


@pytest.fixture(autouse=True)
def _none_hash() -> None:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)


def _published(m: Any) -> None:
    """A 64-token request computed, its 4 copies confirmed, freed finished."""
    seam = get_hisparse_coordinator(m)
    first = _request("first", list(range(64)), BS)
    m.allocate_slots(first, 64)
    seam.advance_scheduled([("first", 64)])
    first.num_computed_tokens = 64
    sent = [t.transfer_id for t in seam.build_offload_command().page_transfers]
    seam.update_spills(dict.fromkeys(sent, 1), dict.fromkeys(sent, 1))
    first.status = RequestStatus.FINISHED_STOPPED
    m.free(first)


@pytest.mark.parametrize("side", ["vllm", "prefixkv"])
def test_a_skipping_request_a_miss_and_a_hit_with_their_statistics(side: str) -> None:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    cfg, kw = hisparse_config(32, 16), {"max_model_len": MAX_LEN, "enable_caching": True, "log_stats": True}
    m = vllm_manager(cfg, **kw) if side == "vllm" else _plugin_manager(cfg, **kw)
    _published(m)
    skip = Request(request_id="skip", prompt_token_ids=list(range(64)),
                   sampling_params=SamplingParams(max_tokens=4, skip_reading_prefix_cache=True),
                   pooling_params=None, block_hasher=get_request_block_hasher(BS, sha256))
    miss, probe = _request("miss", list(range(1000, 1064)), BS), _request("probe", list(range(64)), BS)
    answers = []
    for req in (skip, miss, probe):
        blocks, hit, boundary = m.get_computed_blocks(req)
        m.record_prefix_cache_stats(req, hit)
        answers.append((blocks.get_block_ids(), hit, boundary, blocks is m.empty_kv_cache_blocks))
    assert answers == [(([], [], [], []), 0, 0, True), (([], [], [], []), 0, 0, True),
                       (([1, 2, 3], [1, 2, 3], [], []), 48, 0, False)]
    stats = m.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 128, 48)

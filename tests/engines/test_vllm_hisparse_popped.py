"""``pop_blocks_for_free`` of a HiSparse manager (integrations/vllm/hisparse_popped.py)
against vLLM 0.33's own manager side by side, caching off and on: requests of dirty pages
alone popped, their blocks held by the caller (nothing of them reused) while others
allocate, then given back through ``block_pool.free_blocks`` in vLLM's reversed order
(host blocks to the host pool), every block id and free count vLLM's; then what is
refused by name. Needs vllm installed."""

from __future__ import annotations

from typing import Any

import pytest

from . import skip_module_without_vllm

skip_module_without_vllm()

from vllm.v1.hisparse.coordinator import get_hisparse_coordinator  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from prefixkv.integrations.vllm import UnsupportedByPrefixKV  # noqa: E402

from .hisparse_model import BS, MAX_LEN  # noqa: E402
from .test_vllm_block_sizes_reference import _request  # noqa: E402
from .test_vllm_hisparse import hisparse_config, vllm_manager  # noqa: E402
from .test_vllm_hisparse_cache import _none_hash  # noqa: E402, F401
from .test_vllm_hisparse_manager import _ids, _plugin_manager  # noqa: E402


def _counts(m: Any) -> tuple[int, int]:
    """The device pool's and the host pool's free counts."""
    host = get_hisparse_coordinator(m).get_host_block_pool()
    return m.block_pool.get_num_free_blocks(), host.get_num_free_blocks()


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("sizes", [(40, 20, 48, 30), (16, 64, 33, 17), (1, 1, 80, 5)])
def test_popped_blocks_are_held_until_given_back_as_vllm(caching: bool, sizes: tuple[int, ...]) -> None:
    """Requests a and b allocated (no step: their pages dirty); a popped finished: its
    blocks (host ones the host pool's objects) held; c allocated meanwhile; a's blocks
    given back reversed; d allocated: every id, block list and count the same on both."""
    a, b, c, d = sizes
    cfg = hisparse_config(40, 24)
    seen = []
    for m in (vllm_manager(cfg, max_model_len=MAX_LEN, enable_caching=caching),
              _plugin_manager(cfg, max_model_len=MAX_LEN, enable_caching=caching)):
        host_pool = get_hisparse_coordinator(m).get_host_block_pool()
        reqs = {k: _request(k, list(range(100 * i, 100 * i + n)), BS) for i, (k, n) in
                enumerate(zip("abcd", sizes, strict=True))}
        got = [_ids(m.allocate_slots(reqs[k], n)) for k, n in (("a", a), ("b", b))]
        before = _counts(m)
        reqs["a"].status = RequestStatus.FINISHED_STOPPED
        popped = m.pop_blocks_for_free(reqs["a"])
        got.append([(b.block_id, b.block_id < len(host_pool.blocks) and host_pool.blocks[b.block_id] is b)
                    for b in popped])
        got += [_counts(m), m.get_block_ids("a"), _ids(m.allocate_slots(reqs["c"], c)), _counts(m)]
        m.block_pool.free_blocks(reversed(popped))
        got += [_counts(m), _ids(m.allocate_slots(reqs["d"], d)), _counts(m), before]
        assert m.pop_blocks_for_free(reqs["a"]) == []
        seen.append(got)
    assert seen[1] == seen[0]


def test_a_request_with_a_copy_in_flight_is_refused_with_nothing_changed() -> None:
    """A stepped request (copies of its sealed pages planned): UnsupportedByPrefixKV naming
    pop_blocks_for_free, its blocks and the counts unchanged. A popped block given back
    twice, or one not handed out: RequestError, nothing changed."""
    from prefixkv.errors import RequestError

    ours = _plugin_manager(hisparse_config(32, 16))
    seam = get_hisparse_coordinator(ours)
    req = _request("r", list(range(40)), BS)
    ours.allocate_slots(req, 40)
    seam.advance_scheduled([("r", 40)])
    before = (_counts(ours), ours.get_block_ids("r"))
    with pytest.raises(UnsupportedByPrefixKV, match="pop_blocks_for_free"):
        ours.pop_blocks_for_free(req)
    assert (_counts(ours), ours.get_block_ids("r")) == before
    other = _request("o", list(range(500, 520)), BS)
    ours.allocate_slots(other, 20)
    popped = ours.pop_blocks_for_free(other)
    with pytest.raises(RequestError, match="not all taken"):
        ours.block_pool.free_blocks([*popped, popped[0]])
    with pytest.raises(RequestError, match="not all taken"):
        ours.block_pool.free_blocks([ours.block_pool.blocks[ours.get_block_ids("r")[1][0]]])
    ours.block_pool.free_blocks(popped)
    ours.state.check_invariants()

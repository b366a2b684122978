"""prefixkv's vLLM plug-in beside vLLM 0.33's own manager on Mamba groups with speculative
state blocks (``MambaSpec.num_speculative_blocks``: MTP / EAGLE steps write their draft
tokens' states into blocks past the request's end). In ``mamba_cache_mode="none"`` (caching
off) vLLM's ``MambaManager`` counts ``num_tokens + num_speculative_blocks * block_size``
in that group only; prefixkv serves it as a 2-token window holding that many blocks past
its row's end (``GroupSpec.ahead``, groups/spec_blocks.py). The request stream of
test_vllm_reference.py with the comparisons of test_vllm_hybrid_reference.py after every
call (tables with null entries, free counts, blocks to zero, usage, estimates,
``check_invariants``), scenarios with exact ids, and align mode's refusal by name (vLLM
relocates its speculative blocks there each step: not offered). Needs vllm installed."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")

from .test_vllm_hybrid_reference import _step, _window  # noqa: E402
from .test_vllm_mamba_none import _none, _run_steps  # noqa: E402
from .test_vllm_plugin import config, full  # noqa: E402
from .test_vllm_reference import BS, MAX_LEN, OP, _managers  # noqa: E402

SPEC_LAYOUTS = {
    "full+mamba3": lambda: (full(BS), _none(num_speculative_blocks=3)),
    "mamba1": lambda: (_none(num_speculative_blocks=1),),
    "mamba2+full+mamba": lambda: (_none(num_speculative_blocks=2), full(BS), _none()),
    "window6+mamba2": lambda: (_window(6), _none(num_speculative_blocks=2)),
}


@pytest.mark.parametrize("groups", list(SPEC_LAYOUTS))
@settings(max_examples=40, deadline=None)
@given(extra_blocks=st.integers(1, 16), ops=st.lists(OP, min_size=8, max_size=40))
def test_they_agree_on_the_speculative_blocks_of_mamba_in_none_mode(groups, extra_blocks, ops):
    specs = SPEC_LAYOUTS[groups]()
    sides = _managers(len(specs) * MAX_LEN // BS + extra_blocks, specs, enable_caching=False)
    for serial, (op, slot, k, prompt, more) in enumerate(ops):
        _step(sides, op, slot, k, prompt, more, serial)


def test_a_request_holds_its_speculative_blocks_past_its_row_as_in_vllm():
    # full attention beside Mamba (none) with 2 speculative blocks, caching off, blocks
    # of 4: 11 tokens in chunks of 5, 3 (lookahead 2), 3, then a decode step. Mamba's
    # row is cdiv(slots, 4) + 2 entries; the second step releases its block 3 (below
    # token 4's state), which full attention's third block reuses at once
    tables = [_run_steps(side.m, 11, ((5, 0), (3, 2), (3, 0), (1, 0)))
              for side in _managers(20, (full(BS), _none(num_speculative_blocks=2)), enable_caching=False)]
    assert tables[0] == tables[1]
    assert tables[0] == [([[1, 2], [3, 4, 5, 6]], 13), ([[1, 2, 3], [0, 4, 5, 6, 7]], 12),
                         ([[1, 2, 3], [0, 4, 5, 6, 7]], 12), ([[1, 2, 3], [0, 0, 5, 6, 7]], 13)]


def test_a_mamba_block_of_max_model_len_with_speculative_blocks_is_served_as_in_vllm():
    # vLLM's usual none-mode layout with MTP: Mamba's block is max_model_len (256) beside
    # full attention at 16 (scheduler and hash block 256, the lcm: nothing is hashed),
    # 3 speculative blocks: the Mamba row is 1 + 3 blocks throughout. 100 tokens in
    # steps of 30, 40 (lookahead 3), 30, then decode steps; then freed
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager as Theirs
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.kv_cache_interface import MambaSpec

    from prefixkv.integrations.vllm import KVCacheManager

    init_none_hash(sha256)
    answers = []
    for make in (KVCacheManager, Theirs):
        mamba = MambaSpec(block_size=256, shapes=((1, 1),), dtypes=(torch.float32,), mamba_cache_mode="none",
                          num_speculative_blocks=3)
        m = make(config(full(16), mamba, num_blocks=40), max_model_len=256, scheduler_block_size=256,
                 hash_block_size=256, enable_caching=False)
        seen = _run_steps(m, 100, ((30, 0), (40, 3), (30, 0), (1, 2), (1, 0)))
        m.free(m.request)
        answers.append((seen, m.block_pool.get_num_free_blocks()))
    assert answers[0] == answers[1]
    fa, mamba_row = [1, 2, 7, 8, 9, 10, 11], [3, 4, 5, 6]
    assert answers[0] == ([([fa[:2], mamba_row], 33), ([fa[:5], mamba_row], 30), ([fa, mamba_row], 28),
                           ([fa, mamba_row], 28), ([fa, mamba_row], 28)], 39)


def test_align_mode_with_speculative_blocks_is_still_refused_by_name():
    # vLLM's align mode keeps the running state in the last 1 + S blocks and relocates
    # the previous step's speculative blocks to the row's end (its
    # ``_relocate_speculative_block``): not offered
    from vllm.v1.kv_cache_interface import MambaSpec

    from prefixkv.integrations.vllm import KVCacheManager, UnsupportedByPrefixKV

    mamba = MambaSpec(block_size=BS, shapes=((1, 1),), dtypes=(torch.float32,), mamba_cache_mode="align",
                      num_speculative_blocks=2)
    with pytest.raises(UnsupportedByPrefixKV, match="num_speculative_blocks.*align"):
        KVCacheManager(config(full(BS), mamba, num_blocks=20), max_model_len=MAX_LEN, scheduler_block_size=BS,
                       hash_block_size=BS, enable_caching=True)

"""prefixkv's vLLM plug-in beside vLLM 0.33's own manager on Mamba groups in
``mamba_cache_mode="none"`` (prefix caching off: vLLM asserts it). vLLM's ``MambaManager``
there is its base manager with ``get_num_skipped_tokens(n) = n - 1``: a request holds the
blocks of its tokens from the one of its last computed token's state on (nothing cached,
nothing jumped over); prefixkv serves it as a window of 2 tokens (layout.py). The request
stream of test_vllm_reference.py (admissions with lookahead slots and blocks kept free,
a connector's async loads, steps, frees, preemptions, resets, invalid KV), with the
comparisons of test_vllm_hybrid_reference.py after every call (each group's table with
its null entries, the free count, the blocks to zero, usage, the estimates, and
prefixkv's ``check_invariants``); and a scenario of steps of one block per group whose
block ids are vLLM's (nothing cached: the hybrid manager's ``enable_caching=False``, whose
released blocks are reused first, as vLLM's; a step taking several blocks per group takes
them position by position where vLLM takes them group by group, so ids may differ there).
Needs vllm installed."""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")

from .test_vllm_hybrid_reference import _step, _window  # noqa: E402
from .test_vllm_plugin import config, full  # noqa: E402
from .test_vllm_reference import BS, MAX_LEN, OP, _managers, _request  # noqa: E402


def _none(**kw: Any) -> Any:
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(block_size=BS, shapes=((1, 1),), dtypes=(torch.float32,), mamba_cache_mode="none", **kw)


def _run_steps(m: Any, num_tokens: int, steps: Any) -> list[Any]:
    """A request of ``num_tokens`` prompt tokens (``m.request``) run on ``m`` in
    ``steps`` of (tokens, lookahead slots), an output token appended when its tokens are
    all computed: its tables and the free count after each."""
    from vllm.v1.request import RequestStatus

    m.request = r = _request("a", list(range(num_tokens)), None)
    r.status, seen = RequestStatus.RUNNING, []
    for n, ahead in steps:
        if r.num_computed_tokens == r.num_tokens:
            r.append_output_token_ids(7)
        assert m.allocate_slots(r, n, num_lookahead_tokens=ahead) is not None
        r.num_computed_tokens += n
        seen.append(([list(g) for g in m.get_block_ids("a")], m.block_pool.get_num_free_blocks()))
    return seen


NONE_LAYOUTS = {
    "full+mamba": lambda: (full(BS), _none()),
    "mamba": lambda: (_none(),),
    "mamba+full+mamba": lambda: (_none(), full(BS), _none()),
    "window6+mamba": lambda: (_window(6), _none()),
    "full+window6": lambda: (full(BS), _window(6)),  # (no Mamba: the hybrid manager, caching off)
    # with speculative blocks (test_vllm_mamba_spec_blocks.py)
    "full+mamba-spec3": lambda: (full(BS), _none(num_speculative_blocks=3)),
    "mamba-spec1": lambda: (_none(num_speculative_blocks=1),),
    "mamba-spec2+full+mamba": lambda: (_none(num_speculative_blocks=2), full(BS), _none()),
    "window6+mamba-spec2": lambda: (_window(6), _none(num_speculative_blocks=2)),
}


@pytest.mark.parametrize("groups", list(NONE_LAYOUTS))
@settings(max_examples=40, deadline=None)
@given(extra_blocks=st.integers(1, 16), ops=st.lists(OP, min_size=8, max_size=40))
def test_with_caching_off_they_agree_on_the_blocks_mamba_in_none_mode_holds(groups, extra_blocks, ops):
    specs = NONE_LAYOUTS[groups]()
    sides = _managers(len(specs) * MAX_LEN // BS + extra_blocks, specs, enable_caching=False)
    for serial, (op, slot, k, prompt, more) in enumerate(ops):
        _step(sides, op, slot, k, prompt, more, serial)


def test_a_request_holds_the_block_of_its_last_state_and_those_after_it_as_in_vllm():
    # full attention beside Mamba (none), caching off: 11 tokens in chunks of 5, 3
    # (lookahead 2), 3, then a decode step; Mamba's table keeps the block of token
    # n - 1's state on, and the blocks below go back
    tables = [_run_steps(side.m, 11, ((5, 0), (3, 2), (3, 0), (1, 0)))
              for side in _managers(20, (full(BS), _none()), enable_caching=False)]
    assert tables[0] == tables[1]
    # (the second step releases Mamba's block 3, below token 4's state, before it takes
    # full attention's third block: 3 again, reused first since nothing is cached; the
    # hybrid manager recorded it and reused 5 before)
    assert tables[0] == [([[1, 2], [3, 4]], 15), ([[1, 2, 3], [0, 4, 5]], 14),
                         ([[1, 2, 3], [0, 4, 5]], 14), ([[1, 2, 3], [0, 0, 5]], 15)]


def test_none_mode_with_caching_on_is_a_config_error_as_vllms_assert():
    from vllm.v1.core.kv_cache_manager import KVCacheManager as Theirs

    from prefixkv.errors import ConfigError
    from prefixkv.integrations.vllm import KVCacheManager, UnsupportedByPrefixKV

    kw = dict(max_model_len=MAX_LEN, scheduler_block_size=BS, hash_block_size=BS)
    with pytest.raises(AssertionError, match="mamba_cache_mode='align'"):
        Theirs(config(full(BS), _none(), num_blocks=20), enable_caching=True, **kw)
    with pytest.raises(ConfigError, match="mamba_cache_mode='none'") as info:
        KVCacheManager(config(full(BS), _none(), num_blocks=20), enable_caching=True, **kw)
    assert not isinstance(info.value, UnsupportedByPrefixKV)


def _at_max_model_len(**mamba: Any) -> list[Any]:
    """Full attention at 16 beside a none-mode Mamba group (``mamba``: MambaSpec's
    keywords) of block 256 = max_model_len, scheduler and hash block 256, on prefixkv's
    manager and on vLLM's: 100 tokens in steps of 30, 40 (lookahead 3), 30, then decode
    steps, then freed; the tables and free counts after each, then the free count."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager as Theirs
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.kv_cache_interface import MambaSpec

    from prefixkv.integrations.vllm import KVCacheManager

    init_none_hash(sha256)
    answers = []
    for make in (KVCacheManager, Theirs):
        spec = MambaSpec(block_size=256, shapes=((1, 1),), dtypes=(torch.float32,), mamba_cache_mode="none",
                         **mamba)
        m = make(config(full(16), spec, num_blocks=40), max_model_len=256, scheduler_block_size=256,
                 hash_block_size=256, enable_caching=False)
        seen = _run_steps(m, 100, ((30, 0), (40, 3), (30, 0), (1, 2), (1, 0)))
        m.free(m.request)
        answers.append((seen, m.block_pool.get_num_free_blocks()))
    return answers


def test_a_mamba_block_of_max_model_len_beside_full_attention_is_served_as_in_vllm():
    # vLLM's usual none-mode layout: Mamba's block is max_model_len (256: one per request)
    # beside full attention at 16; with caching off vLLM passes the lcm, 256, as the hash
    # block too (nothing is hashed), which prefixkv refused (not a divisor of 16). 100
    # tokens in steps of 30, 40 (lookahead 3), 30, then decode steps: the same tables and
    # free counts, the Mamba row one block throughout
    answers = _at_max_model_len()
    assert answers[0] == answers[1]
    fa = [1, 2, 4, 5, 6, 7, 8]
    assert answers[0] == ([([fa[:2], [3]], 36), ([fa[:5], [3]], 33), ([fa, [3]], 31), ([fa, [3]], 31),
                           ([fa, [3]], 31)], 39)

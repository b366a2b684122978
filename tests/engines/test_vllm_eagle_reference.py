"""EAGLE's shortened hits (``use_eagle``) beside vLLM 0.33's own manager: the request
stream of test_vllm_reference.py on both, with ``use_eagle=True``, on the layouts the
plug-in offers EAGLE on (``options.eagle_layout``): one full-attention group (the hit
drops its last block), one sliding-window group, and full attention beside a window
(each group matches one block past the hit: ``peek``). Hits, tables, null entries and
free counts must agree after every call. Needs vllm installed."""

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
from .test_vllm_reference import BS, MAX_LEN, OP, Side  # noqa: E402

LAYOUTS = {
    "full": lambda: (full(BS),),
    "window5": lambda: (_window(5),),
    "full+window8": lambda: (full(BS), _window(8)),
    "window6+full": lambda: (_window(6), full(BS)),
    "full+window13+full": lambda: (full(BS), _window(13), full(BS)),
}
FLAGGED = {"full+window8": (0,), "window6+full": (0,), "full+window13+full": (2,)}
"""vLLM's ``is_eagle_group`` where its draft model's layers are: on one group (the others
of its spec follow it)."""


def eagle_managers(num_blocks: int, specs: tuple[Any, ...], flagged: tuple[int, ...] = ()) -> list[Side]:
    """prefixkv's plug-in and vLLM's own manager over ``specs``, both with EAGLE, the
    groups ``flagged`` marked ``is_eagle_group`` (none: vLLM takes every group)."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager as Theirs
    from vllm.v1.core.kv_cache_utils import init_none_hash

    from prefixkv.integrations.vllm import KVCacheManager as Ours

    init_none_hash(sha256)
    windows = tuple(("sliding", s.sliding_window) if getattr(s, "sliding_window", None) else None
                    for s in specs)
    kw = dict(max_model_len=MAX_LEN, scheduler_block_size=BS, hash_block_size=BS, log_stats=True,
              enable_kv_cache_events=True, use_eagle=True)
    def cfg() -> Any:
        c = config(*specs, num_blocks=num_blocks)
        for g in flagged:
            c.kv_cache_groups[g].is_eagle_group = True
        return c
    return [Side(Ours(cfg(), **kw), windows), Side(Theirs(cfg(), **kw), windows)]


@pytest.mark.parametrize("layout", list(LAYOUTS) + [f"{k}, flagged {v}" for k, v in FLAGGED.items()])
@settings(max_examples=30, deadline=None, derandomize=True)
@given(extra_blocks=st.integers(1, 16), ops=st.lists(OP, min_size=8, max_size=40))
def test_with_eagle_they_agree_on_hits_and_tables(layout, extra_blocks, ops):
    name, _, flagged = layout.partition(", flagged ")
    specs = LAYOUTS[name]()
    sides = eagle_managers(len(specs) * MAX_LEN // BS + extra_blocks, specs,
                           FLAGGED[name] if flagged else ())
    for serial, (op, slot, k, prompt, more) in enumerate(ops):
        if k % 4 == 0:
            for s in sides:
                s.m.new_step_starts()
        # no connector loads: on a hybrid layout, a load of a whole prompt that lands
        # (vLLM recomputes its last token) and whose next allocate_slots is refused leaves
        # prefixkv's last block uncached (growth.grow_live rewinds before it counts), where
        # vLLM's stays cached: estimate_cached_tokens 12 against 16, with or without EAGLE
        op = "admit" if op == "remote" else op
        _step(sides, op, slot, k, prompt, more, serial)

"""vLLM 0.33's lookahead hashing (``num_hash_lookahead_tokens`` = L > 0, with
multi-module MTP's ``num_prefill_lookahead`` = P) beside Mamba groups with vLLM's
fine-grained partial hits: prefixkv's plug-in (integrations/vllm/lookahead.py over
groups/lookahead.py) beside vLLM's own ``KVCacheManager`` on test_vllm_mamba_sizes.py's
random streams (``Sides``: after every call the same answer and blocks returned, the same
tables of every live request, free count, hits with their blocks and junctions for a
probe and for each live request's tokens and one more, the same copies on write; and
prefixkv's ``check_invariants()``), the
requests hashed with their L following tokens on both sides, prompts of shared stems
that part anywhere (inside a block's lookahead too), chunks cut by vLLM's own scheduler
(``_mamba_block_aligned_split`` with the same L: a chunk ends at the prompt's last
boundary ``(p - max(1, L)) // h * h``), with and without chunk-end checkpoint blocks.
Equal hits and tables mean a Mamba state or block prefixkv serves is the one vLLM serves,
which its hash proves (the prefix and the L tokens after it). Also scenario tests with
exact values (a state at a boundary is found only when the L tokens after it match) and
what stays refused, by name. Needs vllm installed."""

from __future__ import annotations

import math
import os
from dataclasses import replace
from functools import reduce
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")

from .test_vllm_block_sizes_reference import _spec  # noqa: E402
from .test_vllm_fine_full import TWO_FULL, same_block_hashes, same_hits_per_group  # noqa: E402
from .test_vllm_mamba_sizes import OP, Sides  # noqa: E402
from .test_vllm_plugin import config  # noqa: E402
from .test_vllm_sized_model import MAX_LEN, PARTIAL, PARTIAL_FULL, PROMPT  # noqa: E402
from .vllm_split import vllm_mamba_chunk  # noqa: E402

# (groups, hash block: None for their gcd); full attention larger than the hash block is
# refused (its partial tail entries differ from vLLM's under lookahead: a hit of 2 where
# vLLM's is 0 on "full4+mamba4, hash 2", L = P = 2, found by this test)
LAYOUTS = {k: (g, None) for k, g in PARTIAL.items()} | PARTIAL_FULL | TWO_FULL

PAIRS = [(1, 0), (1, 1), (2, 2), (3, 3), (2, 0)]  # (L, P): vLLM sets L = P for MTP, 1 for EAGLE


def _specs(groups: Any, align: int) -> list[Any]:
    """The groups' specs, Mamba's with one checkpoint block aligned to ``align`` (0: none)."""
    return [replace(_spec(b, w), num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=align)
            if w == "mamba" and align else _spec(b, w) for b, w in groups]


def pair(groups: Any, hash_size: int, num_blocks: int, lookahead: int, prefill: int,
         align: int = 0) -> list[Any]:
    """vLLM's manager and prefixkv's plug-in over the same layout and lookahead settings."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager as Theirs
    from vllm.v1.core.kv_cache_utils import init_none_hash

    from prefixkv.integrations.vllm import KVCacheManager as Ours

    init_none_hash(sha256)
    lcm = reduce(math.lcm, (b for b, _ in groups))
    kw = dict(max_model_len=256, scheduler_block_size=lcm, hash_block_size=hash_size,
              num_hash_lookahead_tokens=lookahead, num_prefill_lookahead=prefill)
    return [make(config(*_specs(groups, align), num_blocks=num_blocks), **kw) for make in (Theirs, Ours)]


def lookahead_request(m: Any, rid: str, tokens: list[int], hash_size: int, lookahead: int) -> Any:
    """A vLLM Request hashed with its ``lookahead`` following tokens; for prefixkv's
    plug-in built with its hasher in front (it notes the request, as vLLM's engine does)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    hasher = get_request_block_hasher(hash_size, sha256, lookahead)
    if hasattr(m, "prepared_prompts"):
        hasher = m.prepared_prompts.hasher(hasher)
    return Request(request_id=rid, prompt_token_ids=tokens, sampling_params=SamplingParams(max_tokens=64),
                   pooling_params=None, block_hasher=hasher)


def scheduler_chunk(step: int, h: int, start: int, n: int, total: int, prompt: int, lookahead: int,
                    align: int) -> int:
    """``n`` tokens from ``start`` as vLLM's scheduler cuts them (its own
    ``_mamba_block_aligned_split``) with Mamba blocks of ``step``, hash block ``h``,
    lookahead hashing of ``lookahead`` tokens, checkpoint blocks aligned to ``align`` (0:
    none), the request's junction 0; a chunk starting inside a Mamba block ends at its end."""
    return vllm_mamba_chunk(step, h, start, n, total, prompt, lookahead=lookahead, align=align)


class LookaheadSides(Sides):
    def __init__(self, groups: Any, num_blocks: int, lookahead: int, prefill: int, align: int = 0,
                 hash_size: int | None = None) -> None:
        super().__init__(groups, num_blocks, partial=True, hash_size=hash_size)
        self.lookahead, self.align = lookahead, align
        self.ms = pair(groups, self.h, num_blocks, lookahead, prefill, align)

    def make_request(self, m: Any, rid: str, tokens: list[int]) -> Any:
        return lookahead_request(m, rid, tokens, self.h, self.lookahead)

    def _chunk(self, start: int, n: int, total: int, prompt: int) -> int:
        return scheduler_chunk(self.step, self.h, start, n, total, prompt, self.lookahead, self.align)


@pytest.mark.parametrize("small", [False, True])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(("lookahead", "prefill"), PAIRS)
@settings(max_examples=15, deadline=None)
@given(ops=st.lists(OP, min_size=4, max_size=30), probe=PROMPT, checkpoints=st.booleans())
def test_the_plugin_keys_mamba_states_with_their_lookahead_as_vllm(layout, lookahead, prefill, small, ops,
                                                                   probe, checkpoints):
    # (small: a pool a little over one longest request: refusals and evictions;
    # checkpoints: one chunk-end checkpoint block per Mamba group, at the hash block; the
    # blocks' vLLM hashes compared where the plug-in reads them: test_vllm_fine_full.py)
    groups, h = LAYOUTS[layout]
    sides = LookaheadSides(groups, sum(-(-MAX_LEN // b) for b, _ in groups) + 4 if small else 400,
                           lookahead, prefill, (h or min(b for b, _ in groups)) if checkpoints else 0, h)

    def each(s: Sides) -> None:
        s.ms[1].core.check_invariants()
        if h is None or layout in TWO_FULL:  # (else every block reads None: test_vllm_fine_full.py)
            same_block_hashes(s)
        for r in s.reqs[0].values():
            same_hits_per_group(s, list(r.all_token_ids) + [0])
        same_hits_per_group(s, probe)
    sides.drive(ops, probe, each)


def _hybrid_mamba_plugin(groups: Any, hash_size: int, **kw: Any) -> Any:
    from prefixkv.integrations.vllm import KVCacheManager

    lcm = reduce(math.lcm, (b for b, _ in groups))
    return KVCacheManager(config(*_specs(groups, 0), num_blocks=400), max_model_len=256,
                          scheduler_block_size=lcm, hash_block_size=hash_size, **kw)


def test_a_state_at_the_prompts_boundary_is_found_only_with_its_lookahead_tokens():
    # full attention at 8 beside Mamba at 32 (hash 8), L = 2: a prompt of 29 tokens ends
    # its first chunk at its last boundary (29 - 2) // 8 * 8 = 24, inside Mamba block 0;
    # a reader with the same 26 tokens hits 24 (copied on write); one parting at token 24
    # or 25 (inside the lookahead) hits nothing, as vLLM's manager
    groups = PARTIAL["mamba32+full8+mamba32"]
    for m in pair(groups, 8, 400, 2, 2):
        r = lookahead_request(m, "a", list(range(29)), 8, 2)
        assert m.allocate_slots(r, 24) is not None
        r.num_computed_tokens = 24
        m.new_step_starts()
        assert m.allocate_slots(r, 5) is not None
        r.num_computed_tokens = 29
        m.new_step_starts()
        m.free(r)
        for shared, want in ((26, 24), (25, 0), (24, 0)):
            reader = lookahead_request(m, f"b{shared}", list(range(shared)) + [99] * 6, 8, 2)
            assert m.get_computed_blocks(reader)[1] == want, (type(m).__module__, shared)


def test_full_attentions_partial_entry_moves_up_as_tokens_after_the_prompt_become_known():
    # full attention at 8 beside Mamba at 16 (hash 4), L = 2: a prompt of 13 tokens has
    # (13 - 2) // 4 = 2 block hashes at first, so its last boundary before its last token
    # that full attention can key is 8, a block end: no partial entry. Once a sampled
    # token is known it has 3, and the entry at 12 = (13 - 1) // 4 * 4 goes into full
    # attention's block 1 (vLLM's min((p - 1) // h, len(block_hashes)) * h). A reader of
    # those 14 tokens: Mamba's state is at 8 (the chunk ended at (13 - 2) // 4 * 4), so
    # the hit is 8 on both managers; full attention alone finds 12 (the junction, and
    # find_longest_cache_hit_per_group), which it did not before the token was known
    groups, tokens = PARTIAL_FULL["full8+mamba16, hash 4"][0], list(range(13))
    got = []
    for m in pair(groups, 4, 400, 2, 2):
        r = lookahead_request(m, "a", tokens, 4, 2)
        seen = []
        for n in (8, 5, 1):
            if n == 1:
                r.append_output_token_ids([50])
            assert m.allocate_slots(r, n) is not None
            r.num_computed_tokens += n
            m.new_step_starts()
            reader = lookahead_request(m, f"b{n}", tokens + [50, 99, 98, 97], 4, 2)
            blocks, hit, junction = m.get_computed_blocks(reader)
            per_group = m.coordinator.find_longest_cache_hit_per_group(reader.block_hashes, 16)
            seen.append((hit, junction, per_group[1], [[b.block_id for b in g] for g in per_group[0]]))
        got.append(seen)
    # (Mamba's state at 8 moves from block 2 to its copy 4 when the request's next chunk
    # writes its block: groups/partial.py ``moved``)
    assert got[0] == got[1] == [(8, 0, (8, 8), [[1], [2]]), (8, 0, (8, 8), [[1], [4]]),
                                (8, 12, (12, 8), [[1, 3], [4]])], got


@pytest.mark.parametrize(("groups", "hash_size", "kw", "message"), [
    (PARTIAL["full8+mamba16"], 8, {"enable_kv_cache_events": True}, "KV events"),
    (PARTIAL["full8+mamba16"], 8, {"use_eagle": True}, "use_eagle"),
    (((16, None), (16, "mamba")), 16, {"enable_kv_cache_events": True}, "KV events"),  # (one size: served
    (((16, None), (16, "mamba")), 16, {"use_eagle": True}, "use_eagle|EAGLE"),  # without: _one_size.py)
    (((16, None), (16, 32), (16, "mamba")), 16, {}, "lookahead hashing"),  # (a window at one size)
    (((16, None), (16, 32)), 16, {}, "lookahead hashing"),  # (a window)
])
def test_what_lookahead_hashing_beside_mamba_refuses(groups, hash_size, kw, message):
    from prefixkv.integrations.vllm.layout import UnsupportedByPrefixKV

    with pytest.raises(UnsupportedByPrefixKV, match=message):
        _hybrid_mamba_plugin(groups, hash_size, num_hash_lookahead_tokens=1, **kw)

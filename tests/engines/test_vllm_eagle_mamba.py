"""prefixkv's vLLM plug-in beside vLLM 0.33's own ``KVCacheManager`` with EAGLE
(``use_eagle``) beside a Mamba group (``mamba_cache_mode="align"``), every group, the
scheduler and the hashes at one block size: vLLM's full attention matches one block
past the hit and drops it, its Mamba group (no EAGLE layers) takes the longest state at
or below what full attention leaves. One random stream of admissions, chunks (ending at
the Mamba blocks' ends or the prompt's, as vLLM's align-mode scheduler cuts them),
decode steps and frees on both, compared after every call (test_vllm_mamba_sizes.py's
``Sides``: the same answers, tables, free counts, and hits with their blocks and
junctions for a probe and each live request's tokens and one more), and every hit's
blocks holding, in their group, the prefix the hit says (never a wrong KV). The
``is_eagle_group`` flag on full attention, on Mamba, or on none (every group EAGLE's).
Needs vllm installed."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")

from .test_vllm_block_sizes_reference import _request, _spec  # noqa: E402
from .test_vllm_mamba_sizes import OP, Sides  # noqa: E402
from .test_vllm_plugin import config  # noqa: E402
from .test_vllm_sized_model import MAX_LEN, PARTIAL, PARTIAL_FULL, PROMPT  # noqa: E402

LAYOUTS = {  # ((block size, kind) per group, the hash block: None, their gcd), all at one size ...
    "full8+mamba8": (((8, None), (8, "mamba")), None),
    "mamba4+full4+full4": (((4, "mamba"), (4, None), (4, None)), None),
    # ... with vLLM's fine-grained partial hits (full attention at the hash block) ...
    **{f"partial hits: {k}": (v, None) for k, v in PARTIAL.items()},
    # ... and full attention larger than the hash block (its hits inside its blocks)
    **{f"partial hits in full attention: {k}": v for k, v in PARTIAL_FULL.items()},
}


def eagle_chunk(step: int, h: int, start: int, n: int, total: int, prompt: int, partial: bool) -> int:
    """``n`` tokens from ``start`` (of ``total``, a prompt of ``prompt``) as vLLM's
    ``_mamba_block_aligned_split`` cuts them with EAGLE (Mamba blocks of ``step``): a
    chunk starting inside a block ends at its end, none runs past the last block boundary
    EAGLE resumes at (one block below the tokens' last) nor, with partial hits, past the
    prompt's Mamba entry (one hash block below its last hash boundary) inside a block;
    another ends at a block's end unless it ends the request (at least one token)."""
    end, last = start + n, total // step * step - step
    tail = max(prompt // h * h - h, 0) if partial else 0
    stops = [end, *([start + step - start % step] if start % step else []),
             *([tail] if start < tail < end and tail % step else []), *([last] if start < last < end else [])]
    end = min(stops)
    if end < total and end != tail and start < end // step * step < end:
        end = end // step * step
    return end - start


class EagleSides(Sides):
    """``Sides`` whose chunks end where vLLM's scheduler ends them with EAGLE."""

    def _chunk(self, start: int, n: int, total: int, prompt: int) -> int:
        return eagle_chunk(self.step, self.h, start, n, total, prompt, self.partial)


def _config(groups: Any, num_blocks: int, flag: int | None) -> Any:
    c = config(*(_spec(b, w) for b, w in groups), num_blocks=num_blocks)
    if flag is None:
        return c
    kv = list(c.kv_cache_groups)
    kv[flag] = replace(kv[flag], is_eagle_group=True)
    return replace(c, kv_cache_groups=kv)


def sides(groups: Any, num_blocks: int, flag: int | None, events: bool = False,
          hash_size: int | None = None) -> Sides:
    """``EagleSides`` whose two managers take ``use_eagle`` (vLLM's partial hits on where
    the groups' sizes differ or the hash block, ``hash_size``, is smaller),
    ``is_eagle_group`` on group ``flag`` (None: none)."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager
    from vllm.v1.core.kv_cache_utils import init_none_hash

    from prefixkv.integrations.vllm import KVCacheManager

    s = EagleSides(groups, num_blocks, partial=len({b for b, _ in groups}) > 1 or hash_size is not None,
                   events=events, hash_size=hash_size)
    s.groups, s.written, s.copied, s.checked = groups, {}, [], 0  # (check_holds)
    init_none_hash(sha256)
    s.ms = [make(_config(groups, num_blocks, flag), max_model_len=256, scheduler_block_size=s.lcm,
                 hash_block_size=s.h, use_eagle=True, enable_kv_cache_events=events)
            for make in (VllmManager, KVCacheManager)]
    _noting_copies(s)
    return s


def check_holds(s: Sides, probe: list[int]) -> None:
    """Note what prefixkv's blocks hold now (``_write``), then check that the blocks of
    its hit for ``probe`` and for each live request's tokens hold, in their group, what
    the hit says: an attention block the prefix up to its end, a Mamba group's last
    entry the state at the hit's end (a wrong KV: anything else; an attention block the
    hit ends inside of, the prefix up to the hit's end followed by anything)."""
    _write(s)
    m = s.ms[1]
    for tokens in [probe] + [list(r.all_token_ids) + [0] for r in s.reqs[1].values()]:
        blocks, hit, _ = m.get_computed_blocks(_request("holds", tokens, s.h))
        for g, ids in enumerate(blocks.get_block_ids()):
            b = s.groups[g][0]
            if s.groups[g][1] == "mamba":
                assert not ids or s.written.get(ids[-1]) == tuple(tokens[:hit]), (g, ids, hit)
                continue
            for j, i in enumerate(ids):
                want = tuple(tokens[:min((j + 1) * b, hit)])
                assert (s.written.get(i) or ())[:len(want)] == want, (g, j, i, hit)
        s.checked += hit > 0


def _write(s: Sides) -> None:
    """What prefixkv's blocks hold after the step (by block id): first the copies the
    step queued (their source's content before it), then each live request's tokens up
    to the end of each block it computed in an attention group (or its computed
    tokens, inside one), and in a Mamba group the state at its computed tokens in the
    block its step ended in."""
    m = s.ms[1]
    for src, dst in s.copied:
        s.written[dst] = s.written.get(src)
    s.copied.clear()
    if hasattr(s, "write_checkpoint"):  # (test_vllm_eagle_mamba_checkpoints.py)
        s.write_checkpoint()
    for r in s.reqs[1].values():
        n, tokens = r.num_computed_tokens, tuple(r.all_token_ids)
        for g, ids in enumerate(m.get_block_ids(r.request_id)):
            b = s.groups[g][0]
            if s.groups[g][1] == "mamba":
                j = -(-n // b) - 1
                if 0 <= j < len(ids) and ids[j]:
                    s.written[ids[j]] = tokens[:n]
                continue
            for j, i in enumerate(ids[:-(-n // b)]):
                s.written[i] = tokens[:min((j + 1) * b, n)]


def _noting_copies(s: Sides) -> None:
    """prefixkv's ``take_kv_cache_block_copies`` notes each copy (source, copy) for ``_write``."""
    m = s.ms[1]
    take = m.take_kv_cache_block_copies

    def noted() -> Any:
        copies, held = take()
        s.copied.extend((c.src_block_id, c.dst_block_id) for c in copies)
        return copies, held
    m.take_kv_cache_block_copies = noted


@pytest.mark.parametrize("flag", [None, 0, 1])
@pytest.mark.parametrize("small", [False, True])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@settings(max_examples=30, deadline=None)
@given(ops=st.lists(OP, min_size=4, max_size=30), probe=PROMPT)
def test_the_plugin_gives_vllms_eagle_hits_beside_mamba(layout, small, flag, ops, probe):
    groups, h = LAYOUTS[layout]
    if flag is not None and flag >= len(groups):
        return
    s = sides(groups, sum(-(-MAX_LEN // b) for b, _ in groups) + 3 if small else 400, flag, hash_size=h)
    s.drive(ops, probe, lambda s: check_holds(s, probe))



@pytest.mark.parametrize("layout", [k for k in LAYOUTS if k.startswith("partial hits")])
@settings(max_examples=25, deadline=None)
@given(ops=st.lists(OP, min_size=4, max_size=30), probe=PROMPT)
def test_the_plugin_announces_vllms_events_with_eagle_beside_mamba(layout, ops, probe):
    # (vLLM's KV events on: after every step the same entries stored and removed, the
    # Mamba partial entries at EAGLE's replay boundary included; up to the first spare)
    groups, h = LAYOUTS[layout]
    s = sides(groups, sum(-(-MAX_LEN // b) for b, _ in groups) + 3, None, events=True, hash_size=h)
    s.drive(ops, probe, then=lambda s: s.same_events(groups))


def _one_size(use_eagle: bool = True, **kw: Any) -> tuple[Any, ...]:
    """vLLM's manager and prefixkv's plug-in over full attention and Mamba at 16."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager
    from vllm.v1.core.kv_cache_utils import init_none_hash

    from prefixkv.integrations.vllm import KVCacheManager

    init_none_hash(sha256)
    return tuple(make(_config(((16, None), (16, "mamba")), 20, None), max_model_len=8192,
                      scheduler_block_size=16, hash_block_size=16, use_eagle=use_eagle, **kw)
                 for make in (VllmManager, KVCacheManager))


def _computed(m: Any, tokens: list[int], chunks: tuple[int, ...]) -> None:
    """``tokens`` computed in steps of ``chunks`` tokens, then freed (cached)."""
    a = _request("a", tokens, 16)
    for n in chunks:
        m.new_step_starts()
        assert m.allocate_slots(a, n) is not None
        a.num_computed_tokens += n
    m.free(a)
    m.new_step_starts()


def _hits(m: Any, lengths: tuple[int, ...]) -> list[tuple[int, list[list[int]], int]]:
    out = []
    for n in lengths:
        blocks, hit, junction = m.get_computed_blocks(_request("b", list(range(n)), 16))
        out.append((hit, [list(g) for g in blocks.get_block_ids()], junction))
    return out


def test_eagle_drops_full_attentions_last_block_and_mamba_takes_the_state_below():
    # 48 tokens computed in steps of 16: full attention caches blocks 1, 3, 5, Mamba its
    # states at 16, 32, 48 in blocks 2, 4, 6. With EAGLE a prompt of 49 (or 48) tokens
    # matches 3 blocks, drops one: 32, where Mamba holds a state (block 4); one of 40
    # (cap 39: 2 blocks, less one) hits 16, Mamba's block 2. Both managers alike.
    for m in _one_size():
        _computed(m, list(range(48)), (16, 16, 16))
        assert _hits(m, (49, 48, 40, 32)) == [
            (32, [[1, 3], [0, 4]], 0), (32, [[1, 3], [0, 4]], 0),
            (16, [[1], [2]], 0), (16, [[1], [2]], 0)]


def test_eagle_past_the_last_mamba_state_hits_nothing_and_reports_vllms_junction():
    # 48 tokens in one step: Mamba holds its state at 48 only. With EAGLE full attention
    # leaves 32 (16 for a prompt of 40), where Mamba holds none: no hit, the junction
    # there (vLLM's scheduler ends the request's chunk at it). Without EAGLE a prompt of
    # 49 hits 48 (Mamba's state). Both managers alike.
    for m in _one_size():
        _computed(m, list(range(48)), (48,))
        assert _hits(m, (49, 48, 40, 64)) == [
            (0, [[], []], 32), (0, [[], []], 32), (0, [[], []], 16), (0, [[], []], 32)]
    for m in _one_size(use_eagle=False):
        _computed(m, list(range(48)), (48,))
        assert _hits(m, (49, 40)) == [(48, [[1, 2, 3], [0, 0, 4]], 0), (0, [[], []], 32)]


def test_eagle_beside_mamba_flagged_on_mamba_only_drops_nothing():
    # is_eagle_group on the Mamba group only: vLLM's EAGLE groups are Mamba's, whose
    # lookup drops nothing: the hit is the plain one
    from prefixkv.integrations.vllm import KVCacheManager

    m = KVCacheManager(_config(((16, None), (16, "mamba")), 20, 1), max_model_len=8192,
                       scheduler_block_size=16, hash_block_size=16, use_eagle=True)
    assert m.eagle_groups == (False, False)
    _computed(m, list(range(48)), (48,))
    assert _hits(m, (49,)) == [(48, [[1, 2, 3], [0, 0, 4]], 0)]


def test_eagle_hit_inside_a_whole_full_attention_block_is_copied_on_write():
    # Full attention and Mamba at 4, hash block 2: 16 tokens computed in steps ending at
    # 4, 8, 12, 14 (Mamba's entry: one hash block below the prompt's last boundary, 16)
    # and 16; the entry moved to its copy (8 -> 9) at the last step. With EAGLE a prompt
    # of 17 (or 16) matches full attention's 4 whole blocks, drops one hash block: 14,
    # inside block 7 (whole), where Mamba holds the entry (block 9); one of 15 (cap 14)
    # matches 3 blocks, no entry inside the next, drops one: 10, Mamba's state at 8, the
    # junction 10. Admitting the 17 copies block 7 into 10 and Mamba's 9 into 12. Both
    # managers alike.
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager
    from vllm.v1.core.kv_cache_utils import init_none_hash

    from prefixkv.integrations.vllm import KVCacheManager

    init_none_hash(sha256)
    for make in (VllmManager, KVCacheManager):
        m = make(_config(((4, None), (4, "mamba")), 30, None), max_model_len=8192,
                 scheduler_block_size=4, hash_block_size=2, use_eagle=True)
        a = _request("a", list(range(16)), 2)
        for n in (4, 4, 4, 2, 2):
            m.new_step_starts()
            assert m.allocate_slots(a, n) is not None
            a.num_computed_tokens += n
        assert [(c.src_block_id, c.dst_block_id) for c in m.take_kv_cache_block_copies()[0]] == [(8, 9)]
        m.free(a)
        m.new_step_starts()
        got = []
        for tokens in (list(range(16)) + [99], list(range(16)), list(range(15))):
            blocks, hit, junction = m.get_computed_blocks(_request("b", tokens, 2))
            got.append((hit, [list(g) for g in blocks.get_block_ids()], junction))
        assert got == [(14, [[1, 3, 5, 7], [0, 0, 0, 9]], 0), (14, [[1, 3, 5, 7], [0, 0, 0, 9]], 0),
                       (8, [[1, 3], [0, 4]], 10)]
        c = _request("c", list(range(16)) + [99], 2)
        blocks, hit, _ = m.get_computed_blocks(c)
        assert m.allocate_slots(c, 17 - hit, hit, blocks) is not None
        assert [list(g) for g in m.get_block_ids("c")] == [[1, 3, 5, 10, 11], [0, 0, 0, 12, 13]]
        assert [(c.src_block_id, c.dst_block_id) for c in m.take_kv_cache_block_copies()[0]] == \
            [(7, 10), (9, 12)]


@pytest.mark.parametrize(("groups", "sizes", "named"), [
    (((32, None), (16, "mamba")), (32, 16), "one block size"),  # (no partial hits)
    (((16, None), (16, 32), (16, "mamba")), (16, 16), "one other group spec"),
])
def test_eagle_beside_mamba_on_other_layouts_is_refused_by_name(groups, sizes, named):
    from prefixkv.integrations.vllm import KVCacheManager, UnsupportedByPrefixKV

    with pytest.raises(UnsupportedByPrefixKV, match=named):
        KVCacheManager(_config(groups, 20, None), max_model_len=8192, scheduler_block_size=sizes[0],
                       hash_block_size=sizes[1], use_eagle=True)

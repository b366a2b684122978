"""vLLM's ``prefix_cache_retention_interval`` (integrations/vllm/retention.py): the
plug-in takes and refuses it where vLLM's own manager does, built side by side on the
same ``KVCacheConfig``, and refuses by name the intervals it does not apply. Needs vllm
installed."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from prefixkv import ConfigError

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")

from sized_model import SizedModel  # noqa: E402
from twin_model import Written, rules_agree  # noqa: E402

from .test_vllm_block_sizes_reference import _request  # noqa: E402


def _full(bs: int) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32)


def _window(bs: int, tokens: int = 32) -> Any:
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return SlidingWindowSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32,
                             sliding_window=tokens)


def _mamba(bs: int) -> Any:
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(block_size=bs, shapes=((1, 1),), dtypes=(torch.float32,), mamba_cache_mode="align")


LAYOUTS = {
    "full": (_full(16),),
    "window": (_window(16),),
    "full+window": (_full(16), _window(16)),
    "full32+window8": (_full(32), _window(8)),  # (vLLM's test: scheduler 32, hashes 8)
    "full+mamba": (_full(16), _mamba(16)),
}
INTERVALS = (None, 0, 16, 32, 33, 64, -16, -32)


def _build(which: str, specs: tuple[Any, ...], interval: int | None) -> Any:
    from vllm.v1.core.kv_cache_manager import KVCacheManager as Vllms
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    from prefixkv.integrations.vllm import KVCacheManager as Ours

    cfg = KVCacheConfig(num_blocks=40, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)],
                        prefix_cache_retention_interval=interval)
    sizes = [s.block_size for s in specs]
    cls = Ours if which == "prefixkv" else Vllms
    return cls(cfg, max_model_len=8192, enable_caching=True, hash_block_size=math.gcd(*sizes),
               scheduler_block_size=math.lcm(*sizes))


def _outcome(which: str, specs: tuple[Any, ...], interval: int | None) -> Any:
    try:
        return _build(which, specs, interval)
    except ValueError as e:
        return e


@pytest.mark.parametrize("interval", INTERVALS)
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_the_interval_is_taken_and_refused_where_vllms_manager_does(name, interval):
    """vLLM's refusal (a ValueError naming what is wrong) is prefixkv's ConfigError with
    vLLM's words; an interval vLLM takes, prefixkv takes (the coordinator's
    ``retention_interval`` vLLM's) or, when positive beside a window or Mamba group
    where prefixkv does not apply it, refuses by name (UnsupportedByPrefixKV: it caches
    those groups densely there).
    Before retention.py, prefixkv took every interval and its coordinator had no
    ``retention_interval``."""
    from prefixkv.integrations.vllm import UnsupportedByPrefixKV

    specs = LAYOUTS[name]
    vllms, ours = _outcome("vllm", specs, interval), _outcome("prefixkv", specs, interval)
    if isinstance(vllms, ValueError):
        assert type(ours) is ConfigError, (vllms, ours)
        words = ("no sliding-window or Mamba" if "no sliding-window or Mamba" in str(vllms)
                 else "must be non-negative and a multiple of scheduler_block_size")
        assert words in str(vllms) and words in str(ours), (vllms, ours)
        return
    # (groups of different sizes, full attention among them, windows only; at one size a
    # positive interval: 0 stays dense there, retention.py)
    applied = name == "full32+window8" or (name in ("window", "full+window") and bool(interval))
    if name != "full" and interval and not applied:  # (vLLM's sparse retention, not applied)
        assert isinstance(ours, UnsupportedByPrefixKV), ours
        assert f"prefix_cache_retention_interval={interval}" in str(ours)
        return
    assert not isinstance(ours, Exception), ours
    assert ours.coordinator.retention_interval == vllms.coordinator.retention_interval == interval
    windows = [g.retention for g in ours.core.groups if g.kind == "sliding_window"] if name != "full" else []
    assert windows == ([interval] * len(windows) if applied else [None] * len(windows))


@pytest.mark.parametrize("bad", [16.0, "16", True])
def test_an_interval_not_an_int_is_a_config_error(bad):
    """A float, a string or a bool is refused with ConfigError (vLLM's own check would
    take ``True`` as 1 and fail on a string with a TypeError)."""
    with pytest.raises(ConfigError, match="must be an int or None"):
        _build("prefixkv", LAYOUTS["full+window"], bad)


def test_a_refusal_changes_nothing_of_the_config():
    """The check reads the config and builds nothing from it (before any state)."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    from prefixkv.integrations.vllm import KVCacheManager

    cfg = KVCacheConfig(num_blocks=40, kv_cache_tensors=[], prefix_cache_retention_interval=16,
                        kv_cache_groups=[KVCacheGroupSpec(["l"], _full(16))])
    before = dataclasses.replace(cfg)
    with pytest.raises(ConfigError, match="no sliding-window or Mamba"):
        KVCacheManager(cfg, max_model_len=8192, scheduler_block_size=16, hash_block_size=16)
    assert cfg == before


STEMS = [[100 * s + k for k in range(200)] for s in range(3)]


# (groups: (block size, window or None)) and the interval: vLLM's retention tests' layout
# of two sizes, and at one size full attention beside a window, and a window alone
STREAMS = [("full32+window8", ((32, None), (8, 8)), 0), ("full32+window8", ((32, None), (8, 8)), 64),
           ("full16+window16@16", ((16, None), (16, 16)), 32), ("window16@16", ((16, 16),), 64)]


@pytest.mark.parametrize(("name", "groups", "interval"), STREAMS, ids=[f"{n}-{i}" for n, _, i in STREAMS])
@settings(max_examples=25, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 200), st.integers(0, 3),
                              st.none() | st.integers(8, 96), st.booleans()), min_size=3, max_size=14))
@example(ops=[(0, 1, 0, None, False), (0, 1, 0, None, True), (0, 158, 3, None, True),  # (r4's block
               (1, 64, 0, None, True), (0, 32, 1, None, True), (1, 190, 3, None, True),  # 0 a twin of
               (0, 1, 0, None, False), (0, 14, 3, None, False), (0, 96, 1, None, False)])  # r2's)
def test_the_plugin_retains_as_vllms_manager(name, groups, interval, ops):
    """Full attention at 32 beside a window of 8 at 8 (vLLM's retention tests' layout;
    and layouts of one block size, where the plug-in applies a positive interval):
    prompts of shared stems admitted as vLLM's scheduler admits them (the junction
    ``get_computed_blocks`` reports kept on the request), prefilled in chunks, some
    freed. Each manager is held, after every call, to the reference of its free rule
    (tests/sized_model.py; tests/twin_model.py): the same hit, junction, tables (block
    ids, null entries) and free queue; vLLM's to ``twins=False``, the plug-in's to
    ``twins=True``. Until a freed request releases a twin (a block caching content
    another block caches too: a hit cut short by the window recomputes full-attention
    blocks cached already) the two managers agree exactly too. vLLM keeps the twin
    cached at the queue's tail; prefixkv empties it (the free-duplicate difference,
    groups.md), so from then on the two evict different blocks and may report different
    hits and junctions (the explicit example: 96 on prefixkv, 0 on vLLM, for the last
    prompt). Past it they must still give the same hit where the two rules cache the
    same keys of the prompt's prefixes, and every block a hit names on either holds the
    prompt's KV. Before the retention was applied prefixkv took 0 and cached every
    window block (longer hits, no junction) and refused 64 (at one size: until
    retention-r27)."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.request import RequestStatus

    init_none_hash(sha256)
    specs = tuple(_full(b) if w is None else _window(b, w) for b, w in groups)
    sides = [_build("vllm", specs, interval), _build("prefixkv", specs, interval)]
    sizes = [b for b, _ in groups]
    h, lcm = math.gcd(*sizes), math.lcm(*sizes)
    models = [SizedModel(groups, 40, h, lcm, twins=twins, retention=interval) for twins in (False, True)]
    kv = [Written(sizes, 0), Written(sizes, 0)]
    none = [[] for _ in groups]
    live: list[tuple[str, list[Any], list[bool]]] = []
    for n, (stem, length, tail, chunk, free) in enumerate(ops):
        tokens = STEMS[stem][:length] + [7] * tail or [7]
        reqs = [_request(f"r{n}", tokens, h) for _ in sides]
        found = [side.get_computed_blocks(r) for side, r in zip(sides, reqs, strict=True)]
        if not models[1].emptied or rules_agree(*models, tokens):
            assert found[0][1] == found[1][1], (tokens, found[0][1:], found[1][1:])
        admitted = []
        for side, r, (blocks, hit, junction), model, written in zip(sides, reqs, found, models, kv,
                                                                    strict=True):
            assert hit == model.hit(tokens, None)[0], (tokens, hit)
            written.check_hit(blocks.get_block_ids() if hit else none, tokens)
            num_new = len(tokens) - hit if chunk is None else min(chunk, len(tokens) - hit)
            if model.add(r.request_id, tokens, None, num_new) is None:
                # (vLLM releases a window's blocks before it refuses; prefixkv does not)
                assert side is sides[0] or side.allocate_slots(r, num_new, hit, blocks) is None
                admitted.append(False)
                continue
            assert junction == model.reqs[r.request_id].junction, (tokens, junction)
            r.shared_prefix_boundary = junction
            assert side.allocate_slots(r, num_new, hit, blocks) is not None
            r.status, r.num_computed_tokens = RequestStatus.RUNNING, hit + num_new
            rid = r.request_id
            table = [[0 if x.is_null else x.block_id for x in g] for g in side.get_blocks(rid).blocks]
            assert table == model.reqs[r.request_id].tables
            written.wrote(model.reqs[r.request_id].tables, tokens, hit + num_new)
            admitted.append(True)
        if not models[1].emptied:
            assert admitted[0] == admitted[1]
        if not any(admitted):
            continue
        live.append((f"r{n}", reqs, admitted))
        while live and (free or len(live) > 2):
            rid, gone, held = live.pop(0)
            for side, r, model, was in zip(sides, gone, models, held, strict=True):
                if was:
                    side.free(r)
                    model.free_request(rid)
            free = False
            queues = [[b.block_id for b in side.block_pool.free_block_queue.get_all_free_blocks()]
                      for side in sides]
            assert queues == [list(model.free) for model in models]
            if not models[1].emptied:
                assert queues[0] == queues[1]


def test_a_pure_window_through_the_plugin_caches_vllms_sparse_tails():
    """vLLM's test_pure_swa_retention_interval_caches_sparse_tails (a window of 16 at
    16 alone, interval 64, a prompt of 16 blocks) on the plug-in: the segments' tails
    and the replay boundary's, {3, 7, 11, 14, 15}, cached as on vLLM's manager, and a
    replay hits 240 on both (the row itself also asks for vLLM's coordinator class)."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)
    tokens = [i for i in range(16) for _ in range(16)]
    for which in ("vllm", "prefixkv"):
        m = _build(which, (_window(16, 16),), 64)
        r = _request("0", tokens, 16)
        blocks, hit, _ = m.get_computed_blocks(r)
        got = m.allocate_slots(r, len(tokens), hit, blocks)
        assert got is not None, which
        if which == "vllm":
            pool = m.block_pool
            cached = {i for i in range(16) if pool.get_cached_block(r.block_hashes[i], [0]) is not None}
        else:  # (vLLM's hashes of a Request built here are not the plug-in's to look up: its core's)
            cached = {i for i in range(16) if m.core.cached_block_ids(tokens, 16 * (i + 1))[0] is not None}
        assert cached == {3, 7, 11, 14, 15}, which
        assert m.get_computed_blocks(_request("1", tokens, 16))[1] == 240, which

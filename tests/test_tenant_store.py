"""Tenants in the host tier and the shared store (L3): a request reads only keys of its
own namespace and accepts only values whose head carries its own extra keys, so no fetch
lands another tenant's KV, whatever the keys (salts built to collide once encoded), the
way the value got there (a key mix-up) or the re-admission after a ``StoreWait``; and
values of another model, dtype or layout are misses. The store is a dict in this process
and fetches run on the caller's thread (``_Inline``): every outcome is deterministic."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import pytest

from prefixkv import Admission, ExtraKeys, KVCacheManager, MultiModalInput, StorePut, StoreWait
from prefixkv.store import FetchCost, SharedStore, StoreLayout, encode_value

BS = 4
PROMPT = list(range(1, 14))  # three full blocks a hit may reach
LAYOUT = StoreLayout("tenant-test-model", "float32", 8)


class DictStore:
    """A StoreBackend over a dict, recording the keys each call asked for."""

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}
        self.asked: list[bytes] = []
        self.lock = threading.Lock()

    def held(self, keys: Sequence[bytes]) -> int:
        with self.lock:
            self.asked += keys
            n = 0
            while n < len(keys) and keys[n] in self.data:
                n += 1
            return n

    def read_into(self, keys: Sequence[bytes], buffers: Sequence[Sequence[memoryview]],
                  deadline: float) -> list[Any]:
        out: list[Any] = []
        with self.lock:
            self.asked += keys
            for key, views in zip(keys, buffers, strict=True):
                value = self.data.get(key)
                if value is None:
                    out.append(None)
                    continue
                if len(value) != sum(v.nbytes for v in views):
                    out.append(len(value))
                    continue
                at = 0
                for v in views:
                    v[:] = value[at:at + v.nbytes]
                    at += v.nbytes
                out.append(True)
        return out

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        with self.lock:
            self.data.update(items)
        return 0


class _Inline:
    """An executor that runs each job at once, on the caller's thread."""

    def submit(self, fn: Any, *args: Any) -> None:
        fn(*args)


def _shared(backend: DictStore, layout: StoreLayout = LAYOUT) -> SharedStore:
    return SharedStore(backend, layout, cost=FetchCost(1.0), executor=_Inline())


def _manager(shared: SharedStore, **kw: Any) -> KVCacheManager:
    kw.setdefault("hash_mode", "sha256")
    return KVCacheManager(8, BS, host_blocks=4, store=shared, **kw)


def _computed(m: KVCacheManager, backend: DictStore, rid: str, prompt: list[int],
              extra: ExtraKeys | None) -> list[StorePut]:
    """Admit ``rid`` and run two steps (compute, then write): the store holds its full
    blocks, each value's KV naming the tenant that computed it."""
    _admit(m, rid, prompt, extra)
    m.take_kv_ops()
    puts = [op for op in m.take_kv_ops() if isinstance(op, StorePut)]
    tag = repr(extra).encode()[:8].ljust(8, b".")
    backend.put([(op.key, encode_value(op.head, tag)) for op in puts])
    return puts


def _admit(m: KVCacheManager, rid: str, prompt: list[int], extra: ExtraKeys | None) -> Admission:
    """The engine's loop for one request: admit it, after its store fetch if one starts."""
    adm = m.add_request(rid, prompt, extra=extra)
    if isinstance(adm, StoreWait):
        assert rid in m.poll_store()  # (the fetch ran inline: it has ended)
        adm = m.add_request(rid, prompt, extra=extra)
    assert isinstance(adm, Admission)
    return adm


def _from_store(m: KVCacheManager, prompt: list[int], extra: ExtraKeys | None) -> int:
    """Tokens an admission on ``m`` finds (device, host slots and store), freed again."""
    adm = _admit(m, "probe", prompt, extra)
    m.free("probe")
    return adm.num_cached_tokens


KEYS: dict[str, ExtraKeys | None] = {
    "none": None,
    "a": ExtraKeys(cache_salt="a"),
    "a NUL": ExtraKeys(cache_salt="a\x00"),
    "a spelling a tag": ExtraKeys(cache_salt="a" + "L\x00\x00\x00\x00"),
    "LoRA a": ExtraKeys(lora="a"),
    "NFC": ExtraKeys(cache_salt="caf\u00e9"),
    "NFD": ExtraKeys(cache_salt="cafe\u0301"),
    "salted image": ExtraKeys(cache_salt="a", mm=(MultiModalInput("img", 1, 2),)),
}


@pytest.mark.parametrize("writer", list(KEYS))
def test_a_replica_fetches_only_its_own_tenants_blocks(writer):
    backend = DictStore()
    puts = _computed(_manager(_shared(backend)), backend, "w", PROMPT, KEYS[writer])
    assert len(puts) == 3
    for reader, extra in KEYS.items():
        backend.asked.clear()
        found = _from_store(_manager(_shared(backend)), PROMPT, extra)
        assert found == (12 if reader == writer else 0), (writer, reader, found)
        if reader != writer and KEYS[reader] is not None and KEYS[writer] is not None \
                and KEYS[reader].cache_salt != KEYS[writer].cache_salt:  # type: ignore[union-attr]
            # another salt: another namespace, none of the writer's keys is asked for
            assert not set(backend.asked) & {p.key for p in puts}, (writer, reader)


def test_a_value_copied_under_another_tenants_key_is_rejected():
    """The operator (or a bug) copies tenant a's values to the keys tenant b reads: the
    content check (the head carries a's salt) refuses them, counted as rejected."""
    backend = DictStore()
    a, b = ExtraKeys(cache_salt="a"), ExtraKeys(cache_salt="b")
    puts_a = _computed(_manager(_shared(backend)), backend, "a", PROMPT, a)
    puts_b = _computed(_manager(_shared(backend)), backend, "b", PROMPT, b)
    for pa, pb in zip(puts_a, puts_b, strict=True):
        backend.data[pb.key] = backend.data[pa.key]  # b's keys now hold a's values
    m = _manager(_shared(backend))
    assert _from_store(m, PROMPT, b) == 0
    assert m.stats.store_rejected == 1  # the first block's value fails: the run ends there
    assert _from_store(m, PROMPT, a) == 12


def test_a_readmission_after_a_store_wait_under_another_salt_gets_nothing_fetched():
    """Tenant a's admission starts a fetch; the engine re-admits the request id with
    tenant b's keys (a bug, or a rewritten salt): the landed run is a's content, in the
    host tier, and is not b's hit."""
    backend = DictStore()
    a, b = ExtraKeys(cache_salt="a"), ExtraKeys(cache_salt="b")
    _computed(_manager(_shared(backend)), backend, "w", PROMPT, a)
    m = _manager(_shared(backend))
    assert isinstance(m.add_request("r", PROMPT, extra=a), StoreWait)
    assert m.poll_store() == ["r"]
    adm = m.add_request("r", PROMPT, extra=b)
    assert adm is not None and not isinstance(adm, StoreWait) and adm.num_cached_tokens == 0
    m.check_invariants()
    m.free("r")
    assert _from_store(m, PROMPT, a) == 12  # a's landed run is still a's


def test_salts_that_differ_only_after_encoding_name_different_namespaces():
    shared = _shared(DictStore())
    salts = [None, "a", "a\x00", "a\x00\x00", "caf\u00e9", "cafe\u0301", "-", "S", "Sa", "\ud7ff"]
    prefixes = [shared.key_prefix(BS, "sha256", cache_salt=s) for s in salts]
    assert len(set(prefixes)) == len(salts)


def test_layouts_that_differ_only_by_where_a_nul_falls_cannot_be_made():
    # ("m\0f16", "x") and ("m", "f16\0x") digested alike (NUL is the digest's separator):
    # one's values passed the other's content check. A NUL in a name is refused instead.
    from prefixkv import ConfigError
    for model, dtype in (("m\x00f16", "x"), ("m", "f16\x00x"), ("m\ud800", "x")):
        with pytest.raises(ConfigError, match="NUL"):
            StoreLayout(model, dtype, 8)


@pytest.mark.parametrize("other", [StoreLayout(LAYOUT.model, "bfloat16", 8),
                                   StoreLayout(LAYOUT.model + "-v2", LAYOUT.dtype, 8),
                                   StoreLayout(LAYOUT.model, LAYOUT.dtype, 16)])
def test_values_of_another_model_dtype_or_layout_are_misses(other):
    backend = DictStore()
    _computed(_manager(_shared(backend)), backend, "w", PROMPT, None)
    assert _from_store(_manager(_shared(backend, other)), PROMPT, None) == 0
    assert _from_store(_manager(_shared(backend)), PROMPT, None) == 12

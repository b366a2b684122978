"""The engine's side of the store ops on torch caches, and the two-process example."""

import pathlib
import runpy
import sys

import pytest

torch = pytest.importorskip("torch", reason="the engine side of the store needs torch")

from prefixkv import BlockLoads, ConfigError, StoreFetched, StorePut  # noqa: E402
from prefixkv.store.torch_io import (  # noqa: E402
    block_payload,
    kv_block_bytes,
    run_store_ops,
    write_payload,
)

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "examples" / "shared_store.py"
L, N, BS, H, D = 2, 5, 4, 2, 8


class Collect:
    """A writer that keeps what it is given (the real one is tested in test_shared_store)."""

    def __init__(self):
        self.items = []

    def put(self, op, payload):
        self.items.append((op, payload))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_payload_goes_from_a_device_block_to_a_host_slot_bit_exact(dtype):
    k = torch.randn(L, N, BS, H, D).to(dtype)
    v = torch.randn(L, N, BS, H, D).to(dtype)
    assert kv_block_bytes(k, v) == 2 * L * BS * H * D * k.element_size()
    payload = block_payload(k, v, 3)
    assert len(payload) == kv_block_bytes(k, v)
    k_host = torch.zeros(3, L, BS, H, D, dtype=dtype)
    v_host = torch.zeros_like(k_host)
    write_payload(k_host, v_host, 1, payload)
    assert torch.equal(k_host[1], k[:, 3]) and torch.equal(v_host[1], v[:, 3])
    assert not k_host[0].any() and not k_host[2].any()
    with pytest.raises(ConfigError):
        write_payload(k_host, v_host, 0, payload[:-2])


@pytest.mark.parametrize("layout", ["slot-major", "strided"])
def test_write_payload_writes_only_its_slot_from_a_view_in_place_or_not(layout):
    """Contiguous CPU slots are written from the payload in place (no copy of it); a
    slot that is not contiguous (a host cache ``[L, slots, ...]``) through a copy."""
    k = torch.randn(L, N, BS, H, D).to(torch.bfloat16)
    v = torch.randn(L, N, BS, H, D).to(torch.bfloat16)
    payload = memoryview(bytearray(block_payload(k, v, 2))).cast("B")
    if layout == "slot-major":
        k_host = torch.zeros(3, L, BS, H, D, dtype=k.dtype)
        v_host = torch.zeros_like(k_host)
    else:
        k_host = torch.zeros(L, 3, BS, H, D, dtype=k.dtype).transpose(0, 1)
        v_host = torch.zeros(L, 3, BS, H, D, dtype=k.dtype).transpose(0, 1)
        assert not k_host[1].is_contiguous()
    write_payload(k_host, v_host, 1, payload)
    assert torch.equal(k_host[1], k[:, 2]) and torch.equal(v_host[1], v[:, 2])
    assert not k_host[0].any() and not v_host[2].any()


def test_run_store_ops_runs_puts_and_fetches_and_returns_the_rest():
    k = torch.randn(L, N, BS, H, D)
    v = torch.randn(L, N, BS, H, D)
    k_host = torch.zeros(2, L, BS, H, D)
    v_host = torch.zeros_like(k_host)
    fetched = block_payload(k, v, 4)
    writer = Collect()
    put = StorePut(2, b"key", b"head")
    rest = run_store_ops([put, StoreFetched(0, fetched), BlockLoads((0,), (1,))],
                         k, v, k_host, v_host, writer)
    assert rest == [BlockLoads((0,), (1,))]
    assert writer.items == [(put, block_payload(k, v, 2))]
    assert torch.equal(k_host[0], k[:, 4]) and torch.equal(v_host[0], v[:, 4])


def test_a_bad_fetched_op_is_refused_before_any_put_goes_out():
    """A fetched payload of another length than a slot's, or for a slot the host caches
    lack, raises ConfigError before the plan's first op: no put reaches the writer, no slot
    is written. Before: the puts ahead of it in the plan had gone to the writer (a
    payload's length), or the error was an IndexError after them (a slot)."""
    k = torch.randn(L, N, BS, H, D)
    v = torch.randn(L, N, BS, H, D)
    fetched = block_payload(k, v, 4)
    for op, named in ((StoreFetched(1, fetched[:-4]), "payload of"),
                      (StoreFetched(2, fetched), "host slot 2"),
                      (StoreFetched(-1, fetched), "host slot -1")):
        k_host = torch.zeros(2, L, BS, H, D)
        v_host = torch.zeros_like(k_host)
        writer = Collect()
        with pytest.raises(ConfigError, match=named):
            run_store_ops([StorePut(2, b"key", b"head"), StoreFetched(0, fetched), op],
                          k, v, k_host, v_host, writer)
        assert writer.items == [] and not k_host.any() and not v_host.any()


def test_two_processes_share_a_document_through_the_store(capsys, monkeypatch, warm_python):
    """Process B loads the document process A computed, computes only its question, and
    generates the tokens of a run without any cache (three Python processes). The example
    starts them as ``sys.executable``: here the warm interpreter (tests/warm_python.py), so
    each is a fork that has imported torch; still three processes, the store between them."""
    monkeypatch.setattr(sys, "executable", warm_python)
    main = runpy.run_path(str(SCRIPT))["main"]
    assert main(["--doc-len", "100", "--max-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert "process       B: cached   96 tokens (from the store   96), computed    9" in out
    assert "equal the no-cache run's: yes" in out


def test_caches_that_do_not_match_are_refused_before_any_op():
    """Host slots of another dtype or block size than the device blocks, or a
    ``block_dim`` that is not a dimension, raise ConfigError before the first op. Before:
    the plan's puts went to the writer, then the fetch raised (a ConfigError from
    ``write_payload``); a bad ``block_dim`` was an IndexError."""
    k = torch.randn(L, N, BS, H, D)
    v = torch.randn(L, N, BS, H, D)
    fetched = block_payload(k, v, 4)
    for k_host, block_dim, named in (
            (torch.zeros(2, L, BS, H, D, dtype=torch.float16), 1, "host slots of 512 bytes"),
            (torch.zeros(2, L, 2 * BS, H, D), 1, "host slots of 2048 bytes"),
            (torch.zeros(2, L, BS, H, D), 5, r"block_dim must be a dimension .* \[0, 5\)")):
        writer = Collect()
        with pytest.raises(ConfigError, match=named):
            run_store_ops([StorePut(2, b"key", b"head"), StoreFetched(0, fetched)],
                          k, v, k_host, torch.zeros_like(k_host), writer, block_dim)
        assert writer.items == [] and not k_host.any()
    with pytest.raises(ConfigError, match="block_dim"):
        kv_block_bytes(k, v, -1)


def test_caches_without_blocks_or_slots_are_refused():
    """A device cache with no blocks along ``block_dim`` or host caches with no slots
    hold no block's bytes: ConfigError, not the ZeroDivisionError of ``kv_block_bytes``
    (numel / blocks) and ``host_slot_views`` (bytes / slots); a 0-d tensor was an
    IndexError (review-r21)."""
    from prefixkv.store.torch_io import host_slot_views

    empty = torch.zeros(L, 0, BS, H, D)
    with pytest.raises(ConfigError, match="block"):
        kv_block_bytes(empty, empty)
    none = torch.zeros(0, L, BS, H, D)
    with pytest.raises(ConfigError, match="slot"):
        host_slot_views(none, none)
    with pytest.raises(ConfigError, match="slot"):  # (a 0-d tensor: IndexError on shape[0])
        host_slot_views(torch.tensor(1.0), torch.tensor(1.0))


def test_arguments_that_are_not_tensors_or_a_writer_are_refused_before_any_op():
    """``kv_block_bytes``, ``host_slot_views`` and ``run_store_ops`` given None for a
    cache raised AttributeError (``.dim``, ``.device``, ``.shape``); ``run_store_ops``
    with no writer raised AttributeError at its first put, and ops that are not a list
    TypeError (review-r21). Now ConfigError before any op runs."""
    from prefixkv.store.torch_io import host_slot_views

    k, v = torch.zeros(L, N, BS, H, D), torch.zeros(L, N, BS, H, D)
    kh, vh = torch.zeros(2, L, BS, H, D), torch.zeros(2, L, BS, H, D)
    with pytest.raises(ConfigError):
        kv_block_bytes(None, v)
    with pytest.raises(ConfigError):
        host_slot_views(kh, None)
    ops = [StorePut(1, b"key", b"head")]
    for args in ((None, k, v, kh, vh, Collect()), (ops, k, None, kh, vh, Collect()),
                 (ops, k, v, None, vh, Collect()), (ops, k, v, kh, vh, None)):
        with pytest.raises(ConfigError):
            run_store_ops(*args)

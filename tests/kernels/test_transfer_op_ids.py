"""The ids inside ``run_kv_ops``'s ops (plain Python ints of frozen dataclasses that do
not check their fields): anything but an int is refused before any copy, never rounded."""

import pytest

torch = pytest.importorskip("torch")

from prefixkv.kernels import ArgumentTypeError, BlockIdError, run_kv_ops  # noqa: E402
from prefixkv.results import BlockCopy, BlockLoads, BlockOffloads  # noqa: E402


def caches():
    """K and V of 4 blocks, block b filled with b; host caches of 3 slots filled with -1."""
    k = torch.arange(4.0).reshape(4, 1, 1, 1).expand(4, 2, 1, 8).contiguous()
    hosts = [torch.full((3, 2, 1, 8), -1.0) for _ in range(2)]
    return [k, k.clone()], hosts


@pytest.mark.parametrize("op", [
    BlockCopy(1.9, 3),                      # was truncated to 1: block 3 got block 1's KV
    BlockCopy(2, True),                     # was block 1
    BlockCopy(torch.tensor(1.5), 2),
    BlockOffloads((0, 1.0), (0, 1)),
    BlockLoads((0,), (2.5,)),
    BlockOffloads((0,), (None,)),           # was a TypeError
    BlockCopy("1", 2),                      # was a bare ValueError from torch
    BlockLoads(0, 2),                       # ids not in a tuple: was a TypeError
])
def test_an_id_that_is_not_an_int_is_refused_before_any_copy(op):
    devs, hosts = caches()
    before = [t.clone() for t in devs + hosts]
    with pytest.raises(ArgumentTypeError, match="int"):
        run_kv_ops([BlockCopy(0, 1), op], devs, hosts)
    assert all(torch.equal(a, b) for a, b in zip(devs + hosts, before, strict=True))


def test_ids_past_int64_are_block_id_errors():
    devs, hosts = caches()
    with pytest.raises(BlockIdError, match="outside"):
        run_kv_ops([BlockCopy(2**70, 1)], devs, hosts)
    with pytest.raises(BlockIdError, match="outside"):
        run_kv_ops([BlockLoads((0,), (-(2**64),))], devs, hosts)


def test_integer_ids_of_any_int_type_are_taken():
    np = pytest.importorskip("numpy")
    devs, hosts = caches()
    run_kv_ops([BlockOffloads((np.int64(3),), (torch.tensor(2),)), BlockCopy(np.int32(2), 0)], devs, hosts)
    assert torch.equal(hosts[0][2], devs[0][3]) and torch.equal(devs[1][0], devs[1][2])

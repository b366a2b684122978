"""BlockCopier on [B, H, N, C] views over NHD and HND memory (torch only)."""

import pytest
import torch

from prefixkv.errors import ConfigError
from prefixkv.integrations.vllm.copier import BlockCopier

B, H, N, C = 6, 2, 4, 8


def views(physical: str, layers: int = 2, dtype=torch.float16) -> dict[str, torch.Tensor]:
    """Per-layer [B, H, N, C] views of memory laid out NHD ([B, N, H, C]) or HND."""
    out = {}
    for i in range(layers):
        if physical == "NHD":
            out[f"layer.{i}"] = torch.zeros(B, N, H, C, dtype=dtype).permute(0, 2, 1, 3)
        else:
            out[f"layer.{i}"] = torch.zeros(B, H, N, C, dtype=dtype)
    return out


def fill(kv: dict[str, torch.Tensor], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in kv.values():
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))


@pytest.mark.parametrize("src,dst", [("NHD", "HND"), ("HND", "NHD"), ("NHD", "NHD")])
def test_payloads_are_logical_bytes_and_round_trip_across_layouts(src, dst):
    a, b = views(src), views(dst)
    fill(a, 1)
    payloads = BlockCopier(a).read([4, 1])
    assert len(payloads[0]) == 2 * H * N * C * 2
    BlockCopier(b).write([0, 5], payloads)
    for name in a:
        assert torch.equal(b[name][0], a[name][4]) and torch.equal(b[name][5], a[name][1])
        assert torch.count_nonzero(b[name][1:5]) == 0
    expect = b"".join(a[n][4].contiguous().view(torch.uint8).numpy().tobytes() for n in sorted(a))
    assert payloads[0] == expect


def test_write_rows_from_a_staging_buffer():
    a, b = views("NHD"), views("HND")
    fill(a, 2)
    copier = BlockCopier(b)
    rows = torch.frombuffer(bytearray(b"".join(BlockCopier(a).read([2, 3]))), dtype=torch.uint8)
    copier.write_rows([3, 2], rows.view(2, copier.block_bytes))
    assert all(torch.equal(b[n][3], a[n][2]) for n in a)


def test_bad_input_raises_before_writing():
    kv = views("NHD")
    copier = BlockCopier(kv)
    good = copier.read([0])[0]
    with pytest.raises(ConfigError, match="outside"):
        copier.read([B])
    with pytest.raises(ConfigError, match="bytes"):
        copier.write([1, 2], [good, good[:-1]])
    with pytest.raises(ConfigError, match="payloads for"):
        copier.write([1], [good, good])
    with pytest.raises(ConfigError, match="rows of shape"):
        copier.write_rows([1], torch.zeros(1, 3, dtype=torch.uint8))
    with pytest.raises(ConfigError, match="no KV caches"):
        BlockCopier({})
    with pytest.raises(ConfigError, match="expected"):
        BlockCopier({"a": torch.zeros(B, H, N, C), "b": torch.zeros(B + 1, H, N, C)})
    assert all(torch.count_nonzero(t) == 0 for t in kv.values())

"""Per-request split-KV with a preallocated workspace: a long decode splits inside a batch
that also holds a prefill, the grid and the workspace stay the same from step to step
(what a CUDA graph captures), and a workspace that does not fit is rejected."""

from __future__ import annotations

import pytest
import torch

from prefixkv.kernels import (
    ArgumentTypeError,
    ShapeError,
    UnsupportedError,
    alloc_split_workspace,
    paged_prefill_attention,
    paged_prefill_attention_reference,
)

from .cases import make_case, tolerance
from .conftest import HAS_CUDA, PRIMARY_DEVICE, triton_skip_reason

needs_triton = pytest.mark.skipif(triton_skip_reason() is not None, reason=str(triton_skip_reason()))
# A prefill of 20 new tokens on 30 keys, a long decode (1 on 300 keys), a short decode, an empty request.
Q_LENS, KV_LENS = [20, 1, 1, 0], [30, 300, 40, 7]


def _case(seed=0, kv_lens=KV_LENS):
    return make_case(Q_LENS, kv_lens, num_kv_heads=2, group=2, head_dim=16, block_size=16,
                     device=PRIMARY_DEVICE, seed=seed)


@needs_triton
def test_a_long_decode_splits_beside_a_prefill():
    from prefixkv.kernels.attention import paged_prefill_attention_triton
    from prefixkv.kernels.tiling import TileConfig

    case = _case()
    ws = alloc_split_workspace(4, 8, 4, 16, PRIMARY_DEVICE, split_q=1, min_keys=64)
    got, lse = paged_prefill_attention_triton(*case.args, return_lse=True, config=TileConfig(32, 32),
                                              split_workspace=ws)
    want, want_lse = paged_prefill_attention_reference(*case.args, return_lse=True)
    torch.testing.assert_close(got, want, **tolerance(torch.float32))
    torch.testing.assert_close(lse, want_lse, **tolerance(torch.float32))
    # Rows of the two decodes (requests 1 and 2: tokens 20 and 21) went through the
    # workspace; the prefill (more than split_q tokens) and the empty request did not.
    assert ws.row_tok.tolist()[:4] == [-1, 20, 21, -1]
    # The long decode used min(4, 300 // 64) = 4 slices, the short one min(4, 40 // 64) -> 1.
    finite = torch.isfinite(ws.part_lse[:, 0]).cpu()  # [splits, rows] of head 0
    assert finite[:, 1].tolist() == [True] * 4 and finite[:, 2].tolist() == [True, False, False, False]


@needs_triton
def test_the_launch_is_the_same_for_every_step(monkeypatch):
    """Two steps of different lengths: the same grid (the split axis from the workspace, not
    from max_seqlen_k) and no allocation for the splits."""
    from prefixkv.kernels import attention, split_plan

    grids = []
    kernel = attention._paged_prefill_kernel

    class Recorder:
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(attention, "_paged_prefill_kernel", Recorder())
    monkeypatch.setattr(split_plan, "alloc_split_workspace", None)  # calling it would raise
    ws = alloc_split_workspace(3, 4, 4, 16, PRIMARY_DEVICE, min_keys=32)
    for seed, kv_lens in ((1, KV_LENS), (2, [25, 90, 40, 7])):
        case = _case(seed, kv_lens)
        out = paged_prefill_attention(*case.args, split_workspace=ws, backend="triton")
        want = paged_prefill_attention_reference(*case.args)
        torch.testing.assert_close(out, want, **tolerance(torch.float32))
    assert grids[0] == grids[1] and grids[0][2] == 3


def test_a_workspace_that_does_not_fit_is_rejected():
    case = _case()
    for ws, error in ((alloc_split_workspace(2, 3, 4, 16, PRIMARY_DEVICE), ShapeError),  # 3 rows < 4 requests
                      (alloc_split_workspace(2, 4, 8, 16, PRIMARY_DEVICE), ShapeError),  # 8 heads
                      (alloc_split_workspace(2, 2, 4, 16, PRIMARY_DEVICE, split_q=2), ShapeError),
                      ("ws", ArgumentTypeError)):
        with pytest.raises(error, match="split_workspace"):
            paged_prefill_attention(*case.args, split_workspace=ws, backend="torch")
    with pytest.raises(UnsupportedError, match="num_splits"):
        alloc_split_workspace(0, 4, 4, 16, "cpu")


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device: CUDA graph capture")
def test_cuda_graph_captures_one_launch_and_replays_other_lengths():
    case = _case(3)
    args = list(case.args)
    ws = alloc_split_workspace(4, 8, 4, 16, "cuda", min_keys=64)
    out = torch.empty_like(case.q)
    paged_prefill_attention(*args, out=out, split_workspace=ws)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_prefill_attention(*args, out=out, split_workspace=ws)
    case.seqused_k.copy_(torch.tensor([30, 250, 17, 7], dtype=torch.int32))  # a later step, in place
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, paged_prefill_attention_reference(*args), **tolerance(torch.float32))


@needs_triton
def test_rows_no_request_owns_never_take_a_request_s_workspace_row():
    """q has a row past cu_seqlens_q[-1] (untrusted metadata): it is nobody's, attends no key
    and gets 0, and it must not land in the last request's workspace row (it did: the
    trailing segment took request batch - 1's row and its token)."""
    case = make_case([1, 1], [200, 90], num_kv_heads=2, group=2, head_dim=16, block_size=16,
                     device=PRIMARY_DEVICE, seed=5)
    case.q = torch.cat([case.q, torch.randn(1, 4, 16, device=PRIMARY_DEVICE)])  # row 2: nobody's
    ws = alloc_split_workspace(3, 2, 4, 16, PRIMARY_DEVICE, min_keys=32)
    got = paged_prefill_attention(*case.args, split_workspace=ws, backend="triton")
    want = paged_prefill_attention_reference(*case.args)
    assert (got[2] == 0).all() and (want[2] == 0).all()
    torch.testing.assert_close(got, want, **tolerance(torch.float32))
    assert ws.row_tok.tolist() == [0, 1]


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_a_row_map_that_is_not_contiguous_is_rejected_before_any_write(backend):
    """The kernels index ``row_tok`` at stride 1, and the launch clears it through its
    view: with a strided map, a row the view skips kept the token an earlier launch wrote
    there, and the merge put that launch's partials into this launch's output (a decode,
    then the same request prefilling 3 tokens: its first query row got the old decode)."""
    import dataclasses

    ws = alloc_split_workspace(3, 2, 4, 16, PRIMARY_DEVICE, min_keys=32)
    strided = torch.full((2 * ws.rows,), -1, dtype=torch.int32, device=PRIMARY_DEVICE)[::2]
    bad = dataclasses.replace(ws, row_tok=strided)
    case = make_case([1, 3], [200, 90], num_kv_heads=2, group=2, head_dim=16, block_size=16,
                     device=PRIMARY_DEVICE, seed=4)
    out = torch.full_like(case.q, 7.0)
    with pytest.raises(ShapeError, match="row_tok must be contiguous"):
        paged_prefill_attention(*case.args, out=out, split_workspace=bad, backend=backend)
    assert (out == 7.0).all() and (strided == -1).all()


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("field", ["num_splits", "split_q", "min_keys"])
def test_a_workspace_made_by_hand_with_counts_alloc_refuses_is_rejected(backend, field):
    """A ``SplitWorkspace`` built directly (a frozen dataclass, its fields unchecked): a
    count ``alloc_split_workspace`` refuses is refused by the launch too, before any write.
    Before: 0 splits launched a grid with an empty split axis, no program ran and ``out``
    kept what it held; ``min_keys`` 0 is an integer division by zero in the kernel's slice
    count (numpy in the interpreter makes it 0, hence 1 slice; a GPU's result is undefined)."""
    import dataclasses

    ws = alloc_split_workspace(3, 2, 4, 16, PRIMARY_DEVICE, min_keys=32)
    bad = (dataclasses.replace(ws, part=ws.part[:0], part_lse=ws.part_lse[:0]) if field == "num_splits"
           else dataclasses.replace(ws, **{field: 0}))
    case = make_case([1, 1], [200, 90], num_kv_heads=2, group=2, head_dim=16, block_size=16,
                     device=PRIMARY_DEVICE, seed=4)
    out = torch.full_like(case.q, 7.0)
    with pytest.raises(UnsupportedError, match=f"split_workspace.{field} must be an int"):
        paged_prefill_attention(*case.args, out=out, split_workspace=bad, backend=backend)
    assert (out == 7.0).all()


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("heads, error", [(None, ArgumentTypeError), (8, ShapeError)])
def test_a_bad_workspace_is_rejected_on_a_batch_of_no_new_token_too(backend, heads, error):
    """Both backends check the workspace before anything else they do. Before: the Triton
    path checked it while planning the launch, after returning early on a batch of no new
    token (an engine's idle step), so ``"ws"`` or a workspace of 8 heads passed there
    silently and raised on the torch path (found folding the backends' shared checks)."""
    case = make_case([0, 0], [5, 3], num_kv_heads=2, group=2, head_dim=16, block_size=16,
                     device=PRIMARY_DEVICE)
    ws = "ws" if heads is None else alloc_split_workspace(2, 2, heads, 16, PRIMARY_DEVICE)
    with pytest.raises(error, match="split_workspace"):
        paged_prefill_attention(*case.args, split_workspace=ws, backend=backend)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_checked_mode_reads_values_only_after_the_workspace_is_checked(backend):
    """A call with a wrong workspace and a bad ``cu_seqlens_q`` value raises the same
    error on both backends: the workspace's (no device synchronisation), not checked
    mode's. Before: torch raised ArgumentTypeError, Triton MetadataError (it read the
    values first)."""
    case = make_case([2, 1], [5, 3], num_kv_heads=2, group=2, head_dim=16, block_size=16,
                     device=PRIMARY_DEVICE)
    args = list(case.args)
    args[4] = torch.tensor([0, 2, 9], dtype=torch.int32, device=PRIMARY_DEVICE)  # 9 != total_q 3
    out = torch.full_like(case.q, 7.0)
    with pytest.raises(ArgumentTypeError, match="split_workspace"):
        paged_prefill_attention(*args, out=out, split_workspace="ws", checked=True, backend=backend)
    assert (out == 7.0).all()

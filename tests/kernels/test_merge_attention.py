"""merge_attention (the torch merge of cascade attention's two passes) on hand-worked
rows, on the +inf LSE a +inf sink gives, and on arguments that do not fit together."""

from __future__ import annotations

import math

import pytest
import torch

from prefixkv.kernels import ArgumentTypeError, DtypeError, ShapeError, merge_attention

INF = float("inf")


def _row(*values: float) -> torch.Tensor:
    return torch.tensor([[list(values)]])  # [1 row, 1 head, head_dim]


def test_two_sets_weigh_by_their_sums():
    # Set a: sum of exp(scores) 1, output [1, 0]; set b: sum 3, output [0, 1].
    # The union's softmax: (1 * [1, 0] + 3 * [0, 1]) / 4, LSE log 4.
    out, lse = merge_attention(_row(1.0, 0.0), torch.tensor([[0.0]]), _row(0.0, 1.0),
                               torch.tensor([[math.log(3.0)]]))
    torch.testing.assert_close(out, _row(0.25, 0.75))
    torch.testing.assert_close(lse, torch.tensor([[math.log(4.0)]]))


def test_a_row_neither_set_saw_is_zero_with_lse_minus_inf():
    out, lse = merge_attention(_row(0.0, 0.0), torch.tensor([[-INF]]), _row(0.0, 0.0), torch.tensor([[-INF]]))
    assert out.tolist() == [[[0.0, 0.0]]] and lse.tolist() == [[-INF]]


@pytest.mark.parametrize("other_lse", [5.0, -3.0, -INF, INF], ids=["5", "-3", "-inf", "+inf"])
@pytest.mark.parametrize("sunk_first", [True, False], ids=["a-sunk", "b-sunk"])
def test_a_plus_inf_lse_takes_the_row(other_lse, sunk_first):
    # A +inf sink: the kernels give that set output 0 and LSE +inf; the union is the same.
    sunk, other = (_row(0.0, 0.0), torch.tensor([[INF]])), (_row(1.0, 2.0), torch.tensor([[other_lse]]))
    if other_lse == INF:
        other = (_row(0.0, 0.0), other[1])
    a, b = (sunk, other) if sunk_first else (other, sunk)
    out, lse = merge_attention(a[0], a[1], b[0], b[1])
    assert out.tolist() == [[[0.0, 0.0]]] and lse.tolist() == [[INF]]


def _good() -> list[torch.Tensor]:
    return [torch.zeros(3, 2, 8), torch.zeros(2, 3), torch.zeros(3, 2, 8), torch.zeros(2, 3)]


@pytest.mark.parametrize(("index", "bad", "error"), [
    (2, torch.zeros(1, 2, 8), ShapeError),  # would broadcast over the rows
    (3, torch.zeros(2, 1), ShapeError),  # would broadcast too
    (1, torch.zeros(3, 2), ShapeError),  # [rows, heads]: transposed
    (0, torch.zeros(3, 16), ShapeError),
    (3, torch.zeros(2, 3, dtype=torch.float16), DtypeError),
    (0, torch.zeros(3, 2, 8, dtype=torch.int32), DtypeError),
    (1, [[0.0] * 3] * 2, ArgumentTypeError),
], ids=["out-broadcast", "lse-broadcast", "lse-transposed", "out-2d", "lse-fp16", "out-int", "not-tensor"])
def test_arguments_that_do_not_fit_are_refused(index, bad, error):
    args = _good()
    args[index] = bad
    with pytest.raises(error):
        merge_attention(*args)

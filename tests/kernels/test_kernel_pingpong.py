"""benchmarks/kernel_pingpong.py, the serial model for two consumer warpgroups, on loops
made up here; and the Gluon ping-pong probe compiled for sm_90a (no GPU).

The compile runs ``benchmarks/gluon_pingpong.py`` in a child process without
``TRITON_INTERPRET`` (conftest sets it on a machine without CUDA, and a Gluon kernel cannot
be defined under the interpreter).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gluon_pingpong.py"
# The compile fixture is per module and per xdist worker: one worker runs the module
# (gpu_session.sh: --dist loadgroup), beside test_compile_sm90's.
pytestmark = pytest.mark.xdist_group("compile-gluon")


@pytest.fixture(scope="module")
def model():
    sys.path.insert(0, str(SCRIPT.parent))
    import kernel_pingpong

    return kernel_pingpong


def _loop(model, *, wait_turn: int, arrive_turn: int, softmax: int, hgmma: int = 8,
          step: str = "FADD R30, R31, R32") -> list:
    """A consumer pass: a data wait, its turn, ``hgmma`` 64x128x16 MMAs (64 clocks each) in
    one group, the other's turn, a wait for the group, ``softmax`` plain instructions, a
    buffer released, the backward branch."""
    from kernel_static import Instr

    text = ["SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4+0x200c0], R2",
            f"SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4+{wait_turn:#x}], R3",
            *["HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24"] * (hgmma - 1),
            "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24, gsb0",
            f"@!P0 SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR4+{arrive_turn:#x}], RZ",
            "WARPGROUP.DEPBAR.LE gsb0, 0x0",
            *[step] * softmax,
            "@!P0 SYNCS.ARRIVE.TRANS64.A1T0 RZ, [R6+URZ+0x20100], RZ",
            "@P1 BRA `(.L_x_9)"]
    return [Instr(0x100 + 16 * n, t, None) for n, t in enumerate(text)]


def _pair(model, softmax: int) -> list[list]:
    return [_loop(model, wait_turn=0x20120, arrive_turn=0x20128, softmax=softmax),
            _loop(model, wait_turn=0x20128, arrive_turn=0x20120, softmax=softmax)]


# 8 HGMMA.64x128x16 a pass = 512 clocks of one warpgroup's MMA: 64 rows, 64 keys, dim 128.
SHAPE = dict(rows=64, block_n=64, dim=128)


def test_roles_of_the_barriers(model):
    roles = {0x200c0: "data", 0x20100: "release", 0x20120: "turn", 0x20128: "turn"}
    assert model.roles(_pair(model, 10)) == roles
    one = _loop(model, wait_turn=0x20120, arrive_turn=0x20120, softmax=1)
    with pytest.raises(ValueError, match="not a ping-pong"):
        model.roles([one, one])


def test_one_warpgroups_softmax_hides_under_the_others_mma(model):
    """Softmax (400 instructions, a clock each) shorter than the other warpgroup's MMAs
    (512 clocks): the tensor cores never wait, 1024 clocks a tile of both."""
    fast = model.pingpong_clocks(_pair(model, 400), **SHAPE, stages=4, tile_bytes=0)
    assert fast["units"]["mma"] == 1024 and fast["peak_fraction"] == pytest.approx(1.0, abs=0.01)


def test_a_softmax_longer_than_the_mma_falls_off(model):
    """Softmax 800 > MMA 512: while one warpgroup's MMA runs, the other's softmax shares the
    schedulers with the first's, so a tile takes one MMA and both softmaxes in turn,
    512 + 2 x 800 clocks (traced by hand), not max(2 x 512, 2 x 800)."""
    slow = model.pingpong_clocks(_pair(model, 800), **SHAPE, stages=4, tile_bytes=0)
    assert slow["bound"] == "waits" and slow["clocks"] == pytest.approx(512 + 2 * 800, rel=0.01)


def test_latencies_lengthen_a_dependent_softmax(model):
    """200 dependent FADDs: 200 issue clocks in the model (under the other's 512 of MMA);
    with 4 clocks from issue to a dependent issue, 800: a warpgroup's pass is its MMA and
    its chain, 1312 clocks, for the 1024 of MMA of both (traced by hand)."""
    chain = [_loop(model, wait_turn=a, arrive_turn=b, softmax=200, step="FADD R30, R30, R32")
             for a, b in ((0x20120, 0x20128), (0x20128, 0x20120))]
    fast = model.pingpong_clocks(chain, **SHAPE, stages=4, tile_bytes=0)
    assert fast["peak_fraction"] == pytest.approx(1.0, abs=0.01)
    late = model.pingpong_clocks(chain, **SHAPE, stages=4, tile_bytes=0, latency=True)
    assert late["clocks"] == pytest.approx(512 + 800, rel=0.02)


def test_result_latency_reads_the_destination(model):
    assert model.result_latency("SHFL.BFLY PT, R204, R19, 0x2, 0x1f") == ((204,), 24.0)
    assert model.result_latency("@!P0 MUFU.EX2 R5, R6") == ((5,), 20.0)
    assert model.result_latency("IMAD.WIDE.U32 R4, R5, R6, R7") == ((4, 5), 4.0)
    assert model.result_latency("R2UR UR40, R200") == ((), 0.0)  # a uniform register: not tracked
    assert model.result_latency("HGMMA.64x32x16.F32.BF16 R168, gdesc[UR36], RZ, !UPT") == ((), 0.0)


def test_the_ring_and_the_l2_port_bound_the_pass(model):
    """24 B a clock: a 48000-byte tile holds the port 2000 clocks; four buffers hide the
    800-clock round trip, two do not (a pass frees one tile while it waits for the next)."""
    deep = model.pingpong_clocks(_pair(model, 400), **SHAPE, stages=4, tile_bytes=48000)
    assert deep["bound"] == "l2" and deep["clocks"] == pytest.approx(2000, rel=0.01)
    shallow = model.pingpong_clocks(_pair(model, 400), **SHAPE, stages=2, tile_bytes=48000)
    assert shallow["bound"] == "waits" and shallow["clocks"] > 2000 + 800 + 512


def test_smem_bytes_of_hgmma_operands(model):
    assert model.smem_bytes("HGMMA.64x32x16.F32.BF16 R168, gdesc[UR56], RZ, !UPT") == 2 * (32 + 64) * 16
    assert model.smem_bytes("HGMMA.64x128x16.F32.BF16 R88, R184, gdesc[UR12].tnspB, R88") == 2 * 128 * 16
    assert model.smem_bytes("FADD R1, R2, R3") == 0


def _skip_reason() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if importlib.util.find_spec("triton.experimental.gluon") is None:
        return "this triton has no Gluon"
    from triton.backends import backends

    return None if "nvidia" in backends else "this triton build has no NVIDIA backend"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> list[dict]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    out = tmp_path_factory.mktemp("gluon") / "pingpong.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], env=env, capture_output=True,
                          text=True, timeout=600, cwd=SCRIPT.parent)
    assert out.exists(), f"gluon_pingpong.py wrote nothing (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_pingpong_compiles_without_spills_and_waits_for_one_of_two_groups(compiled, layout):
    row = next(r for r in compiled if r["layout"] == layout)
    assert row["n_spills"] == 0 and not row["wgmma_serialized"] and row["shared"] <= 227 * 1024
    # two consumer loops a phase (unmasked, the masked diagonal), each waiting for QK^T alone
    # (PV in flight), then for PV
    for phase in ("phase2", "phase3"):
        assert len(row["loops"][phase]) == 2 and row["group_waits"][phase] == [[1, 0], [1, 0]]
        roles = row["model"][phase]["roles"]
        assert sorted(roles.values()) == ["data", "data", "release", "turn", "turn"]
    assert row["loops"]["phase3"][0] > row["loops"]["phase2"][0]  # the mask's instructions
    # the goal shape's whole ceiling under the model (0.93-0.94 on triton 3.6-3.9 when written)
    assert row["whole_shape"]["peak_fraction"] >= 0.8, row["model"]

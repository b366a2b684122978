"""The serial clock model of ``benchmarks/kernel_timing.py`` against a case worked by hand.

Needs no GPU, no compiler and no torch: the model reads SASS text. The synthetic loop is
the shape of the prefill kernel's key loop (sm_90, wgmma): QK^T as one wgmma group, a
``WARPGROUP.DEPBAR`` wait for it, the softmax (ALU work and two exp2), then PV as a
second group reading P from registers, then loop overhead.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import kernel_static  # noqa: E402
import kernel_timing  # noqa: E402


def _sass(lines: list[str]) -> str:
    """nvdisasm-style text: a label, one instruction a line with its address, a back branch."""
    out, addr = [".L_x_1:"], 0
    for text in lines + ["BRA `(.L_x_1)"]:
        out.append(f"        /*{addr:04x}*/                   {text} ;")
        addr += 16
    return "\n".join(out)


SOFTMAX_ALU = 100
LOOP = (["WARPGROUP.ARRIVE",
         "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT",
         "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24, gsb0",
         "WARPGROUP.DEPBAR.LE gsb0, 0x0"]
        + ["FADD R1, R24, R2"] * SOFTMAX_ALU
        + ["MUFU.EX2 R3, R1", "MUFU.EX2 R4, R1", "WARPGROUP.ARRIVE",
           "HGMMA.64x128x16.F32.BF16 R88, R3, gdesc[UR8].tnspB, R88",
           "HGMMA.64x128x16.F32.BF16 R88, R4, gdesc[UR8].tnspB, R88, gsb0",
           "BAR.SYNC.DEFER_BLOCKING 0x0"]
        + ["IADD3 R5, R5, 0x40, RZ"] * 3)


def test_hand_worked_wgmma_loop():
    """64 x 64 tile, dim 64, 4 warps: 4 * 64^3 FLOP = 256 wgmma clocks; an HGMMA.64x128x16
    does 2 * 64 * 128 * 16 FLOP for the CTA's one warpgroup, 64 clocks; an instruction
    issues in 4 / 4 = 1 clock; an exp2 holds MUFU 4 * 32 / 16 = 8 clocks.

    Steady state, PV(j-1) ending at T on the tensor core. QK(j) runs T .. T+128; issue
    waits for it at the DEPBAR and issues it at T+128 (done T+129); 100 ALU -> T+229;
    exp2 R3 on MUFU T+229 .. T+237, exp2 R4 T+237 .. T+245 (issued T+230, T+231); ARRIVE
    T+232; the first PV HGMMA reads R3: issued at T+237 and starts on the idle tensor
    core then (to T+301); the second reads R4: issued T+245, starts after the first,
    ends T+365 = the next T. The loop's other 5 instructions issue before T+365, so one
    tile takes 365 clocks: 256 of MMA plus the 109 that the softmax between the wait and
    PV adds. The overlap model said max(256, 114 issue, 16 exp2) = 256.
    """
    body = kernel_static.loops(_sass(LOOP))
    assert len(body) == 1 and len(body[0]) == len(LOOP) + 1
    got = kernel_timing.tile_clocks(body[0], block_m=64, block_n=64, dim=64, num_warps=4, mma="wgmma")
    assert got["period"] == 365.0 and got["clocks"] == 365.0
    assert got["units"] == {"mma": 256.0, "issue": 114.0, "ex2": 16.0}
    assert got["waits"] == {"group_wait": 1, "bar_sync": 1}
    assert got["bound"] == "mma+softmax serialised"
    assert got["peak_fraction"] == round(256 / 365, 4)
    old = kernel_static.cycle_estimate(kernel_static.tile_counts(body[0]), block_m=64, block_n=64, dim=64,
                                       num_warps=4, mma="wgmma")
    assert old["peak_fraction"] == 1.0  # what the overlap model claimed for the same loop


def test_resident_ctas_fill_each_others_waits():
    """Two CTAs per SM: 365 / 2 = 182.5 < 256 of MMA, so the tensor core bounds the SM."""
    body = kernel_static.loops(_sass(LOOP))[0]
    got = kernel_timing.tile_clocks(body, block_m=64, block_n=64, dim=64, num_warps=4, mma="wgmma",
                                    ctas_per_sm=2)
    assert got["clocks"] == 256.0 and got["bound"] == "mma" and got["period"] == 365.0


def test_without_a_wait_the_units_overlap():
    """The same loop without the DEPBAR, and PV not reading the softmax's registers: nothing
    waits, so the tensor core alone sets the pace (as the overlap model assumed)."""
    free = [t.replace("R3, gdesc", "R90, gdesc").replace("R4, gdesc", "R91, gdesc") for t in LOOP
            if not t.startswith("WARPGROUP.DEPBAR")]
    got = kernel_timing.tile_clocks(kernel_static.loops(_sass(free))[0], block_m=64, block_n=64, dim=64,
                                    num_warps=4, mma="wgmma")
    assert got["clocks"] == 256.0 and got["bound"] == "mma"


def test_an_hgmma_costs_what_its_shape_does():
    """A wgmma's clocks follow its shape, not an equal share of the tile: with 8 warps (two
    warpgroups) an HGMMA.64x16x16 takes 2 * 2 * 64 * 16 * 16 / 4096 = 16 clocks and an
    HGMMA.64x128x16 128. Nothing waits, so the tensor core sets the pace: 16 + 4 * 128 a pass."""
    body = (["HGMMA.64x16x16.F32.BF16 R120, R144, gdesc[UR8].tnspB, RZ, !UPT, gsb0"]
            + ["HGMMA.64x128x16.F32.BF16 R24, R128, gdesc[UR8].tnspB, R24"] * 3
            + ["HGMMA.64x128x16.F32.BF16 R24, R128, gdesc[UR8].tnspB, R24, gsb0"])
    got = kernel_timing.tile_clocks(kernel_static.loops(_sass(body))[0], block_m=128, block_n=64, dim=64,
                                    num_warps=8, mma="wgmma")
    assert got["units"]["mma"] == got["clocks"] == 16 + 4 * 128 and got["bound"] == "mma"
    assert kernel_timing.decode(body[0]).flops == 2 * 64 * 16 * 16


@pytest.mark.parametrize("text, kind, dst, src", [
    ("HMMA.16816.F32.BF16 R24, R4, R8, R24", "hmma", (24, 25, 26, 27), (4, 8, 24)),
    ("@!P0 MUFU.EX2 R22, R22", "ex2", (22,), (22,)),
    ("WARPGROUP.DEPBAR.LE gsb0, 0x1", "group_wait", (), ()),
    ("LDGSTS.E.BYPASS.128 [R249+0x800], desc[UR12][R34.64], !P1", "other", (), (249, 34)),
])
def test_decode_reads_the_registers(text, kind, dst, src):
    op = kernel_timing.decode(text)
    assert (op.kind, op.dst, op.src) == (kind, dst, src)
    assert op.max_groups == (1 if kind == "group_wait" else 0)

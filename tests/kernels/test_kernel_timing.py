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
    assert got["units"] == {"mma": 256.0, "issue": 114.0, "ex2": 16.0, "l2": 0.0}  # no cp.async
    assert got["waits"] == {"group_wait": 1, "cp_wait": 0, "bar_sync": 1}
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
    ("LDGSTS.E.BYPASS.128 [R249+0x800], desc[UR12][R34.64], !P1", "cp_async", (), (249, 34)),
    ("@!P5 LDGSTS.E [R166+0x18200], desc[UR48][R154.64], !P1", "cp_async", (), (166, 154)),
    ("LDGDEPBAR", "cp_commit", (), ()),
    ("DEPBAR.LE SB0, 0x1", "cp_wait", (), ()),
    ("LDL.LU R232, [R1+0x68]", "ldl", (232,), (1,)),
    ("LDL.64 R10, [R1+0x8]", "ldl", (10, 11), (1,)),
])
def test_decode_reads_the_registers(text, kind, dst, src):
    op = kernel_timing.decode(text)
    assert (op.kind, op.dst, op.src) == (kind, dst, src)
    assert op.max_groups == (1 if kind in ("group_wait", "cp_wait") else 0)
    assert op.bytes == {"LDGSTS.E.BYPASS.128": 16, "@!P5 LDGSTS.E": 4}.get(text.split(" [")[0], 0)


# A loop that waits at its top for the K/V tile its previous pass loaded (a ring of two):
# 8 cp.async of 16 B a thread, 4 warps: 8 * 16 * 128 = 16384 bytes a pass.
MEMORY_LOOP = (["DEPBAR.LE SB0, 0x0",
                "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT, gsb0",
                "WARPGROUP.DEPBAR.LE gsb0, 0x0"]
               + ["LDGSTS.E.BYPASS.128 [R10+0x0], desc[UR4][R12.64], !P0"] * 8
               + ["LDGDEPBAR"] + ["FADD R1, R2, R3"] * 100)


def test_memory_round_trip_worked_by_hand():
    """4 warps: one clock an instruction; the HGMMA.64x128x16 of one warpgroup is 64 clocks
    (= the 64 x 16 tile of dim 64: 4 * 64 * 16 * 64 FLOP). The pass starting at t0: the
    cp.async wait issues at t0, the HGMMA at t0+1 (done t0+65), its wait lets issue on at
    t0+65, the 8 LDGSTS issue t0+66..t0+73, the commit at t0+74: the group's 16384 bytes
    cross the port at 24 B/clk in 682.67 clocks (to t0+756.67) and land L2_LATENCY = 800
    later, t0+1556.67; the 100 FADD and the branch end issue at t0+176, and the next pass's
    wait holds until t0+1556.67. Without memory the pass is those 176 clocks."""
    assert (kernel_timing.L2_BYTES_PER_CLOCK, kernel_timing.L2_LATENCY) == (24.0, 800.0)
    body = kernel_static.loops(_sass(MEMORY_LOOP))[0]
    shape = dict(block_m=64, block_n=16, dim=64, num_warps=4, mma="wgmma")
    got = kernel_timing.tile_clocks(body, **shape)
    transfer = 16384 / 24
    assert got["period"] == round(74 + transfer + 800, 1) == got["clocks"] == 1556.7
    assert got["period_without_memory"] == 176.0 and got["l2_bytes"] == 16384
    assert got["units"] == {"mma": 64.0, "issue": 113.0, "ex2": 0.0, "l2": round(transfer, 1)}
    assert got["bound"] == "memory round trip"
    assert got["waits"] == {"group_wait": 1, "cp_wait": 1, "bar_sync": 0}
    assert got["peak_fraction"] == round(64 / (74 + transfer + 800), 4)
    assert got["peak_fraction_without_memory"] == round(64 / 176, 4)
    assert kernel_timing.tile_clocks(body, **shape, memory=False)["clocks"] == 176.0
    # Two CTAs share the port (12 B/clk each): 74 + 1365.33 + 800 a pass, halved per SM.
    two = kernel_timing.tile_clocks(body, **shape, ctas_per_sm=2)
    assert two["period"] == round(74 + 2 * transfer + 800, 1)
    assert two["clocks"] == round((74 + 2 * transfer + 800) / 2, 1)


def test_a_spill_read_back_waits_for_local_memory():
    """An LDL's register is ready ``local_latency`` clocks after issue. The pass from t0: the
    HGMMA (64 clocks) and its wait let issue on at t0+64, the LDL issues at t0+64 (+1), the
    FADD reading it waits until t0+65+800 and the branch follows: 64 + 1 + 800 + 2."""
    loop = ["HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT, gsb0", "WARPGROUP.DEPBAR.LE gsb0, 0x0",
            "LDL R5, [R1+0x10]", "FADD R6, R5, R7"]
    body = kernel_static.loops(_sass(loop))[0]
    shape = dict(block_m=64, block_n=16, dim=64, num_warps=4, mma="wgmma")
    assert kernel_timing.tile_clocks(body, **shape, local_latency=800.0)["period"] == 64 + 1 + 800 + 2
    assert kernel_timing.tile_clocks(body, **shape)["period"] == 64 + 1 + 35 + 2  # L1 by default
    # 256 x 128 on triton 3.6: 496 B of stack a thread, 197632 B of shared memory: 127 KB of
    # local memory, 62 KB of L1 left -> L2. 128 x 32 on 4 warps: 2 CTAs, 96 B -> L1.
    assert kernel_timing.local_latency(stack_frame=496, threads=256, shared=197632, ctas_per_sm=1) == 800.0
    assert kernel_timing.local_latency(stack_frame=96, threads=128, shared=65792, ctas_per_sm=2) == 35.0


def test_causal_trips_worked_by_hand():
    """100 cached + 50 new tokens, 128 x 64 tiles, 4 query heads a KV head: 32 positions a
    query tile, 2 tiles. Tile 0 (queries at 100..131): whole tiles of keys below 101 = 1
    (keys 0..63), then keys 64..131 = 2 diagonal tiles. Tile 1 (132..149): 133 // 64 = 2
    whole tiles (0..127), then keys 128..149 = 1 part tile."""
    got = kernel_static.causal_trips(prefix=100, q_len=50, group_p2=4, block_m=128, block_n=64)
    assert got == {"query_tiles": 2, "phase2": 3, "phase3": 3}


def test_goal_shape_trips_and_ceiling():
    """SPEC goal shape (8192 cached + 2048 new, group 4) at 128 x 64: 64 query tiles of 32
    positions; tile t runs 128 + t // 2 cached-prefix tiles and 1 diagonal tile (32-row
    tiles never straddle a 64-key tile): 64 * 128 + 2 * (0 + ... + 31) = 9184 and 64.
    With 1024 wgmma clocks a tile, 1274 serial clocks in phase 2 and 1936 in phase 3
    (the loops' shares of peak 1024 / 1274 and 1024 / 1936):
    9248 * 1024 / (9184 * 1274 + 64 * 1936) = 9469952 / 11824320 = 0.80089."""
    trips = kernel_static.causal_trips(prefix=8192, q_len=2048, group_p2=4, block_m=128, block_n=64)
    assert trips == {"query_tiles": 64, "phase2": 9184, "phase3": 64}
    loops = {k: {"serial": {"peak_fraction": 1024 / clk, "peak_fraction_without_memory": 1024 / (clk - 200)}}
             for k, clk in (("phase2", 1274), ("phase3", 1936))}
    assert kernel_static.shape_ceiling(loops, trips) == pytest.approx(9469952 / 11824320)
    # Without memory (200 clocks a tile fewer here): 9248 * 1024 / (9184 * 1074 + 64 * 1736).
    assert kernel_static.shape_ceiling(loops, trips, "peak_fraction_without_memory") == pytest.approx(
        9469952 / (9184 * 1074 + 64 * 1736))


def test_whole_shape_names_the_main_loop_its_bound_and_the_port_cap():
    """The SPEC shape at 128 x 64 (the trips above): phase 2 takes 9184 * 2752 of the
    9184 * 2752 + 64 * 3988 clocks (99.0%); its tile's 1024 wgmma clocks against 40960 B of
    cp.async at 24 B a clock (1706.7 clocks) cap any schedule at 60%."""
    import compile_kernels

    loops = {k: {"serial": {"clocks": clk, "peak_fraction": 1024 / clk, "bound": bound,
                            "peak_fraction_without_memory": frac, "units": {"l2": 40960 / 24}}}
             for k, clk, bound, frac in (("phase2", 2752, "memory round trip", 0.8258),
                                         ("phase3", 3988, "issue", 0.5193))}
    cfg = {"prefix": 8192, "q_len": 2048}
    c = {"GROUP_P2": 4, "BLOCK_M": 128, "BLOCK_N": 64, "DIM_P2": 128}
    got = compile_kernels.whole_shape(cfg, c, loops)
    assert (got["main_loop"], got["bound"], got["port_cap"]) == ("phase2", "memory round trip", 0.6)
    assert got["main_share"] == round(9184 * 2752 / (9184 * 2752 + 64 * 3988), 4) == 0.99
    assert got["peak_fraction"] == round(9248 * 1024 / (9184 * 2752 + 64 * 3988), 4)
    assert got["without_memory"] == round(9248 / (9184 / 0.8258 + 64 / 0.5193), 4)
    assert compile_kernels.whole_shape(dict(cfg, causal=False), c, loops) is None


def test_parse_ptxas_reads_wgmma_serialisation():
    """ptxas's note that it serialised every wgmma (a wait after each one) is kept with its
    reason, the function's name dropped; a log without one gives none."""
    use = ("ptxas info    : Used 255 registers, 496 bytes stack frame, 560 bytes spill stores, "
           "544 bytes spill loads")
    note = ("ptxas info    : (C7511) Potential Performance Loss: wgmma.mma_async instructions are serialized "
            "due to insufficient register resources for the wgmma pipeline in the function "
            "'_paged_prefill_kernel'")
    assert kernel_static.parse_ptxas(use)["wgmma_serialized"] == []
    got = kernel_static.parse_ptxas(f"{use}\n{note}\n")
    assert got["wgmma_serialized"] == ["C7511: insufficient register resources for the wgmma pipeline"]
    assert (got["n_regs"], got["n_spills"], got["stack_frame"]) == (255, 1104, 496)
    newer = note.replace("in the function '_paged_prefill_kernel'", "in line 3640")  # ptxas of triton 3.9
    assert kernel_static.parse_ptxas(f"{use}\n{newer}\n")["wgmma_serialized"] == got["wgmma_serialized"]

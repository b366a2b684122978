"""Clocks of one key tile of a compiled attention loop, with what the SASS serialises.

Helper of ``compile_kernels.py`` beside ``kernel_static.py`` (which finds the loops in the
SASS; this module only reads their instructions). The first model there took the largest
of MMA, issue and exp2 time per tile, as if the units always overlapped. They do not
when the code waits: each warpgroup stops at ``WARPGROUP.DEPBAR.LE gsb0, 0x0`` until
PV(j-1) and QK(j) are done before it starts the softmax of tile j, and the next MMA
needs the softmax's P. This model replays the loop body instruction by instruction:

- issue: every instruction is issued once per warp by 4 schedulers: ``num_warps / 4``
  clocks (all warps of the CTA in lockstep: ``BAR.SYNC`` keeps them so, and is counted);
- tensor core: ``HGMMA`` (wgmma) and ``HMMA`` (mma.sync) run one after another; an
  ``HGMMA.MxNxK`` does ``2 * M * N * K`` FLOPs for each warpgroup of the CTA, an ``HMMA``
  an equal share of the tile's ``4 * BLOCK_M * BLOCK_N * dim``, at the MMA kind's rate
  (``kernel_static.MMA_FLOP_PER_CLOCK``); issuing one does not wait for it;
- MUFU: each ``MUFU.EX2`` holds it ``num_warps * 32 / 16`` clocks;
- waits: ``WARPGROUP.DEPBAR.LE gsb0, N`` stops issue until at most N wgmma groups (a
  group ends at an ``HGMMA`` marked ``gsb0``) are unfinished; an instruction reading a
  register that an ``HMMA`` or ``MUFU`` writes waits for that result (the scoreboard);
  other results are ready when issued (latencies are not modelled);
- memory (``memory=True``, the default since run 3 of the H100): the K/V tiles arrive by
  ``cp.async`` (``LDGSTS``), committed in groups (``LDGDEPBAR``); a group is done
  ``L2_LATENCY`` clocks after its last byte crossed the SM's port, which moves the CTA's
  groups one after another at ``L2_BYTES_PER_CLOCK / c`` bytes a clock (c CTAs resident
  share it); ``DEPBAR.LE SB0, N`` stops issue until at most N groups are unfinished
  (as the wgmma wait above). A spilled value read back (``LDL``) is ready after
  ``local_latency``: L1's when the CTAs' local memory fits the L1 left beside their
  shared memory, else L2's (:func:`local_latency`). The L2 port is also a unit: the SM
  spends at least a tile's bytes / ``L2_BYTES_PER_CLOCK``. Other loads still cost only issue.

The body runs ``PASSES`` times; its clocks per tile are the period of the last passes.
With ``c`` CTAs resident on an SM, one CTA's waits are filled by the others' work, so
the SM spends ``max(period / c, busiest unit)`` clocks per tile.

Why memory joined (docs/kernels.md, "Why the 256-row tile wins"): on triton 3.6 every
prefill tile's K/V ring is two buffers deep for ``num_stages`` 2-4 (the block ids read
per key take a stage of their own), so the loads of tile j+1 are issued during pass j
and waited for at the top of pass j+1: a pass lasts at least the round trip of its K/V
tile. Without this term the model ranked the 128 x 64 ``qk_ahead`` tile at 82% of
peak (measured: 342 TFLOP/s, 0.73x the 256-row tile it rated at 66%).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from kernel_static import EX2_PER_CLOCK, MMA_FLOP_PER_CLOCK, PEAK_TFLOPS, SCHEDULERS, Instr

PASSES = 8
# Memory of an H100 SXM, per SM, in SM clocks (1830 MHz). L2 to SM: 24 bytes a clock is
# 5.8 TB/s over 132 SMs, the most any prefill tile of the H100 tune moved (run 3: the
# 64 x 64, 4-warp tile read 38.8 GB of K/V in 6.59 ms, 5.9 TB/s), so a floor of what L2
# delivers. L2_LATENCY: a loaded L2 hit, about twice the unloaded one (~300 clocks in
# microbenchmarks); of 600, 800, 1000 and 1200 clocks (24 B/clk), 800 ranks the 61 tiles
# of run 3's tune within 0.01 of the best (Spearman 0.892, 0.910, 0.917, 0.913): a fit,
# stated as one. L1: 256 KB a SM with shared memory, ~35 clocks.
L2_BYTES_PER_CLOCK, L2_LATENCY = 24.0, 800.0
L1_BYTES, L1_LATENCY = 256 * 1024, 35.0
_REG = re.compile(r"\bR(\d+)\b")
_GROUP_WAIT = re.compile(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x([0-9a-f]+)")
_CP_WAIT = re.compile(r"^DEPBAR\.LE\s+SB0,\s*0x([0-9a-f]+)")
_HGMMA_SHAPE = re.compile(r"HGMMA\.(\d+)x(\d+)x(\d+)\.")
_WIDTH = re.compile(r"\.(32|64|128)\b")


@dataclass(frozen=True)
class Op:
    """One instruction as the model sees it."""

    # "hgmma", "hmma", "ex2", "group_wait", "bar", "cp_async", "cp_commit", "cp_wait", "ldl", "other"
    kind: str
    dst: tuple[int, ...]  # registers an HMMA, MUFU or LDL writes
    src: tuple[int, ...]  # registers it reads
    ends_group: bool = False  # an HGMMA that commits its wgmma group (gsb0)
    max_groups: int = 0  # group_wait, cp_wait: unfinished groups allowed
    flops: int = 0  # an HGMMA's FLOPs per warpgroup (2 * M * N * K)
    bytes: int = 0  # a cp_async's bytes per thread


def decode(text: str) -> Op:
    """The model's view of one SASS instruction (predicate stripped)."""
    text = re.sub(r"^@!?U?P\w+\s+", "", text.strip())
    opcode, _, operands = text.partition(" ")
    if m := _GROUP_WAIT.search(text):
        return Op("group_wait", (), (), max_groups=int(m.group(1), 16))
    if opcode.startswith("BAR.SYNC"):
        return Op("bar", (), ())
    if m := _CP_WAIT.match(text):
        return Op("cp_wait", (), (), max_groups=int(m.group(1), 16))
    if opcode == "LDGDEPBAR":
        return Op("cp_commit", (), ())
    first, _, rest = operands.partition(",")
    regs = [int(r) for r in _REG.findall(operands)]
    dst_reg = re.fullmatch(r"\s*R(\d+)\s*", first)
    srcs = tuple(int(r) for r in _REG.findall(rest)) if dst_reg else tuple(regs)
    if opcode.startswith("HGMMA"):
        shape = _HGMMA_SHAPE.match(opcode)
        flops = 2 * int(shape[1]) * int(shape[2]) * int(shape[3]) if shape else 0
        return Op("hgmma", (), srcs, ends_group="gsb0" in rest, flops=flops)
    if opcode.startswith("LDGSTS"):  # [shared], [global]: the global address registers are read
        width = _WIDTH.search(opcode)
        return Op("cp_async", (), tuple(regs), bytes=int(width.group(1)) // 8 if width else 4)
    if opcode.startswith("LDL") and dst_reg:
        width = _WIDTH.search(opcode)
        n = int(width.group(1)) // 32 if width else 1
        return Op("ldl", tuple(range(int(dst_reg.group(1)), int(dst_reg.group(1)) + n)), srcs)
    if opcode.startswith(("HMMA", "MUFU.EX2")) and dst_reg:
        base = int(dst_reg.group(1))
        width = (4 if ".F32" in opcode else 2) if opcode.startswith("HMMA") else 1
        return Op("hmma" if opcode.startswith("HMMA") else "ex2", tuple(range(base, base + width)), srcs)
    return Op("other", (), srcs)


def _wait(t: float, done: list[float], allowed: int) -> float:
    """When issue may go on past a wait for at most ``allowed`` unfinished groups of ``done``
    (completion times, in commit order, each later than the one before)."""
    unfinished = [g for g in done if g > t]
    return unfinished[len(unfinished) - allowed - 1] if len(unfinished) > allowed else t


def _pass(ops: Sequence[Op], state: dict, mma_clocks: Sequence[float], costs: dict) -> None:
    """Replay one pass of the body, advancing ``state`` (times in clocks); ``mma_clocks``:
    the tensor-core clocks of each op (0 for all but MMAs); ``costs``: issue and exp2
    clocks, and with memory the port's bytes a clock, a cp.async byte's multiplier (the
    threads of the CTA) and the latencies (``None``: memory left out)."""
    ready, groups, cp = state["ready"], state["groups"], state["cp"]
    memory = costs["port"] is not None
    for op, mma_t in zip(ops, mma_clocks, strict=True):
        t = max([state["t"]] + [ready[r] for r in op.src if r in ready])
        if op.kind == "group_wait":
            t = _wait(t, groups, op.max_groups)
        elif op.kind == "cp_wait" and memory:
            t = _wait(t, cp, op.max_groups)
        state["t"] = t + costs["issue"]
        if op.kind in ("hgmma", "hmma"):
            state["tc"] = max(t, state["tc"]) + mma_t
            if op.ends_group:
                groups.append(state["tc"])
            for r in op.dst:
                ready[r] = state["tc"]
        elif op.kind == "ex2":
            state["mufu"] = max(t, state["mufu"]) + costs["ex2"]
            for r in op.dst:
                ready[r] = state["mufu"]
        elif memory and op.kind == "cp_async":
            state["open"] += op.bytes * costs["threads"]
        elif memory and op.kind == "cp_commit":  # the group crosses the port after the ones before
            state["port"] = max(state["port"], t) + state["open"] / costs["port"]
            state["open"] = 0
            cp.append(state["port"] + costs["l2_latency"])
        elif memory and op.kind == "ldl":
            for r in op.dst:
                ready[r] = t + costs["local_latency"]
    state["groups"] = [g for g in groups if g > state["t"]]
    state["cp"] = [g for g in cp if g > state["t"]]


def local_latency(*, stack_frame: int, threads: int, shared: int, ctas_per_sm: int) -> float:
    """Latency of a spilled value read back (``LDL``): L1's when the resident CTAs' local
    memory (``stack_frame`` bytes a thread) fits in the L1 that their shared memory leaves
    (``L1_BYTES`` less ``shared`` + 1 KB a CTA), else L2's."""
    left = L1_BYTES - ctas_per_sm * (shared + 1024)
    return L1_LATENCY if stack_frame * threads * ctas_per_sm <= left else L2_LATENCY


def _replay(ops: Sequence[Op], mma_clocks: Sequence[float], costs: dict) -> float:
    state: dict = {"t": 0.0, "tc": 0.0, "mufu": 0.0, "ready": {}, "groups": [], "cp": [], "port": 0.0,
                   "open": 0}
    ends = []
    for _ in range(PASSES):
        _pass(ops, state, mma_clocks, costs)
        ends.append(state["t"])
    return (ends[-1] - ends[-3]) / 2


def tile_clocks(body: Sequence[Instr], *, block_m: int, block_n: int, dim: int, num_warps: int, mma: str,
                ctas_per_sm: int = 1, memory: bool = True, local_latency: float = L1_LATENCY) -> dict:
    """Clocks of one SM per key tile under this model, and what bounds them.

    ``memory``: with the cp.async round trips, the L2 port and spill reloads (the module
    docstring); False: the model before run 3 (memory costs only issue).
    ``local_latency``: clocks of an ``LDL`` (:func:`local_latency`).

    Returns ``clocks`` (SM clocks per tile), ``period`` (one CTA's clocks per pass),
    ``period_without_memory``, ``units`` (clocks each unit is busy per tile: mma, issue,
    ex2, and l2: the K/V bytes cp.async moves through the SM's L2 port), ``l2_bytes``
    (a pass's, one CTA), ``waits`` (group waits, cp.async waits and CTA barriers per pass),
    ``bound`` (the busiest unit when it sets the pace, else ``"memory round trip"`` when
    the memory waits lengthen the pass, else ``"mma+softmax serialised"``),
    ``peak_fraction`` (wgmma-rate clocks over ``clocks``), ``tflops`` on an H100 SXM, and
    ``peak_fraction_without_memory`` (the same loop under the model before run 3).
    """
    ops = [decode(i.text) for i in body]
    n_mma = sum(op.kind in ("hgmma", "hmma") for op in ops)
    flops = 4 * block_m * block_n * dim
    per_mma = flops / MMA_FLOP_PER_CLOCK[mma] / n_mma if n_mma else 0.0
    warpgroups = max(1, num_warps // 4)
    shaped = all(op.flops for op in ops if op.kind == "hgmma")
    by_shape = [op.flops * warpgroups / MMA_FLOP_PER_CLOCK[mma] if shaped else per_mma for op in ops]
    mma_clocks = [by_shape[i] if op.kind == "hgmma" else per_mma if op.kind == "hmma" else 0.0
                  for i, op in enumerate(ops)]
    costs = {"issue": num_warps / SCHEDULERS, "ex2": num_warps * 32 / EX2_PER_CLOCK, "port": None,
             "threads": 32 * num_warps, "l2_latency": L2_LATENCY, "local_latency": local_latency}
    plain = _replay(ops, mma_clocks, costs)
    period = _replay(ops, mma_clocks, dict(costs, port=L2_BYTES_PER_CLOCK / ctas_per_sm)) if memory else plain
    l2_bytes = sum(op.bytes for op in ops if op.kind == "cp_async") * costs["threads"]
    units = {"mma": sum(mma_clocks), "issue": len(ops) * costs["issue"],
             "ex2": sum(op.kind == "ex2" for op in ops) * costs["ex2"]}
    if memory:
        units["l2"] = l2_bytes / L2_BYTES_PER_CLOCK
    without = max(plain / ctas_per_sm, *(v for k, v in units.items() if k != "l2"))  # the model before
    busiest = max(units, key=units.get)
    clocks = max(period / ctas_per_sm, units[busiest])
    bound = (busiest if clocks <= units[busiest] * 1.0001 else
             "memory round trip" if period > plain * 1.0001 else "mma+softmax serialised")
    fraction = flops / MMA_FLOP_PER_CLOCK["wgmma"] / clocks
    return {"clocks": round(clocks, 1), "period": round(period, 1), "period_without_memory": round(plain, 1),
            "units": {k: round(v, 1) for k, v in units.items()}, "l2_bytes": l2_bytes,
            "waits": {"group_wait": sum(op.kind == "group_wait" for op in ops),
                      "cp_wait": sum(op.kind == "cp_wait" for op in ops),
                      "bar_sync": sum(op.kind == "bar" for op in ops)},
            "bound": bound, "peak_fraction": round(fraction, 4), "tflops": round(fraction * PEAK_TFLOPS, 1),
            "peak_fraction_without_memory": round(flops / MMA_FLOP_PER_CLOCK["wgmma"] / without, 4)}

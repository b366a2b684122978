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
- memory is left out: the cp.async waits (``DEPBAR.LE SB0``) and loads cost only issue.

The body runs ``PASSES`` times; its clocks per tile are the period of the last passes.
With ``c`` CTAs resident on an SM, one CTA's waits are filled by the others' work, so
the SM spends ``max(period / c, busiest unit)`` clocks per tile.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from kernel_static import EX2_PER_CLOCK, MMA_FLOP_PER_CLOCK, PEAK_TFLOPS, SCHEDULERS, Instr

PASSES = 8
_REG = re.compile(r"\bR(\d+)\b")
_GROUP_WAIT = re.compile(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x([0-9a-f]+)")
_HGMMA_SHAPE = re.compile(r"HGMMA\.(\d+)x(\d+)x(\d+)\.")


@dataclass(frozen=True)
class Op:
    """One instruction as the model sees it."""

    kind: str  # "hgmma", "hmma", "ex2", "group_wait", "bar", "other"
    dst: tuple[int, ...]  # registers an HMMA or MUFU writes
    src: tuple[int, ...]  # registers it reads
    ends_group: bool = False  # an HGMMA that commits its wgmma group (gsb0)
    max_groups: int = 0  # group_wait: unfinished groups allowed
    flops: int = 0  # an HGMMA's FLOPs per warpgroup (2 * M * N * K)


def decode(text: str) -> Op:
    """The model's view of one SASS instruction (predicate stripped)."""
    text = re.sub(r"^@!?U?P\w+\s+", "", text.strip())
    opcode, _, operands = text.partition(" ")
    if m := _GROUP_WAIT.search(text):
        return Op("group_wait", (), (), max_groups=int(m.group(1), 16))
    if opcode.startswith("BAR.SYNC"):
        return Op("bar", (), ())
    first, _, rest = operands.partition(",")
    regs = [int(r) for r in _REG.findall(operands)]
    dst_reg = re.fullmatch(r"\s*R(\d+)\s*", first)
    srcs = tuple(int(r) for r in _REG.findall(rest)) if dst_reg else tuple(regs)
    if opcode.startswith("HGMMA"):
        shape = _HGMMA_SHAPE.match(opcode)
        flops = 2 * int(shape[1]) * int(shape[2]) * int(shape[3]) if shape else 0
        return Op("hgmma", (), srcs, ends_group="gsb0" in rest, flops=flops)
    if opcode.startswith(("HMMA", "MUFU.EX2")) and dst_reg:
        base = int(dst_reg.group(1))
        width = (4 if ".F32" in opcode else 2) if opcode.startswith("HMMA") else 1
        return Op("hmma" if opcode.startswith("HMMA") else "ex2", tuple(range(base, base + width)), srcs)
    return Op("other", (), srcs)


def _pass(ops: Sequence[Op], state: dict, mma_clocks: Sequence[float], issue: float, ex2: float) -> None:
    """Replay one pass of the body, advancing ``state`` (times in clocks); ``mma_clocks``:
    the tensor-core clocks of each op (0 for all but MMAs)."""
    ready, groups = state["ready"], state["groups"]
    for op, mma_t in zip(ops, mma_clocks, strict=True):
        t = max([state["t"]] + [ready[r] for r in op.src if r in ready])
        if op.kind == "group_wait":
            unfinished = [g for g in groups if g > t]
            if len(unfinished) > op.max_groups:
                t = unfinished[len(unfinished) - op.max_groups - 1]
        state["t"] = t + issue
        if op.kind in ("hgmma", "hmma"):
            state["tc"] = max(t, state["tc"]) + mma_t
            if op.ends_group:
                groups.append(state["tc"])
            for r in op.dst:
                ready[r] = state["tc"]
        elif op.kind == "ex2":
            state["mufu"] = max(t, state["mufu"]) + ex2
            for r in op.dst:
                ready[r] = state["mufu"]
    state["groups"] = [g for g in groups if g > state["t"]]


def tile_clocks(body: Sequence[Instr], *, block_m: int, block_n: int, dim: int, num_warps: int, mma: str,
                ctas_per_sm: int = 1) -> dict:
    """Clocks of one SM per key tile under this model, and what bounds them.

    Returns ``clocks`` (SM clocks per tile), ``period`` (one CTA's clocks per pass),
    ``units`` (clocks each unit is busy per tile: mma, issue, ex2), ``waits`` (group waits
    and CTA barriers per pass), ``bound`` (the busiest unit when it sets the pace, else
    ``"mma+softmax serialised"`` when the waits do), ``peak_fraction`` (wgmma-rate clocks
    over ``clocks``) and ``tflops`` on an H100 SXM.
    """
    ops = [decode(i.text) for i in body]
    n_mma = sum(op.kind in ("hgmma", "hmma") for op in ops)
    flops = 4 * block_m * block_n * dim
    issue, ex2 = num_warps / SCHEDULERS, num_warps * 32 / EX2_PER_CLOCK
    per_mma = flops / MMA_FLOP_PER_CLOCK[mma] / n_mma if n_mma else 0.0
    warpgroups = max(1, num_warps // 4)
    shaped = all(op.flops for op in ops if op.kind == "hgmma")
    by_shape = [op.flops * warpgroups / MMA_FLOP_PER_CLOCK[mma] if shaped else per_mma for op in ops]
    mma_clocks = [by_shape[i] if op.kind == "hgmma" else per_mma if op.kind == "hmma" else 0.0
                  for i, op in enumerate(ops)]
    state: dict = {"t": 0.0, "tc": 0.0, "mufu": 0.0, "ready": {}, "groups": []}
    ends = []
    for _ in range(PASSES):
        _pass(ops, state, mma_clocks, issue, ex2)
        ends.append(state["t"])
    period = (ends[-1] - ends[-3]) / 2
    units = {"mma": sum(mma_clocks), "issue": len(ops) * issue,
             "ex2": sum(op.kind == "ex2" for op in ops) * ex2}
    busiest = max(units, key=units.get)
    clocks = max(period / ctas_per_sm, units[busiest])
    bound = busiest if clocks <= units[busiest] * 1.0001 else "mma+softmax serialised"
    fraction = flops / MMA_FLOP_PER_CLOCK["wgmma"] / clocks
    return {"clocks": round(clocks, 1), "period": round(period, 1),
            "units": {k: round(v, 1) for k, v in units.items()},
            "waits": {"group_wait": sum(op.kind == "group_wait" for op in ops),
                      "bar_sync": sum(op.kind == "bar" for op in ops)},
            "bound": bound, "peak_fraction": round(fraction, 4), "tflops": round(fraction * PEAK_TFLOPS, 1)}

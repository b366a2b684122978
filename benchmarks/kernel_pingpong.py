"""The serial model of ``kernel_timing.py`` for a warp-specialised kernel: two consumer
warpgroups, each its own loop in the SASS, replayed side by side on one SM.

Helper of ``gluon_pingpong.py``. ``kernel_timing.tile_clocks`` replays one loop body whose
warps all run in lockstep; in a warp-specialised kernel each consumer warpgroup runs its
own copy of the loop (the default partition's and a worker's), and they meet only at
mbarriers. This replay keeps that model's rules for each warpgroup (an instruction issues
when its sources are ready; ``WARPGROUP.DEPBAR.LE gsb0, N`` waits for the warpgroup's own
wgmma groups; an ``HGMMA`` is charged ``2 * M * N * K / 4096`` clocks of the tensor core,
which runs the MMAs of both warpgroups one after another in issue order; a ``MUFU.EX2``
holds the MUFU ``4 * 32 / 16`` clocks) and shares the units between the two:

- issue: each instruction of a warpgroup takes one clock of the SM's 4 schedulers (4 warps,
  one on each); the two warpgroups' instructions take turns, the one that can issue
  earliest first;
- mbarriers (``SYNCS.PHASECHK.TRANS64.TRYWAIT`` waits, ``SYNCS.ARRIVE`` arrivals), named by
  the immediate offset of their address (a ring of barriers indexed by stage has one
  name): a barrier one loop waits on and the other arrives on is a *turn*: each arrival
  lets one wait of the other pass, in order (the first loop's first turn is free: its
  barrier starts in the passed phase); a barrier waited on and arrived on by neither
  loop is a *data* barrier, filled by the producer (TMA): pass p waits for key tile p + 1
  (the loop starts at tile 1); a barrier the loops arrive on and never wait on *releases*
  a ring buffer: pass p of both loops frees tile p's buffer;
- memory: the producer loads tile k as soon as tile k - stages is released by both
  loops (the first ``stages`` at once); its bytes cross the SM's L2 port after the tiles
  before it at ``L2_BYTES_PER_CLOCK`` and it lands ``L2_LATENCY`` later
  (``kernel_timing``'s constants). The producer's own instructions are not counted.

The tile's clocks are the period of the last passes (both warpgroups, ``2 * rows`` query
rows); ``peak_fraction`` is the tile's wgmma clocks over them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from kernel_static import EX2_PER_CLOCK, MMA_FLOP_PER_CLOCK, PEAK_TFLOPS, SCHEDULERS, Instr
from kernel_timing import L2_BYTES_PER_CLOCK, L2_LATENCY, Op, decode

PASSES = 12
# Result latencies (clocks from issue to a dependent issue) for the replay with latencies
# (``latency=True``), by opcode prefix: assumed, not measured here (microbenchmarks of
# Volta-Ampere put dependent FP32/INT issue at about 4 clocks and warp shuffles at 20-30;
# MUFU's here adds to its unit time). kernel_timing's model has none.
LATENCY = {"SHFL": 24.0, "MUFU": 20.0, "": 4.0}
_DST = re.compile(r"R(\d+)")
SMEM_BYTES_PER_CLOCK = 128  # shared memory, per SM (not in kernel_timing's model: stated apart)
_HGMMA_OPERANDS = re.compile(r"HGMMA\.(\d+)x(\d+)x(\d+)\.\S+\s+R\d+,\s*(\S+)")
_MBAR = re.compile(r"^SYNCS\.(PHASECHK\.TRANS64\.TRYWAIT|ARRIVE\.\S+)\s.*?\[[^\]]*?(0x[0-9a-f]+)\]")
WARPS = 4  # a consumer warpgroup


def mbarrier_op(text: str) -> tuple[str, int] | None:
    """``("wait" | "arrive", offset)`` of an mbarrier instruction, else None."""
    m = _MBAR.match(re.sub(r"^@!?U?P\w+\s+", "", text.strip()))
    if not m:
        return None
    return ("wait" if m.group(1).startswith("PHASECHK") else "arrive"), int(m.group(2), 16)


def smem_bytes(text: str) -> int:
    """Shared-memory bytes an ``HGMMA`` reads (16-bit operands): B always, A too when it
    comes from shared memory (``gdesc``) rather than registers."""
    m = _HGMMA_OPERANDS.search(text)
    if not m:
        return 0
    rows, cols, depth = int(m.group(1)), int(m.group(2)), int(m.group(3))
    return 2 * (cols * depth + (rows * depth if m.group(4).startswith("gdesc") else 0))


def producer_loop(sass: str) -> list[Instr]:
    """The innermost loop holding TMA loads (``UTMALDG``): the producer's; [] if none."""
    from kernel_static import _BRANCH, parse

    instrs, labels = parse(sass)
    spans = [(labels[m.group(1)], i.addr) for i in instrs if (m := _BRANCH.search(i.text))
             and labels.get(m.group(1), i.addr + 1) <= i.addr]
    bodies = [[i for i in instrs if a <= i.addr <= b] for a, b in spans]
    bodies = [b for b in bodies if any("UTMALDG" in i.text for i in b)]
    return min(bodies, key=len, default=[])


def innermost(bodies: Sequence[Sequence[Instr]]) -> list[Sequence[Instr]]:
    """The loops of ``kernel_static.loops`` that hold no other: a warp-specialised kernel's
    partition dispatch and its out-of-line mbarrier spins branch back over whole partitions."""
    def inside(a: Sequence[Instr], b: Sequence[Instr]) -> bool:
        return a is not b and b[0].addr <= a[0].addr and a[-1].addr <= b[-1].addr

    return [b for b in bodies if not any(inside(a, b) for a in bodies)]


def roles(bodies: Sequence[Sequence[Instr]]) -> dict[int, str]:
    """Each barrier offset's role: ``turn``, ``data`` or ``release`` (module docstring)."""
    def named(body: Sequence[Instr], kind: str) -> set[int]:
        return {m[1] for i in body if (m := mbarrier_op(i.text)) and m[0] == kind}

    waits, arrives = [named(b, "wait") for b in bodies], [named(b, "arrive") for b in bodies]
    out = {}
    for b in set().union(*waits, *arrives):
        if any(b in w and b in a for w, a in zip(waits, arrives, strict=True)):
            raise ValueError(f"barrier {b:#x} is waited on and arrived on by one loop: not a ping-pong")
        if any(b in waits[k] and b in arrives[1 - k] for k in (0, 1)):
            out[b] = "turn"
        elif not any(b in a for a in arrives):
            out[b] = "data"
        elif not any(b in w for w in waits):
            out[b] = "release"
        else:
            raise ValueError(f"barrier {b:#x} is waited on by both loops, arrived on by one: not a ping-pong")
    return out


def result_latency(text: str) -> tuple[tuple[int, ...], float]:
    """Registers an ALU, shuffle or MUFU instruction writes and their latency
    (:data:`LATENCY`); ``((), 0)`` for others (MMAs, barriers, waits, branches, stores)."""
    body = re.sub(r"^@!?U?P\w+\s+", "", text.strip())
    opcode, _, operands = body.partition(" ")
    if opcode.startswith(("HGMMA", "HMMA", "WARPGROUP", "BAR", "SYNCS", "BRA", "ST", "DEPBAR", "U")):
        return (), 0.0
    fields = operands.split(",")
    dst = fields[1 if opcode.startswith("SHFL") else 0].strip() if len(fields) > 1 else ""  # SHFL: P, R, ..
    if not (m := _DST.fullmatch(dst)):
        return (), 0.0
    n, wide = int(m.group(1)), ".64" in opcode or ".WIDE" in opcode
    return ((n, n + 1) if wide else (n,)), next(v for k, v in LATENCY.items() if opcode.startswith(k))


class _Stream:
    """One warpgroup's replay state."""

    def __init__(self, body: Sequence[Instr]):
        self.ops: list[Op] = [decode(i.text) for i in body]
        self.results = [result_latency(i.text) for i in body]
        self.mbar = [mbarrier_op(i.text) for i in body]
        self.pc, self.passes, self.t = 0, 0, 0.0
        self.ready: dict[int, float] = {}
        self.groups: list[float] = []
        self.turns_waited: dict[int, int] = {}
        self.ends: list[float] = []


def pingpong_clocks(bodies: Sequence[Sequence[Instr]], *, rows: int, block_n: int, dim: int, stages: int,
                    tile_bytes: int, producer: Sequence[Instr] = (), issue_scale: float = 1.0,
                    latency: bool = False, passes: int = PASSES) -> dict:
    """Clocks of one key tile (both warpgroups) under the model above, and what bounds them.

    ``bodies``: the two consumer loops (first: the one whose turn comes first); ``rows``:
    query rows of one warpgroup; ``tile_bytes``: K and V bytes of one key tile; ``producer``:
    the producer's loop (one warp: its instructions add a quarter clock each to the issue
    unit, not to the replay). ``smem`` (the HGMMA operands read from shared memory and the
    tile's K/V written into it, at ``SMEM_BYTES_PER_CLOCK``) is reported beside the model,
    and ``peak_fraction_with_smem`` takes it as one more unit. ``issue_scale``: clocks an
    instruction holds the schedulers, in units of the model's one (a sensitivity knob: the
    model has no ALU or shuffle latencies, so a real pass issues slower than it says);
    ``latency``: a result is ready :data:`LATENCY` clocks after its instruction issues
    (kernel_timing's model: when issued)."""
    if len(bodies) != 2:
        raise ValueError(f"a ping-pong has two consumer loops, got {len(bodies)}")
    role = roles(bodies)
    streams = [_Stream(b) for b in bodies]
    issue, ex2 = WARPS / SCHEDULERS * issue_scale, WARPS * 32 / EX2_PER_CLOCK
    shared = {"issue": 0.0, "tc": 0.0, "mufu": 0.0, "port": 0.0}
    tokens: dict[int, list[float]] = {b: [] for b, r in role.items() if r == "turn"}
    first_turn = next(b for i in bodies[0] if (m := mbarrier_op(i.text)) and m[0] == "wait"
                      and role[m[1]] == "turn" for b in [m[1]])
    tokens[first_turn].append(0.0)
    released: dict[int, list[float]] = {}  # tile -> release times of the loops so far
    landed: dict[int, float] = {}

    def land(k: int) -> float | None:
        """When tile k is in shared memory (None: its buffer is not released yet)."""
        while len(landed) <= k:
            n = len(landed)
            start = 0.0
            if n >= stages:
                rel = released.get(n - stages, [])
                if len(rel) < 2:
                    return None
                start = max(rel)
            shared["port"] = max(shared["port"], start) + tile_bytes / L2_BYTES_PER_CLOCK
            landed[n] = shared["port"] + L2_LATENCY
        return landed[k]

    def earliest(s: _Stream) -> float | None:
        op, mb = s.ops[s.pc], s.mbar[s.pc]
        t = max([s.t, shared["issue"]] + [s.ready[r] for r in op.src if r in s.ready])
        if op.kind == "group_wait":
            unfinished = [g for g in s.groups if g > t]
            if len(unfinished) > op.max_groups:
                t = unfinished[len(unfinished) - op.max_groups - 1]
        if mb and mb[0] == "wait" and role[mb[1]] == "turn":
            n = s.turns_waited.get(mb[1], 0)
            if len(tokens[mb[1]]) <= n:
                return None
            t = max(t, tokens[mb[1]][n])
        elif mb and mb[0] == "wait":
            at = land(s.passes + 1)
            if at is None:
                return None
            t = max(t, at)
        return t

    while any(s.passes < passes for s in streams):
        times = [earliest(s) if s.passes < passes else None for s in streams]
        if all(t is None for t in times):
            raise RuntimeError("the two loops wait on each other: no pass completes")
        k = min((t, k) for k, t in enumerate(times) if t is not None)[1]
        s, t = streams[k], times[k]
        op, mb = s.ops[s.pc], s.mbar[s.pc]
        s.t = shared["issue"] = t + issue
        if op.kind in ("hgmma", "hmma"):
            shared["tc"] = max(t, shared["tc"]) + op.flops / MMA_FLOP_PER_CLOCK["wgmma"]
            if op.ends_group:
                s.groups.append(shared["tc"])
        elif op.kind == "ex2":
            shared["mufu"] = max(t, shared["mufu"]) + ex2
            for r in op.dst:
                s.ready[r] = shared["mufu"]
        if latency:
            regs, lat = s.results[s.pc]
            for r in regs:
                s.ready[r] = max(s.ready.get(r, 0.0), t + lat)
        if mb and mb[0] == "wait" and role[mb[1]] == "turn":
            s.turns_waited[mb[1]] = s.turns_waited.get(mb[1], 0) + 1
        elif mb and mb[0] == "arrive" and role[mb[1]] == "turn":
            tokens[mb[1]].append(t)
        elif mb and mb[0] == "arrive":
            released.setdefault(s.passes, []).append(t)
        s.pc += 1
        if s.pc == len(s.ops):
            s.pc, s.passes = 0, s.passes + 1
            s.ends.append(s.t)
            s.groups = [g for g in s.groups if g > s.t]

    period = max((s.ends[-1] - s.ends[-5]) / 4 for s in streams)
    flops = 4 * 2 * rows * block_n * dim
    ops = [op for s in streams for op in s.ops]
    units = {"mma": sum(op.flops for op in ops if op.kind == "hgmma") / MMA_FLOP_PER_CLOCK["wgmma"],
             "issue": len(ops) * issue + len(producer) / SCHEDULERS,
             "ex2": sum(op.kind == "ex2" for op in ops) * ex2, "l2": tile_bytes / L2_BYTES_PER_CLOCK}
    clocks = max(period, *units.values())
    smem = (sum(smem_bytes(i.text) for body in bodies for i in body) + tile_bytes) / SMEM_BYTES_PER_CLOCK
    busiest = max(units, key=units.get)
    fraction = flops / MMA_FLOP_PER_CLOCK["wgmma"] / clocks
    return {"clocks": round(clocks, 1), "period": round(period, 1),
            "units": {k: round(v, 1) for k, v in units.items()},
            "bound": busiest if clocks <= units[busiest] * 1.0001 else "waits",
            "roles": {f"{b:#x}": r for b, r in sorted(role.items())},
            "instructions": [len(s.ops) for s in streams], "peak_fraction": round(fraction, 4),
            "tflops": round(fraction * PEAK_TFLOPS, 1), "smem": round(smem, 1),
            "peak_fraction_with_smem": round(flops / MMA_FLOP_PER_CLOCK["wgmma"] / max(clocks, smem), 4)}

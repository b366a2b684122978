"""Static reading of a compiled kernel: ``ptxas -v`` resources, occupancy, pipelined loads in
the TTGIR, and what the main loops cost in the SASS: instructions per key tile, MMA and
exp2 instructions, and a first-principles cycle estimate per tile on an H100.

Helper of ``compile_kernels.py`` (imports nothing of the other benchmarks). The SASS comes
from the ``nvdisasm`` that ships in triton's NVIDIA backend (``nvdisasm -c -gi``: code only,
with the source line each instruction came from and the line it was inlined at).

A loop is a backward branch: ``BRA`` to a label at a lower address; its body runs from
the label to the branch. The attention kernel's key loops are the loops holding MMA
instructions; each is named by the ``# Phase k`` comment above the call site its
instructions were inlined at (``_attend_tile`` is inlined into each phase's loop).
"""

from __future__ import annotations

import collections
import contextlib
import io
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

# Hopper limits (CUDA C Programming Guide, compute capability 9.0).
MAX_REGS_PER_THREAD, REGS_PER_SM, MAX_WARPS_PER_SM, MAX_BLOCKS_PER_SM = 255, 65536, 64, 32
SMEM_PER_SM, SMEM_PER_BLOCK, SMEM_RESERVED_PER_BLOCK = 228 * 1024, 227 * 1024, 1024

# H100 SXM5 (132 SMs, 1830 MHz boost): 989.4 dense bf16/fp16 TFLOP/s = 4096 FLOP per clock
# per SM through wgmma. mma.sync is the Ampere instruction, which on Hopper reaches about
# half of that (an assumption of this model, not a measurement); fp32 without MMA runs on
# the FMA pipes, 128 FMA per clock per SM. exp2 (MUFU.EX2): 16 per clock per SM (CUDA C
# Programming Guide, arithmetic instruction throughput, cc 9.0). Issue: 4 schedulers per
# SM, one warp instruction each per clock.
H100_SMS, H100_CLOCK_HZ = 132, 1.83e9
SM90 = ("cuda", 90, 32)  # GPUTarget of an ahead-of-time Hopper compile
MMA_FLOP_PER_CLOCK = {"wgmma": 4096, "mma.sync": 2048, "none": 256}
EX2_PER_CLOCK, SCHEDULERS = 16, 4
PEAK_TFLOPS = MMA_FLOP_PER_CLOCK["wgmma"] * H100_SMS * H100_CLOCK_HZ / 1e12

_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_BRANCH = re.compile(r"\bBRA\s+`\((\.L_x_\d+)\)")
_WHERE = re.compile(r'File "([^"]+)", line (\d+)(?: inlined at "([^"]+)", line (\d+))?')
_MMA = re.compile(r"\b(HGMMA|HMMA)\.")


# ptxas's "Potential Performance Loss" notes that it serialised the wgmma instructions
# (C7510-C7515: a wait after each one, so no MMA overlaps anything), with their reason.
_WGMMA_SERIAL = re.compile(r"\((C751\d)\) Potential Performance Loss: wgmma\.mma_async instructions are "
                           r"serialized due to (.*)$", re.M)
_FUNCTION = re.compile(r"\s*(?:(?:in |for )?(?:the function )?'[^']*'|in line \d+)")  # where: dropped


def parse_ptxas(log: str) -> dict:
    """Registers, spill bytes and stack frame from a ``ptxas -v`` log, and
    ``wgmma_serialized``: ptxas's notes that it serialised the wgmma instructions
    (``"C7511: insufficient register resources for the wgmma pipeline"``; empty when none)."""
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if not regs or not spill:
        raise RuntimeError(f"no resource usage in the ptxas log:\n{log[-2000:]}")
    stack, stores, loads = map(int, spill.groups())
    serial = sorted({f"{code}: {_FUNCTION.sub('', why).strip(' .')}"
                     for code, why in _WGMMA_SERIAL.findall(log)})
    return {"n_regs": int(regs.group(1)), "n_spills": stores + loads, "spill_stores": stores,
            "spill_loads": loads, "stack_frame": stack, "wgmma_serialized": serial}


_TILE = r"tensor<\d+x\d+x"  # a 2-D (tile) operand; block-table and q loads are 1-D or outside loops
_LOOP_LOADS = {"async": re.compile(r"ttg\.async_copy_global_to_local .*: " + _TILE),
               "tma": re.compile(r"ttng\.async_tma_copy_global_to_local"),
               "sync": re.compile(r"= tt\.load .*: " + _TILE)}


def loop_loads(ttgir: str) -> dict:
    """2-D loads inside ``scf.for`` bodies of the TTGIR, by kind.

    Triton's software pipeliner turns a loop's ``tt.load`` of a ``tl.dot`` operand into
    ``ttg.async_copy_global_to_local`` (``cp.async``) issued in an earlier iteration, or
    into a TMA copy; a load it leaves alone stays ``tt.load`` (issued and awaited in its
    own iteration). Regions open on a line ending in ``{`` and close on one starting
    with ``}``, so a stack of open regions tells whether a line is inside a loop.
    """
    counts, regions = dict.fromkeys(_LOOP_LOADS, 0), []
    for line in ttgir.splitlines():
        text = line.strip()
        if text.startswith("}") and regions:
            regions.pop()
        if "for" in regions:
            for kind, pattern in _LOOP_LOADS.items():
                counts[kind] += bool(pattern.search(text))
        if text.endswith("{"):
            regions.append("for" if "scf.for" in text else "other")
    return counts


def occupancy(n_regs: int, num_warps: int, shared: int) -> int:
    """Resident blocks per SM (estimate, occupancy-calculator rules for cc 9.0): registers
    go per warp in units of 256, each block also reserves 1 KiB of shared memory."""
    per_warp = -(-n_regs * 32 // 256) * 256
    by_regs = (REGS_PER_SM // per_warp) // num_warps
    by_smem = SMEM_PER_SM // (shared + SMEM_RESERVED_PER_BLOCK)
    return min(by_regs, by_smem, MAX_WARPS_PER_SM // num_warps, MAX_BLOCKS_PER_SM)


@dataclass(frozen=True)
class Instr:
    addr: int
    text: str
    where: tuple[str, int] | None  # (file, line): the call site for inlined code


def nvdisasm() -> Path:
    """The ``nvdisasm`` shipped in triton's NVIDIA backend folder."""
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    if not path.exists():
        raise FileNotFoundError(f"no nvdisasm at {path}")
    return path


def disassemble(cubin: bytes) -> str:
    """SASS of a cubin with line info (``nvdisasm -c -gi``)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(nvdisasm()), "-c", "-gi", f.name], capture_output=True, text=True,
                              check=True).stdout


def parse(sass: str) -> tuple[list[Instr], dict[str, int]]:
    """Instructions in address order, and each label's address."""
    instrs, labels, pending, where = [], {}, [], None
    for line in sass.splitlines():
        if m := _LABEL.match(line.strip()):
            pending.append(m.group(1))
        elif "//##" in line:
            if m := _WHERE.search(line):  # the call site of inlined code, else the line itself
                where = (m.group(3), int(m.group(4))) if m.group(3) else (m.group(1), int(m.group(2)))
        elif m := _INSTR.match(line):
            addr = int(m.group(1), 16)
            for name in pending:
                labels[name] = addr
            pending = []
            instrs.append(Instr(addr, m.group(2), where))
    return instrs, labels


def loops(sass: str) -> list[list[Instr]]:
    """Bodies of the loops (label .. backward branch) that hold MMA instructions, by address.

    A backward branch that enters another loop's body from outside it is no loop: ptxas
    places the slow path of a ``BRA.DIV`` (a shuffle's divergence check) after the kernel's
    code, and its branch back lands inside the loop it came from. Such spans, which overlap
    a loop without nesting in it or holding it, are left out.
    """
    instrs, labels = parse(sass)
    spans = []
    for ins in instrs:
        m = _BRANCH.search(ins.text)
        if m and labels.get(m.group(1), ins.addr + 1) <= ins.addr:
            spans.append((labels[m.group(1)], ins.addr))

    def crosses(a: tuple[int, int], b: tuple[int, int]) -> bool:
        return b[0] < a[0] <= b[1] < a[1]  # a starts inside b and ends past it

    bodies = []
    for span in spans:
        if any(crosses(span, other) for other in spans):
            continue
        body = [i for i in instrs if span[0] <= i.addr <= span[1]]
        if any(_MMA.search(i.text) for i in body):
            bodies.append(body)
    return bodies


def phase_lines(source: Path) -> list[tuple[int, int]]:
    """(line, k) of each ``# Phase k`` comment of a kernel source, in order."""
    out = []
    for n, line in enumerate(source.read_text().splitlines(), 1):
        if m := re.match(r"\s*# Phase (\d+)", line):
            out.append((n, int(m.group(1))))
    return out


def phase_of(body: list[Instr], source: Path) -> int | None:
    """The phase whose call site most of the loop's inlined instructions came from (None
    when the line info names no call site in ``source``: triton 3.6 keeps only the
    innermost line of code inlined twice)."""
    marks = phase_lines(source)
    votes = collections.Counter()
    for i in body:
        if i.where and Path(i.where[0]).name == source.name:
            k = [p for line, p in marks if line <= i.where[1]]
            if k:
                votes[k[-1]] += 1
    return votes.most_common(1)[0][0] if votes else None


def tile_counts(body: list[Instr]) -> dict:
    """Instructions of one pass of a loop body: all, MMA, exp2 (MUFU.EX2), global loads."""
    return {"instructions": len(body), "mma": sum(bool(_MMA.search(i.text)) for i in body),
            "ex2": sum("MUFU.EX2" in i.text for i in body),
            "cp_async": sum("LDGSTS" in i.text for i in body),
            "ldg": sum(" LDG" in f" {i.text}" for i in body)}


def cycle_estimate(counts: dict, *, block_m: int, block_n: int, dim: int, num_warps: int, mma: str) -> dict:
    """Clocks of one SM per key tile of one CTA, by the three bounds, and what they imply.

    mma: ``4 * block_m * block_n * dim`` FLOPs (QK^T and PV) at the MMA kind's rate;
    issue: ``instructions * num_warps / 4`` (each warp runs the body once per tile);
    ex2: ``ex2 * num_warps * 32 / 16``. The tile takes the largest; ``peak_fraction`` is
    the wgmma-rate clocks over that, i.e. the share of the H100's 989 TFLOP/s this loop
    could reach if nothing else stalled (memory, barriers, latency are left out).
    """
    flops = 4 * block_m * block_n * dim
    bounds = {"mma": flops / MMA_FLOP_PER_CLOCK[mma],
              "issue": counts["instructions"] * num_warps / SCHEDULERS,
              "ex2": counts["ex2"] * num_warps * 32 / EX2_PER_CLOCK}
    bound = max(bounds, key=bounds.get)
    fraction = flops / MMA_FLOP_PER_CLOCK["wgmma"] / bounds[bound]
    return {"clocks": {k: round(v, 1) for k, v in bounds.items()}, "bound": bound,
            "peak_fraction": round(fraction, 4), "tflops": round(fraction * PEAK_TFLOPS, 1)}


def ring_depth(ttgir: str) -> int | None:
    """Buffers of the K tile's shared-memory ring (``local_alloc`` of ``NxROWSxCOLS``)."""
    m = re.search(r"%k\w* = ttg\.local_alloc\s*:\s*\(\) -> !ttg\.memdesc<(\d+)x\d+x\d+x", ttgir)
    return int(m.group(1)) if m else None


def static_report(cubin: bytes, ttgir: str, source: Path, *, block_m: int, block_n: int, dim: int,
                  num_warps: int, mma: str, ctas_per_sm: int = 1,
                  phase_order: list[int] | None = None, resources: dict | None = None) -> dict:
    """Per phase loop: counts per tile and per 64 keys, the overlap estimate
    (:func:`cycle_estimate`) and, under ``"serial"``, the model of ``kernel_timing.py``
    that adds what the SASS serialises and the memory round trips. ``phase_order``: the
    phases whose loops the kernel has, in source order, to name the loops by when the line
    info does not; ``resources``: ``stack_frame`` and ``shared`` bytes (where a spill is
    read back from: ``kernel_timing.local_latency``; without: L1)."""
    from kernel_timing import L1_LATENCY, local_latency, tile_clocks  # it imports this module

    spill_latency = L1_LATENCY if resources is None else local_latency(
        stack_frame=resources["stack_frame"], threads=32 * num_warps, shared=resources["shared"],
        ctas_per_sm=ctas_per_sm)

    phases = {}
    bodies = loops(disassemble(cubin))
    found = [phase_of(body, source) for body in bodies]
    if None in found and phase_order is not None and len(phase_order) == len(bodies):
        found = list(phase_order)  # the loops lie in the source's phase order
    for body, phase in zip(bodies, found, strict=True):
        counts = tile_counts(body)
        key = f"phase{phase}" if phase is not None else f"loop@{body[0].addr:#x}"
        shape = dict(block_m=block_m, block_n=block_n, dim=dim, num_warps=num_warps, mma=mma)
        phases[key] = dict(counts, per_64_keys=round(counts["instructions"] * 64 / block_n, 1),
                           masked=phase != 2, **cycle_estimate(counts, **shape),
                           serial=tile_clocks(body, **shape, ctas_per_sm=ctas_per_sm,
                                              local_latency=spill_latency))
    return {"loops": phases, "kv_ring": ring_depth(ttgir)}


def causal_trips(*, prefix: int, q_len: int, group_p2: int, block_m: int, block_n: int) -> dict:
    """Key tiles one request's query tiles run in the cached-prefix loop (phase 2) and the
    diagonal loop (phase 3), summed over its query tiles of one KV head: causal, no window,
    no split, the bounds of ``_paged_prefill_kernel``. A tile holds ``block_m // group_p2``
    query positions; phase 2 runs the whole ``block_n`` tiles of keys up to the tile's
    first query, phase 3 the keys from there to its last query (the last tile may be part).
    """
    block_q = block_m // group_p2
    out = {"query_tiles": -(-q_len // block_q), "phase2": 0, "phase3": 0}
    for tile in range(out["query_tiles"]):
        first, last = prefix + tile * block_q, prefix + min(tile * block_q + block_q, q_len) - 1
        full_hi = (first + 1) // block_n * block_n
        out["phase2"] += full_hi // block_n
        out["phase3"] += -(-(last + 1 - full_hi) // block_n)
    return out


def shape_ceiling(loops: dict, trips: dict, key: str = "peak_fraction") -> float:
    """Share of peak of a shape's key loops under the serial model: the wgmma clocks of all
    its key tiles over their serial clocks, each loop weighted by its trip count (``loops``:
    :func:`static_report`'s, ``trips``: :func:`causal_trips`'s). Every tile of a shape has
    the same FLOPs, so this is the trip-weighted harmonic mean of the loops' shares.
    ``key``: which share of the serial model (``"peak_fraction_without_memory"``: the
    model before memory joined)."""
    names = [k for k in ("phase2", "phase3") if trips[k]]
    return sum(trips[k] for k in names) / sum(trips[k] / loops[k]["serial"][key] for k in names)


def compile_launch(jit_fn, args, kwargs, target_tuple=SM90):
    """Specialise a recorded launch as ``JITFunction.run`` would and compile it; no device.
    A Gluon kernel (``gluon.jit``) compiles from its own AST source (``GluonASTSource``)."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget(*target_tuple)
    backend = make_backend(target)
    kwargs = dict(kwargs, debug=False)
    binder = create_function_from_signature(jit_fn.signature, jit_fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = jit_fn._pack_args(backend, kwargs, bound, specialization, options)
    if getattr(jit_fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource  # noqa: N814
    log = io.StringIO()
    with knobs.nvidia.scope(), knobs.compilation.scope(), contextlib.redirect_stdout(log):
        knobs.nvidia.dump_ptxas_log = True  # printed only when ptxas runs ...
        knobs.compilation.always_compile = True  # ... so never take a cached cubin
        kernel = triton.compile(ASTSource(jit_fn, signature, constexprs, attrs), target=target,
                                options=options.__dict__)
    return kernel, log.getvalue()

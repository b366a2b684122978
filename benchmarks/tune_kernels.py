"""Tile tuning of the attention kernel: time TileConfig candidates per shape on a GPU.

Run ``python benchmarks/tune_kernels.py`` (CUDA), or ``--smoke``:
tiny shapes and 2-3 candidates through the Triton interpreter on a CPU, which only
proves the script works. Shapes: the SPEC prefill (8 x (8192 cached + 2048
new), 32 q / 8 kv heads, head_dim 128, bf16, block_size 16), decode (64 x 8k, q_len 1)
and split-KV decode (1 x 32k).

Candidates: the product of each shape's axes, ordered by their distance from the
heuristic's pick (how many fields differ; the heuristic first) and cut at the shape's
``max_distance``. ``num_splits`` is searched around the heuristic's count (half to four
times). Pruned before compiling: block_m 256 on 4 warps (its fp32 accumulator alone is
256 registers a thread, over the 255 cap). A config that fails to compile or launch (too
much shared memory) is recorded with its error and never retried. Prefill also tries
``qk_ahead`` (QK^T a tile ahead of the softmax), except on 256 rows (three 256-row fp32
tiles a thread: spills), so a GPU with triton 3.6, whose heuristic takes the 256-row tile,
still times the tile triton 3.7+ takes.

Correctness: each candidate runs once into a NaN-poisoned output, which is compared with
the heuristic's output on the same inputs (max abs diff). The tolerance is three times the
heuristic's own error against the fp32 torch reference (at least 1e-3), so a fast wrong
config is marked wrong and can never rank.

Time: compiles dominate (1-3 s each, ~130 candidates). ``--jobs N`` spawned processes
first launch every candidate once, filling Triton's on-disk cache, so the timing loop
loads kernels instead of compiling them (``first_call_s`` shows whether it did). The
budget bounds the whole tune: the pool gets at most ``POOL_SHARE`` of it, each shape its
share of what is left; candidates past a deadline are listed as skipped, and the order
makes those the ones furthest from the heuristic. Screening uses short ``do_bench`` runs;
the heuristic and the ``CONFIRM`` best are then timed again, longer, and ranked on that.
On a CPU (``--smoke``) the first call is the only timing: the interpreter compiles
nothing and ``Timer`` times one call there, so a screening or confirming launch would
repeat that call for a number that means nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import multiprocessing
import os
import sys
import time
from pathlib import Path

from kernel_problems import (
    ROOT,
    SMOKE,
    SPEC_DECODE,
    SPEC_PREFILL,
    SPLIT_DECODE,
    Timer,
    make_problem,
    open_session,
    prefill_flops,
    with_device,
)

FIELDS = ("block_m", "block_n", "num_warps", "num_stages", "num_splits", "qk_ahead")
POOL_SHARE = 0.45
SHAPE_SHARES = {"prefill": 0.5, "decode": 0.25, "split_decode": 0.25}
CONFIRM = 3  # best screened candidates timed again, longer, beside the heuristic
TOP = 5  # rows per shape in the markdown
CONFIRM_RESERVE_S = 4.0  # screening of a shape stops this long before its deadline


def splits_around(h: int) -> tuple[int, ...]:
    """num_splits candidates around the heuristic's count ``h``."""
    return tuple(sorted({max(1, h // 2), h, 2 * h, 4 * h}))


@dataclasses.dataclass
class TuneShape:
    """One tuned shape: ``cfg`` holds make_problem's keywords; ``axes`` the values per field
    (a callable gets the heuristic's value); fields without an axis keep the heuristic's."""

    name: str
    metric: str  # "tflops" (prefill) or "gbps" (decode: K/V bytes read)
    cfg: dict
    axes: dict
    max_distance: int
    limit: int | None = None  # most candidates, the heuristic included
    extra: tuple = ()  # field overrides of the heuristic, timed right after it whatever their distance


# Prefill tiles whose K/V ring is 3 deep on triton 3.6 (num_stages 5: loads two key tiles
# ahead; stages 2-4 give a ring of 2, loads one tile ahead, sm_90 compile), beyond the grid's
# distance: docs/kernels.md, "Why the 256-row tile wins on 3.6". Shared memory 132-231 KB.
DEEP_RING = (dict(block_m=128, block_n=64, num_warps=8, num_stages=5),
             dict(block_m=128, block_n=64, num_warps=8, num_stages=5, qk_ahead=True),
             dict(block_m=128, block_n=128, num_warps=8, num_stages=5),
             dict(block_m=256, block_n=64, num_warps=8, num_stages=5))


def tune_shapes(smoke: bool, device: str, torch) -> list[TuneShape]:
    if smoke:
        base = with_device(SMOKE, device, torch)
        return [TuneShape("prefill", "tflops", dict(batch=2, prefix=40, q_len=24, **base),
                          dict(block_m=(16, 32), qk_ahead=(False, True)), 1, limit=3),
                TuneShape("decode", "gbps", dict(batch=3, prefix=50, q_len=1, **base),
                          dict(block_n=(16, 64)), 1, limit=3),
                TuneShape("split_decode", "gbps", dict(batch=1, prefix=599, q_len=1, **base),
                          dict(num_splits=splits_around), 1, limit=2)]
    tiles = dict(block_n=(32, 64, 128), num_warps=(4, 8), num_stages=(2, 3, 4))
    return [TuneShape("prefill", "tflops", with_device(SPEC_PREFILL, device, torch),
                      dict(block_m=(64, 128, 256), **tiles, qk_ahead=(False, True)), max_distance=4,
                      extra=DEEP_RING),
            TuneShape("decode", "gbps", with_device(SPEC_DECODE, device, torch),
                      dict(block_m=(16, 32, 64), **tiles, num_splits=splits_around), max_distance=2),
            TuneShape("split_decode", "gbps", with_device(SPLIT_DECODE, device, torch),
                      dict(block_m=(16, 32), **tiles, num_splits=splits_around), max_distance=2)]


def heuristic_config(shape: TuneShape, torch):
    """The TileConfig the launcher picks for this shape, with its num_splits filled in."""
    from prefixkv.kernels.tiling import choose_num_splits, choose_tiles, sm_count

    c = shape.cfg
    dev = torch.device(c["device"])
    tiles = choose_tiles(group=c["heads"] // c["kv_heads"], head_dim=c["head_dim"], max_seqlen_q=c["q_len"],
                         on_gpu=dev.type == "cuda", elem_bytes=c["dtype"].itemsize)
    splits = tiles.num_splits or choose_num_splits(batch=c["batch"], num_kv_heads=c["kv_heads"],
                                                   max_seqlen_q=c["q_len"],
                                                   max_seqlen_k=c["prefix"] + c["q_len"],
                                                   num_sms=sm_count(dev))
    return dataclasses.replace(tiles, num_splits=splits)


def candidate_grid(heuristic, axes: dict, max_distance: int, limit: int | None = None,
                   group_p2: int = 1, extra: tuple = ()) -> list:
    """TileConfigs from ``axes`` (field -> values, or a callable of the heuristic's value),
    the heuristic first, then ``extra`` (field overrides of the heuristic, any distance),
    then by distance (fields that differ from it), product order within a distance. Drops
    block_m 256 on 4 warps or with ``qk_ahead``, and configs equal to an earlier one once
    block_m is raised to ``group_p2`` (as the launcher does); ``limit`` cuts the grid's
    part, never the extras."""
    values = []
    for f in FIELDS:
        own = getattr(heuristic, f)
        v = axes.get(f, (own,))
        v = v(own) if callable(v) else v
        values.append(v if own in v else (own, *v))
    seen, grid = set(), []
    for combo in itertools.product(*values):
        cfg = dataclasses.replace(heuristic, **dict(zip(FIELDS, combo, strict=True)))
        key = (max(cfg.block_m, group_p2), *combo[1:])
        distance = sum(a != getattr(heuristic, f) for f, a in zip(FIELDS, combo, strict=True))
        spills = cfg.block_m >= 256 and (cfg.num_warps < 8 or cfg.qk_ahead)
        if key in seen or distance > max_distance or spills:
            continue
        seen.add(key)
        grid.append((distance, len(grid), cfg))
    grid.sort(key=lambda t: t[:2])
    ordered = [cfg for _, _, cfg in grid][:limit]
    extras = [c for c in dict.fromkeys(dataclasses.replace(heuristic, **e) for e in extra) if c != heuristic]
    return ordered[:1] + extras + [c for c in ordered[1:] if c not in extras]


def _fields(cfg) -> dict:
    return {f: getattr(cfg, f) for f in FIELDS}


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


def _launch(args, cfg, out):
    from prefixkv.kernels.attention import paged_prefill_attention_triton

    return paged_prefill_attention_triton(*args, out=out, config=cfg)


_WORKER_PROBLEM: dict = {}


def _precompile(smoke: bool, shape_name: str, fields: dict) -> tuple[str, str | None]:
    """Pool worker: launch one candidate once so that Triton compiles it into its disk cache.
    Returns ("ok", None), ("triton", error) for a Triton compile/launch failure (a verdict),
    or ("other", error) for anything else (the timing loop tries again)."""
    import torch

    import prefixkv.kernels as kernels
    from prefixkv.kernels.tiling import TileConfig

    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        if shape_name not in _WORKER_PROBLEM:
            _WORKER_PROBLEM.clear()  # one problem per worker at a time
            shape = next(s for s in tune_shapes(smoke, device, torch) if s.name == shape_name)
            _WORKER_PROBLEM[shape_name] = make_problem(torch, kernels, **shape.cfg)[0]
        args = _WORKER_PROBLEM[shape_name]
        _launch(args, TileConfig(**fields), torch.empty_like(args[0]))
        if device == "cuda":
            torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - reported, judged by the caller
        return ("triton" if type(exc).__module__.startswith("triton") else "other"), _error(exc)
    return "ok", None


def precompile(jobs: int, smoke: bool, tasks: list, deadline: float, log) -> dict:
    """Run ``_precompile`` over ``tasks`` ((shape name, TileConfig) pairs) in ``jobs`` spawned
    processes until ``deadline``; returns {task: (status, error)} for those that finished."""
    done: dict = {}
    pool = multiprocessing.get_context("spawn").Pool(jobs)
    try:
        pending = [(t, pool.apply_async(_precompile, (smoke, t[0], _fields(t[1])))) for t in tasks]
        for i, (task, res) in enumerate(pending, 1):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                done[task] = res.get(timeout=left)
            except multiprocessing.TimeoutError:
                break
            except Exception as exc:  # noqa: BLE001 - a worker that died: the timing loop retries
                done[task] = ("other", _error(exc))
            if i % 10 == 0 or i == len(pending):
                log(f"precompiled {i}/{len(pending)}")
    finally:
        pool.terminate()  # stops workers still compiling past the deadline
        pool.join()
    return done


def _sync(torch, cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def tune_shape(torch, kernels, shape: TuneShape, heuristic, candidates: list, *, cuda: bool, deadline: float,
               verdicts: dict, log) -> dict:
    """Screen ``candidates`` (the heuristic first) until ``deadline``, confirm the best few.
    Returns the shape's result: every row (timed, wrong, failed or skipped) and the ranking."""
    c = shape.cfg
    args, _ = make_problem(torch, kernels, **c)
    kv_len = c["prefix"] + c["q_len"]
    if shape.metric == "tflops":
        work = prefill_flops(c) / 1e12
    else:
        work = 2 * c["batch"] * kv_len * c["kv_heads"] * c["head_dim"] * args[1].element_size() / 1e9
    result = {"name": shape.name, "metric": shape.metric,
              "shape": {k: v for k, v in c.items()
                        if k not in ("dtype", "device")} | {"dtype": str(c["dtype"])[6:]},
              "heuristic": _fields(heuristic), "rows": []}
    want = torch.full_like(args[0], float("nan"))
    try:
        _launch(args, heuristic, want)
        default = kernels.paged_prefill_attention(*args, backend="triton")  # what a caller gets
        result["heuristic_matches_default"] = bool(torch.equal(default, want))
    except Exception as exc:  # noqa: BLE001 - nothing to compare with: the shape is reported as failed
        result["error"] = f"heuristic failed: {_error(exc)}"
        return result
    try:
        ref = kernels.paged_prefill_attention_reference(*args).float()
        result["heuristic_err_vs_reference"] = err = float((want.float() - ref).abs().max())
        tol = max(3 * err, 1e-3)
        del ref
    except Exception as exc:  # noqa: BLE001 - e.g. out of memory: fall back to a fixed tolerance
        result["reference_error"], tol = _error(exc), 2e-2
    result["tolerance"] = tol
    screen, confirm = Timer(cuda, warmup=10, rep=40), Timer(cuda, warmup=25, rep=200)
    out = torch.empty_like(args[0])
    for i, cfg in enumerate(candidates):
        row = _fields(cfg) | {"is_heuristic": cfg == heuristic}
        result["rows"].append(row)
        verdict = verdicts.get((shape.name, cfg), ("", None))
        if verdict[0] == "triton":
            row["error"] = verdict[1]
            continue
        if not row["is_heuristic"] and time.monotonic() > deadline - (CONFIRM_RESERVE_S if cuda else 0):
            row["skipped"] = "time budget"
            continue
        try:
            out.fill_(float("nan"))
            start = time.perf_counter()
            _launch(args, cfg, out)
            _sync(torch, cuda)
            first_s = time.perf_counter() - start
            row["first_call_s"] = round(first_s, 3)
            row["max_abs_diff"] = diff = float((out.float() - want.float()).abs().max())
            row["ok"] = diff <= tol  # NaN (an unwritten element) fails
            if row["ok"]:
                row["ms"] = screen(lambda cfg=cfg: _launch(args, cfg, out)) if cuda else first_s * 1e3
                row[shape.metric] = work / row["ms"] * 1e3
        except Exception as exc:  # noqa: BLE001 - compile errors, out of shared memory: recorded
            row["error"] = _error(exc)
            try:
                _sync(torch, cuda)
            except Exception as lost:  # noqa: BLE001 - the CUDA context is gone: stop here
                result["error"] = f"CUDA context lost after {row}: {_error(lost)}"
                break
        log(f"{shape.name} {i + 1}/{len(candidates)} {_brief(row, shape.metric)}")
    screened = sorted((r for r in result["rows"] if r.get("ok") and "ms" in r), key=lambda r: r["ms"])
    for r in [r for r in screened if r["is_heuristic"]] + [r for r in screened
                                                           if not r["is_heuristic"]][:CONFIRM]:
        cfg = dataclasses.replace(heuristic, **{f: r[f] for f in FIELDS})
        r["confirm_ms"] = confirm(lambda cfg=cfg: _launch(args, cfg, out)) if cuda else r["ms"]
        r[shape.metric] = work / r["confirm_ms"] * 1e3
    return rank(result)


def rank(result: dict) -> dict:
    """Adds ``ranking`` (row indices: confirmed rows by confirm_ms, then screened rows by ms;
    wrong, failed and skipped rows never rank) and the best row's speedup over the heuristic."""
    rows = result["rows"]
    timed = [i for i, r in enumerate(rows) if r.get("ok") is True and "ms" in r]
    result["ranking"] = sorted(timed, key=lambda i: ("confirm_ms" not in rows[i],
                                                     rows[i].get("confirm_ms", rows[i]["ms"])))
    heur = next((r for r in rows if r["is_heuristic"] and "ms" in r), None)
    if result["ranking"] and heur:
        best = rows[result["ranking"][0]]
        key = "confirm_ms" if "confirm_ms" in best and "confirm_ms" in heur else "ms"
        result["best"] = {f: best[f] for f in FIELDS}
        result["speedup_vs_heuristic"] = heur[key] / best[key]
    result["counts"] = {"candidates": len(rows), "timed": len(timed),
                        "wrong": sum(r.get("ok") is False for r in rows),
                        "failed": sum("error" in r for r in rows),
                        "skipped": sum("skipped" in r for r in rows)}
    return result


def _brief(row: dict, metric: str) -> str:
    cfg = "{block_m}x{block_n} w{num_warps} s{num_stages} splits {num_splits}".format(**row)
    cfg += " QK ahead" if row.get("qk_ahead") else ""
    if "error" in row:
        return f"{cfg}: {row['error'][:120]}"
    if not row.get("ok"):
        return f"{cfg}: WRONG, max abs diff {row.get('max_abs_diff')}"
    unit = "TFLOP/s" if metric == "tflops" else "GB/s"
    return f"{cfg}: {row['ms']:.3f} ms, {row[metric]:.1f} {unit}, diff {row['max_abs_diff']:.1e}"


def run_tune(torch, kernels, *, cuda: bool, smoke: bool, budget_s: float, jobs: int, only,
             meta: dict) -> dict:
    """The whole tune; ``meta`` (device, commit, versions) is copied into the result."""
    t0 = time.monotonic()
    log = lambda msg: print(f"[tune {time.monotonic() - t0:6.1f}s] {msg}", flush=True)  # noqa: E731
    device = "cuda" if cuda else "cpu"
    shapes = [s for s in tune_shapes(smoke, device, torch) if not only or s.name in only]
    plans = []
    for s in shapes:
        heur = heuristic_config(s, torch)
        group_p2 = 1 << max(0, s.cfg["heads"] // s.cfg["kv_heads"] - 1).bit_length()
        plans.append((s, heur, candidate_grid(heur, s.axes, s.max_distance, s.limit, group_p2, s.extra)))
        log(f"{s.name}: heuristic {_fields(heur)}, {len(plans[-1][2])} candidates")
    result = dict(meta, smoke=smoke, budget_s=budget_s, jobs=jobs, shapes=[])
    verdicts: dict = {}
    if jobs > 0:
        tasks = [(s.name, cfg) for s, _, cands in plans for cfg in cands]
        log(f"precompiling {len(tasks)} candidates in {jobs} processes")
        verdicts = precompile(jobs, smoke, tasks, t0 + POOL_SHARE * budget_s, log)
        result["precompile"] = {"tasks": len(tasks), "finished": len(verdicts),
                                "triton_errors": sum(v[0] == "triton" for v in verdicts.values()),
                                "s": round(time.monotonic() - t0, 1)}
    for i, (s, heur, cands) in enumerate(plans):
        now, shares = time.monotonic(), [SHAPE_SHARES[p[0].name] for p in plans[i:]]
        deadline = now + (t0 + budget_s - now) * shares[0] / sum(shares)
        start = time.monotonic()
        res = tune_shape(torch, kernels, s, heur, cands, cuda=cuda, deadline=deadline, verdicts=verdicts,
                         log=log)
        res["elapsed_s"] = round(time.monotonic() - start, 1)
        result["shapes"].append(res)
        if "best" in res:
            log(f"{s.name}: best {res['best']}, {res['speedup_vs_heuristic']:.3f}x the heuristic")
        del res
        if cuda:
            torch.cuda.empty_cache()
        if "CUDA context lost" in result["shapes"][-1].get("error", ""):
            break
    result["elapsed_s"] = round(time.monotonic() - t0, 1)
    return result


def write_tune(result: dict, out_dir: Path, name: str) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    jpath, mpath = out_dir / f"tune-{name}.json", out_dir / f"tune-{name}.md"
    jpath.write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# Tile tuning on {result['device']}", "",
             f"commit `{result['commit']}`, torch {result['torch']}, triton {result['triton']}; "
             f"{result['elapsed_s']} s of a {result['budget_s']} s budget, {result['jobs']} compile "
             "processes", ""]
    if result["smoke"]:
        lines += ["Smoke run: tiny shapes, possibly through the Triton interpreter; the timings mean "
                  "nothing.", ""]
    for s in result["shapes"]:
        unit = "TFLOP/s" if s["metric"] == "tflops" else "GB/s"
        lines += [f"## {s['name']}", "", ", ".join(f"{k} {v}" for k, v in s["shape"].items()), ""]
        if "error" in s:
            lines += [f"**Error:** {s['error']}", ""]
        lines += [f"Heuristic: `{_cfg_text(s['heuristic'])}`; tolerance "
                  f"{s.get('tolerance', float('nan')):.1e} "
                  f"(heuristic vs fp32 reference: {s.get('heuristic_err_vs_reference', float('nan')):.1e}); "
                  f"counts {s.get('counts')}", ""]
        if "best" in s:
            lines += [f"**Best: `{_cfg_text(s['best'])}`, {s['speedup_vs_heuristic']:.3f}x the heuristic.**",
                      ""]
        lines += [f"| rank | block_m | block_n | warps | stages | splits | QK ahead | ms | {unit} "
                  "| vs heuristic | max abs diff |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        rows, order = s["rows"], s.get("ranking", [])
        heur = next((r for r in rows if r["is_heuristic"] and "ms" in r), None)
        shown = order[:TOP] + [i for i in order[TOP:] if rows[i]["is_heuristic"]]
        for i in shown:
            r = rows[i]
            ms = r.get("confirm_ms", r["ms"])
            ratio = (heur.get("confirm_ms", heur["ms"]) / ms) if heur else math.nan
            mark = " (heuristic)" if r["is_heuristic"] else ""
            lines.append(f"| {order.index(i) + 1}{mark} | {r['block_m']} | {r['block_n']} | "
                         f"{r['num_warps']} | {r['num_stages']} | {r['num_splits']} | "
                         f"{'yes' if r.get('qk_ahead') else 'no'} | {ms:.3f} | "
                         f"{r[s['metric']]:.1f} | {ratio:.3f}x | {r['max_abs_diff']:.1e} |")
        bad = [r for r in rows if "error" in r or r.get("ok") is False]
        if bad:
            lines += ["", "Failed or wrong:", ""] + [f"- {_brief(r, s['metric'])}" for r in bad[:12]]
            if len(bad) > 12:
                lines.append(f"- ... {len(bad) - 12} more in the JSON")
        lines.append("")
    mpath.write_text("\n".join(lines))
    return jpath, mpath


def _cfg_text(fields: dict) -> str:
    return "TileConfig(" + ", ".join(f"{f}={fields[f]}" for f in FIELDS) + ")"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes through the Triton interpreter (CPU ok)")
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--budget-s", type=float, default=330.0, help="wall-clock budget of the whole tune")
    p.add_argument("--shapes", nargs="+", choices=("prefill", "decode", "split_decode"),
                   help="tune only these")
    p.add_argument("--jobs", type=int, default=None,
                   help="processes compiling candidates ahead (default: up to 8 on CUDA, 0 on CPU)")
    opts = p.parse_args(argv)
    session = open_session("tune_kernels", opts.smoke)
    if session is None:
        return 2
    torch, kernels, cuda, meta, slug = session
    jobs = opts.jobs if opts.jobs is not None else (min(8, max(1, (os.cpu_count() or 2) - 2)) if cuda else 0)
    result = run_tune(torch, kernels, cuda=cuda, smoke=opts.smoke, budget_s=opts.budget_s, jobs=jobs,
                      only=opts.shapes, meta=meta)
    jpath, mpath = write_tune(result, opts.out_dir, slug)
    print(mpath.read_text())
    print(f"wrote {jpath} and {mpath}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

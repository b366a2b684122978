"""The report of ``bench_allocator.py --against REV``: runs ``alloc_ab.compare`` on a
worktree of REV and this tree, and writes ``allocator-ab.{md,json}``."""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, replace
from pathlib import Path

from alloc_ab import EVENTS, QUICK, TREE, Plan, _git, compare, worktree

GOALS = {  # the speed issue's goals (old/new, medians) against ae75256, by row
    ("micro", "xxhash", "admit 2k, 100% hit"): 2.0, ("micro", "xxhash", "admit 32k, 100% hit"): 2.0,
    ("micro", "xxhash", "admit 2k, 0% hit"): 1.3, ("micro", "xxhash", "admit 32k, 0% hit"): 1.3,
    ("micro", "xxhash", "decode, 64 running, per step"): 1.5,
    ("workload", "xxhash", "system-prompt: admit"): 2.0, ("workload", "xxhash", "chat: admit"): 2.0,
    ("workload", "xxhash", "document: admit"): 2.0, ("workload", "xxhash", "pressure: admit"): 1.3,
    **{("workload", "xxhash", f"{w}: decode"): 1.5  # per token, through the per-step call
       for w in ("system-prompt", "chat", "document", "pressure")},
}


_CLOCKS = {"wall": "wall time (perf_counter_ns)",
           "cpu": "each worker thread's CPU time (thread_time_ns), which other processes' time "
                  "slices on a busy machine do not enter"}


def goal(r: dict) -> float | None:
    """The issue's goal for row ``r``; every sha256 row: no slower (1.0)."""
    if r["mode"] == "sha256":
        return 1.0
    return GOALS.get((r["section"], r["mode"], r["row"]))


def _cost(meta: dict) -> str:
    """What reading the clock cost each side (subtracted from every interval it timed)."""
    costs = [meta.get("sides", {}).get(k, {}).get("clock_cost_ns") for k in ("old", "new")]
    if None in costs:
        return ""
    return (f"; reading it costs {costs[0]} / {costs[1]} ns a pair (old / new worker), "
            f"subtracted from every interval timed")


def markdown(rows: list[dict], meta: dict) -> str:
    old, new = meta["old_commit"], meta["new_commit"]
    lines = [f"# Allocator A/B: {old} against {new} ({meta['machine']}, Python {meta['python']})",
             "", f"Command: `{meta['command']}` ({meta['elapsed_s']} s)", "",
             f"Clock: {_CLOCKS[meta['plan'].get('clock', 'wall')]}{_cost(meta)}.", "",
             f"Both sides ran in one run, {meta['plan']['rounds']} rounds per row in ABBA order "
             f"(old, new, new, old, ...), split over {meta['plan'].get('sessions', 1)} pairs of "
             "fresh worker processes (one process's heap layout can slow a row for its whole "
             "life). µs: median of the round values "
             "(best round in brackets); a round value is the median of its admissions, or the "
             "mean per decoded token / per request. Ratio = old / new (above 1: the new code is "
             "faster), of the medians (of the best rounds); paired: the median of each round's "
             "own ratio, which a burst of load on the machine moves least. Pools are filled to "
             "capacity with "
             "cached blocks first (every miss evicts); workloads replay in the big pool with "
             "requests held so that exactly their designed room is free (4096 blocks; pressure "
             "512), one seed per round, the same requests on both sides, timing allocator calls "
             "only. Goal: the speed issue's target ratio against ae75256, judged on the paired ratio "
             "(a burst of load on this VM slows a few consecutive rounds of both sides, which "
             "moves the ratio of medians when the bursts fall unevenly).", ""]
    for section, head in (("micro", "Micro"), ("workload", "Workloads (xxhash)")):
        lines += [f"## {head}", "",
                  f"| pool blocks | hash | row | unit | {old} | {new} | old/new | paired | goal |",
                  "|---:|---|---|---|---:|---:|---:|---:|---|"]
        for r in (r for r in rows if r["section"] == section):
            name = r["row"]
            if r.get("old_call") and r["old_call"] != r["new_call"]:
                name += f" ({r['old_call']} vs {r['new_call']})"
            if r.get("same_counts") is False:
                name += " (sides replayed different counts)"
            g = goal(r)
            mark = "" if g is None else f"{g:g}x {'met' if r['ratio_paired'] >= g else 'NOT met'}"
            lines.append(f"| {r['pool_blocks']:,} | {r['mode']} | {name} | {r['unit']} | "
                         f"{r['old_us']:g} ({r['old_best_us']:g}) | {r['new_us']:g} ({r['new_best_us']:g}) "
                         f"| {r['ratio']:.2f} ({r['ratio_best']:.2f}) | {r['ratio_paired']:.2f} | {mark} |")
        lines.append("")
    lines += ["What the workloads did (all rounds; the new side's counts, the same on both sides "
              "unless a row says otherwise):", "",
              "| pool blocks | workload | admissions | preemptions | decoded tokens | prompt tokens hit "
              "| running per step |", "|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["section"] == "workload" and r["row"].endswith(": admit"):
            c = r["counts"]["new"]
            lines.append(f"| {r['pool_blocks']:,} | {r['row'][:-len(': admit')]} | {c['admissions']:,} "
                         f"| {c['preemptions']:,} | {c['decoded_tokens']:,} "
                         f"| {c['cached_tokens'] / max(c['prompt_tokens'], 1):.0%} "
                         f"| {c['decoded_tokens'] / max(c['steps'], 1):.1f} |")
    return "\n".join(lines + [""])


def main_against(rev: str, quick: bool, out: Path, command: str, clock: str = "wall",
                 events: bool = False) -> None:
    """Compare ``rev`` with this tree, print each row as it finishes, write the report
    (``events``: the EVENTS plan, written as allocator-events-ab.{json,md})."""
    plan = replace(EVENTS if events else QUICK if quick else Plan(rounds=24, sessions=4),
                   clock=clock)
    dirty = _git("status", "--porcelain", "--", "src")
    new_commit = _git("rev-parse", "--short", "HEAD") + (" + uncommitted src" if dirty else "")
    t0 = time.perf_counter()
    with worktree(rev) as (path, old_commit):
        print(f"old: {old_commit} ({path}), new: {new_commit} ({TREE})", flush=True)
        rows, sides = compare(path / "src", TREE / "src", plan, log=_print_row)
    meta = dict(machine=f"{platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} cores",
                python=platform.python_version(), old_commit=old_commit, new_commit=new_commit,
                command=command, elapsed_s=round(time.perf_counter() - t0),
                plan=asdict(plan), sides=sides)
    md = events_markdown(rows, meta) if events else markdown(rows, meta)
    print(md)
    out.mkdir(parents=True, exist_ok=True)
    name = "allocator-events-ab" if events else "allocator-ab"
    (out / f"{name}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    (out / f"{name}.md").write_text(md)


def events_markdown(rows: list[dict], meta: dict) -> str:
    """The ``--events`` report: each admission row with KV events off and on, old and new."""
    old, new = meta["old_commit"], meta["new_commit"]
    lines = [f"# KV events off and on: {old} against {new} ({meta['machine']}, Python "
             f"{meta['python']})", "", f"Command: `{meta['command']}` ({meta['elapsed_s']} s)",
             "", f"Clock: {_CLOCKS[meta['plan'].get('clock', 'wall')]}{_cost(meta)}.", "",
             f"{meta['plan']['rounds']} rounds, split over {meta['plan'].get('sessions', 1)} "
             "pairs of fresh worker processes; each worker holds two managers filled to "
             "capacity (10k blocks; every miss evicts), events off and on, and each round "
             "measures off and on back to back on both sides (order alternating), the same "
             "prompts everywhere. µs: median of the round values (a round's value: the median "
             "of its admissions; best round in brackets). on/off: the median of each round's "
             "own ratio. \"+ take_events\": the admission plus the step's `take_events()` "
             "(with deferred events, where the hashes and event objects are built). "
             "\"+ hand-off\": the admission plus `take_pending_events()`, which hands the "
             "step's events to another thread unbuilt; a side without that call shows its "
             "`take_events()` values there. Where a side has it, the two take rows alternate "
             "admissions (half the samples each), and each step's events (either row's) are "
             "then `publish`ed, timed, to a live `EventPublisher` whose thread builds, "
             "encodes and sends them. After each step, events off too, the worker sleeps "
             f"{meta['plan'].get('forward_ms', 0):g} ms (untimed, the GIL released): the "
             "forward pass, in which the publisher's thread works, as in an engine.", "",
             f"| row | {old} | {new} | old/new | {old} on/off | {new} on/off |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        on_off = ((f"{r['on_off_old']:.2f}", f"{r['on_off_new']:.2f}") if "on_off_new" in r
                  else ("", ""))
        lines.append(f"| {r['row']} | {r['old_us']:.1f} ({r['old_best_us']:.1f}) | "
                     f"{r['new_us']:.1f} ({r['new_best_us']:.1f}) | {r['ratio']:.2f} | "
                     f"{on_off[0]} | {on_off[1]} |")
    return "\n".join(lines) + "\n"


def _print_row(r: dict) -> dict:
    print(f"{r['pool_blocks']:>9,} {r['mode']:6} {r['row']:38} old {r['old_us']:>9.3f} "
          f"new {r['new_us']:>9.3f} {r['unit']:12} ratio {r['ratio']:.2f} ({r['ratio_best']:.2f})",
          flush=True)
    return r

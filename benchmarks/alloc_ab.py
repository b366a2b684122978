"""Side-by-side allocator timing of an older commit and the working tree, in one run
(``bench_allocator.py --against REV``).

The older commit is checked out with ``git worktree add --detach`` into a temporary
folder; two long-lived workers (``alloc_worker.py`` from this tree, the same Python) import
prefixkv from ``<old>/src`` and ``<this tree>/src``. Every row is measured in rounds that
alternate between the sides in ABBA order (old, new, new, old, ...), so a drift of the
machine within a row weighs on both alike; both sides get the same seeds and, for the
workloads, the same requests (built here, with this tree's ``prefixkv.bench.workloads``).
A row reports per side the median and the best of its round values, and the ratio
old/new of each (above 1: the working tree is faster).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from prefixkv.bench.workloads import builtin

HERE = Path(__file__).resolve().parent
TREE = HERE.parent
WORKER = HERE / "alloc_worker.py"
BS = 16


@dataclass(frozen=True)
class Plan:
    """How much to measure: pools, hash modes, rounds per row (even: ABBA pairs), samples
    per round, and the workloads (at ``scale``) replayed in each pool."""

    pools: tuple[int, ...] = (10_000, 1_000_000)
    modes: tuple[str, ...] = ("xxhash", "sha256")
    rounds: int = 20
    sessions: int = 1  # fresh worker pairs the rounds are split over (see ``compare``)
    admits_2k: int = 200
    admits_32k: int = 20
    decode_tokens: int = 32_000
    step_requests: int = 64
    workloads: tuple[str, ...] = ("system-prompt", "chat", "document", "pressure")
    scale: float = 1.0
    max_running: int = 64
    clock: str = "wall"  # or "cpu": each worker thread's CPU time (see alloc_worker)
    forward_ms: float = 0.0  # events rows: the forward pass after each step (a GIL-free sleep)
    warm_up_s: float = 2.0  # each worker's warm-up before its first row (alloc_worker.warm_up)


QUICK = Plan(pools=(10_000,), rounds=2, admits_2k=40, admits_32k=4, decode_tokens=4000, scale=0.25)
EVENTS = Plan(pools=(10_000,), modes=("xxhash+both",), rounds=12, sessions=2,
              admits_2k=100, admits_32k=10, workloads=(), forward_ms=2.0)
"""``--events``: admissions with KV events off and on (``events_rows``), 10k-block pool."""


def events_rows(pair, plan: Plan, pool: int, mode: str, log, first: int = 0) -> list[dict]:
    """Admissions (2k/32k, 0%/100% hit) with events off and on, on both sides. Each round
    measures off and on back to back on both workers (off first in even rounds, on first in
    odd ones), so the on/off ratio of a side is paired within a round, as old/new is.
    Rows: ``<name>, events off``, ``<name>, events on``, ``<name>, events on +
    take_events`` (the step's drain too), ``<name>, events on + hand-off`` (where a side
    has ``take_pending_events``: the admission and that call, the build left to another
    thread; a side without it shows its take_events values), each with ``on_off_old``/``on_off_new``: the
    median of each round's on/off ratio (for the last two rows). Each step (events off
    too) is followed by ``plan.forward_ms`` of sleep, untimed: the forward pass, in which
    a live publisher's thread builds and sends (see ``alloc_worker``)."""
    rows = []
    for tokens, count in ((2048, plan.admits_2k), (32768, plan.admits_32k)):
        for hit in (False, True):
            name = f"admit {tokens // 1024}k, {100 if hit else 0}% hit"
            got: dict[bool, dict[str, list[dict]]] = {False: {"old": [], "new": []},
                                                       True: {"old": [], "new": []}}
            for r in range(plan.rounds):
                for events in ((False, True) if r % 2 == 0 else (True, False)):
                    cmd = dict(cmd="admit", tokens=tokens, hit=hit, count=count, events=events,
                               seed=f"{pool}/{name}/{first + r}", forward_ms=plan.forward_ms)
                    one = measure(pair if r % 4 < 2 else pair[::-1], 1, lambda _, c=cmd: c)
                    for side in ("old", "new"):
                        got[events][side] += one[side]
            keys = ("ns", "with_take_ns", "with_handoff_ns")
            ns = {(e, k): [g[k] for g in got[e]["new"]] for e in (False, True)
                  for k in keys if k in got[e]["new"][0]}
            old = {(e, k): [g[k] for g in got[e]["old"]] for e in (False, True)
                   for k in keys if k in got[e]["old"][0]}
            labels = [("events off", (False, "ns")), ("events on", (True, "ns")),
                      ("events on + take_events", (True, "with_take_ns"))]
            if (True, "with_handoff_ns") in ns:  # a side without the hand-off: its take_events
                labels.append(("events on + hand-off", (True, "with_handoff_ns")))
                for side in (old, ns):
                    side.setdefault((True, "with_handoff_ns"), side[(True, "with_take_ns")])
            for label, key in labels:
                extra = {}
                if key[0]:
                    extra = {f"on_off_{side}": round(statistics.median(
                        on / off for on, off in zip(src[key], src[(False, "ns")], strict=True)), 2)
                        for side, src in (("old", old), ("new", ns))}
                rows.append(log(row("micro", pool, "xxhash", f"{name}, {label}", "µs/admission",
                                    old[key], ns[key], **extra)))
    return rows


class Worker:
    """A worker process importing prefixkv from ``src``, warmed up for ``warm_up_s``
    seconds; ``call`` sends one command."""

    def __init__(self, label: str, src: Path, clock: str = "wall", warm_up_s: float = 2.0) -> None:
        self.label = label
        env = {**os.environ, "PYTHONPATH": str(src), "PYTHONHASHSEED": "0",
               "PREFIXKV_BENCH_CLOCK": clock}
        self.proc = subprocess.Popen([sys.executable, str(WORKER)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=HERE)
        try:
            # Both workers on one CPU (they never run at once): on this VM the two vCPUs'
            # speed drifts apart for seconds at a time, and a worker moved to the slower
            # one ran whole rounds 1.5x slower while the other did not.
            os.sched_setaffinity(self.proc.pid, {min(os.sched_getaffinity(0))})
            self.info = self.call(dict(cmd="hello", warm_up_s=warm_up_s))
            if not Path(self.info["prefixkv"]).resolve().is_relative_to(src.resolve()):
                raise RuntimeError(f"{label} worker imported {self.info['prefixkv']}, not from {src}")
        except BaseException:
            self.close()
            raise

    def call(self, cmd: dict | str) -> dict:
        """Send a command (a dict, or one already JSON-encoded) and return the reply.
        Raises RuntimeError when the worker reports an error or has died."""
        try:
            self.proc.stdin.write((cmd if isinstance(cmd, str) else json.dumps(cmd)) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise RuntimeError(f"{self.label} worker exited ({self.proc.wait()})") from None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.label} worker exited ({self.proc.wait()})")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"{self.label} worker failed:\n{reply['error']}")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write('{"cmd": "quit"}\n')
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


@contextmanager
def workers(old_src: Path, new_src: Path, clock: str = "wall", warm_up_s: float = 2.0):
    """Start the two workers; stop them on the way out."""
    pair = []
    try:
        pair.append(Worker("old", old_src, clock, warm_up_s))
        pair.append(Worker("new", new_src, clock, warm_up_s))
        yield pair
    finally:
        for w in pair:
            w.close()


@contextmanager
def worktree(rev: str):
    """A detached worktree of ``rev`` in a temporary folder; yields (path, short commit).
    Raises SystemExit (code 2) when ``rev`` names no commit."""
    try:
        commit = _git("rev-parse", "--short", "--verify", "--end-of-options", f"{rev}^{{commit}}")
    except subprocess.CalledProcessError:
        raise SystemExit(f"bench_allocator: unknown revision {rev!r}") from None
    with tempfile.TemporaryDirectory(prefix="prefixkv-ab-") as tmp:
        path = Path(tmp) / commit
        _git("worktree", "add", "--detach", str(path), commit)
        try:
            yield path, commit
        finally:
            _git("worktree", "remove", "--force", str(path))


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=TREE, check=True, capture_output=True,
                          text=True).stdout.strip()


def measure(pair, rounds: int, command) -> dict[str, list[dict]]:
    """Replies of ``command(r)`` for rounds r = 0..rounds-1, old and new in ABBA order."""
    replies: dict[str, list[dict]] = {"old": [], "new": []}
    for r in range(rounds):
        line = json.dumps(command(r))
        for w in (pair if r % 2 == 0 else pair[::-1]):
            replies[w.label].append(w.call(line))
    return replies


def row(section: str, pool: int, mode: str, name: str, unit: str, old: list[float],
        new: list[float], **extra) -> dict:
    """A report row: round values (ns) of both sides summarised in µs, and the ratios old/new
    of the medians, of the best rounds, and the median of each round's own ratio."""
    med = {k: statistics.median(v) / 1e3 for k, v in (("old", old), ("new", new))}
    best = {k: min(v) / 1e3 for k, v in (("old", old), ("new", new))}
    return dict(section=section, pool_blocks=pool, mode=mode, row=name, unit=unit,
                old_us=round(med["old"], 3), old_best_us=round(best["old"], 3),
                new_us=round(med["new"], 3), new_best_us=round(best["new"], 3),
                ratio=round(med["old"] / med["new"], 2), ratio_best=round(best["old"] / best["new"], 2),
                ratio_paired=round(statistics.median(o / n for o, n in zip(old, new, strict=True)), 2),
                old_rounds_ns=[round(x) for x in old], new_rounds_ns=[round(x) for x in new], **extra)


def micro_rows(pair, plan: Plan, pool: int, mode: str, log, first: int = 0) -> list[dict]:
    """Admissions (2k/32k, 0%/100% hit) and decode (one request; a batch per step)."""
    rows = []
    for tokens, count in ((2048, plan.admits_2k), (32768, plan.admits_32k)):
        for hit in (False, True):
            name = f"admit {tokens // 1024}k, {100 if hit else 0}% hit"
            got = measure(pair, plan.rounds, lambda r, tokens=tokens, hit=hit, count=count, name=name: dict(
                cmd="admit", tokens=tokens, hit=hit, count=count,
                seed=f"{pool}/{mode}/{name}/{first + r}"))
            rows.append(log(row("micro", pool, mode, name, "µs/admission",
                                [g["ns"] for g in got["old"]], [g["ns"] for g in got["new"]])))
            if "with_take_ns" in got["new"][0]:  # events on: the step's take_events too
                rows.append(log(row("micro", pool, mode, name + " + take_events", "µs/admission",
                                    [g["with_take_ns"] for g in got["old"]],
                                    [g["with_take_ns"] for g in got["new"]])))
    for requests, per_step in ((1, False), (plan.step_requests, True)):
        name = f"decode, {requests} running, " + ("per step" if per_step else "per request")
        got = measure(pair, plan.rounds, lambda r, requests=requests, per_step=per_step, name=name: dict(
            cmd="decode", requests=requests, steps=plan.decode_tokens // requests,
            per_step=per_step, seed=f"{pool}/{mode}/{name}/{first + r}"))
        rows.append(log(row("micro", pool, mode, name, "µs/token",
                            [g["ns"] for g in got["old"]], [g["ns"] for g in got["new"]],
                            old_call=got["old"][0]["call"], new_call=got["new"][0]["call"])))
    return rows


_SUMMARY = ("old_us", "old_best_us", "new_us", "new_best_us", "ratio", "ratio_best",
            "ratio_paired", "old_rounds_ns", "new_rounds_ns")

COUNTS = ("admissions", "preemptions", "decoded_tokens", "prompt_tokens", "cached_tokens", "steps")


def workload_rows(pair, plan: Plan, pool: int, log, first: int = 0) -> list[dict]:
    """Each workload replayed in ``pool`` with requests held so that exactly its designed
    room (``pool_tokens / 16`` blocks) is free; round r replays the workload of seed r.
    Raises ValueError (before any command) when that room is larger than ``pool``."""
    rows = []
    rooms = {name: builtin(name, 1e-9).pool_tokens // BS for name in plan.workloads}  # one request
    if max(rooms.values()) > pool:
        raise ValueError(f"workloads need up to {max(rooms.values())} free blocks ({rooms}); "
                         f"the pool has {pool}")
    for name, room in sorted(rooms.items(), key=lambda kv: -kv[1]):
        for w in pair:
            w.call(dict(cmd="hold", free=room))
        got = measure(pair, plan.rounds, lambda r, name=name: dict(
            cmd="replay", max_running=plan.max_running,
            requests=[dict(rid=q.rid, prompt=q.prompt, output=q.output, after=q.after)
                      for q in builtin(name, plan.scale, seed=first + r).requests]))
        same = all([o[k] for k in COUNTS] == [n[k] for k in COUNTS]
                   for o, n in zip(got["old"], got["new"], strict=True))
        counts = {side: {k: sum(g[k] for g in got[side]) for k in COUNTS} for side in got}
        for what, unit, num, den in (("admit", "µs/admission", "admit_ns", "admissions"),
                                     ("decode", "µs/token", "decode_ns", "decoded_tokens"),
                                     ("free", "µs/request", "free_ns", "admissions")):
            per = {side: [g[num] / g[den] for g in got[side]] for side in got}
            extra = dict(same_counts=same, counts=counts)
            if what == "decode":
                extra.update(old_call=got["old"][0]["decode_call"], new_call=got["new"][0]["decode_call"])
            rows.append(log(row("workload", pool, "xxhash", f"{name}: {what}", unit,
                                per["old"], per["new"], **extra)))
    for w in pair:
        w.call(dict(cmd="release"))
    return rows


def compare(old_src: Path, new_src: Path, plan: Plan, log=lambda r: r) -> tuple[list[dict], dict]:
    """Every row of ``plan`` for the prefixkv in ``old_src`` against ``new_src``. Returns the
    rows and the workers' hello replies. ``log`` sees each row as it is finished.

    The rounds are split over ``plan.sessions`` pairs of fresh worker processes, whose
    round values are pooled: one process's heap and cache layout can make a row 1.4x
    slower for its whole life on this VM (seen: a 32k-token hit at 650 µs in one process,
    460 µs in the next, same code and seeds), which pairing within a process cannot
    cancel."""
    per = plan.rounds // plan.sessions
    if per < 2 or per % 2 or per * plan.sessions != plan.rounds:
        raise ValueError(f"{plan.rounds} rounds do not split into {plan.sessions} sessions "
                         f"of an even number (>= 2) each")
    merged: dict[tuple, dict] = {}
    for s in range(plan.sessions):
        last = s == plan.sessions - 1
        rows, sides = _session(old_src, new_src, replace(plan, rounds=per), s * per,
                               log if last else (lambda r: r), merged)
    return rows, sides


def _session(old_src: Path, new_src: Path, plan: Plan, first: int, log,
             merged: dict) -> tuple[list[dict], dict]:
    """One pair of workers for ``plan.rounds`` rounds (seeds from round ``first``); each
    row's round values are added to those of the same row in ``merged``."""
    rows = []
    with workers(old_src, new_src, plan.clock, plan.warm_up_s) as pair:
        for pool in plan.pools:
            for mode in plan.modes:
                for w in pair:
                    w.call(dict(cmd="setup", pool=pool, mode=mode))
                got = (events_rows if mode.endswith("+both") else micro_rows)(
                    pair, plan, pool, mode, lambda r: r, first)
                if mode == "xxhash" and plan.workloads:
                    got += workload_rows(pair, plan, pool, lambda r: r, first)
                rows += [log(_merge(merged, r)) for r in got]
                for w in pair:
                    sent = w.call(dict(cmd="drop"))
                    if sent:  # (a live publisher's count: every batch sent, none dropped?)
                        print(f"{w.label} publisher, {pool} blocks, {mode}: {sent}",
                              file=sys.stderr, flush=True)
        return rows, {w.label: w.info for w in pair}


def _merge(merged: dict, r: dict) -> dict:
    """``r`` with the round values of the same row from earlier sessions, re-summarised."""
    key = (r["section"], r["pool_blocks"], r["mode"], r["row"])
    prev = merged.get(key)
    if prev is not None:
        extra = {k: v for k, v in r.items() if k not in _SUMMARY}
        if "same_counts" in r:
            extra["same_counts"] = r["same_counts"] and prev["same_counts"]
            extra["counts"] = {side: {k: prev["counts"][side][k] + r["counts"][side][k]
                                      for k in r["counts"][side]} for side in r["counts"]}
        r = row(r["section"], r["pool_blocks"], r["mode"], r["row"], r["unit"],
                prev["old_rounds_ns"] + r["old_rounds_ns"], prev["new_rounds_ns"] + r["new_rounds_ns"],
                **{k: v for k, v in extra.items()
                   if k not in ("section", "pool_blocks", "mode", "row", "unit")})
    merged[key] = r
    return r

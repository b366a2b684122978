"""vLLM's own scheduler on prefixkv: the scheduler thread's time per admission when the
prompt reaches it as token ids, and when the plug-in prepared it where vLLM built the
``Request`` (on the engine's input thread), side by side in one run.

    python benchmarks/bench_vllm_prepare.py [--rounds 9] [--requests 24] [--out benchmarks/results]

Needs vllm 0.33.0 (``make install-vllm``) and this tree's ``src`` first on the path (put
there below; ``PREFIXKV_SRC=DIR`` imports prefixkv from ``DIR`` instead). Three engines,
each vLLM's own ``EngineCore`` built unchanged over tests/engines/vllm_engine.py's
stand-in executor (no model: the scheduler is driven by hand, no step is run), prefix
caching on, 10,000 blocks of 16 tokens:

- ``prepared``: ``--scheduler-cls prefixkv.integrations.vllm.Scheduler``; the engine's
  block hasher is the plug-in's, which prepares each prompt as the Request is built;
- ``ids``: the same, with the engine's hasher put back to vLLM's own (what the plug-in
  did before): the scheduler's thread encodes the prompt at admission;
- ``vLLM``: vLLM's own scheduler and manager, for reference.

Requests are built as vLLM builds them, ``EngineCore.preprocess_add_request`` on an
``EngineCoreRequest``, on a thread of its own (the input thread), before the timing; that
thread's CPU time per request is reported too (vLLM hashes the blocks there in every
column; ``prepared`` adds prefixkv's prepare). Timed on the scheduler's (main) thread,
per admission: ``scheduler.add_request(request)`` and the ``schedule()`` call that
admits it alone (the whole prompt in that step); then, untimed, the request is finished
(``finish_requests``, its blocks freed, their content left cached). Workloads: 2k and
32k tokens, each as misses (unique prompts) and as hits (a shared prefix of 3/4 of the
prompt, cached by a first request that is not counted). Times are the thread's CPU time
(``time.thread_time_ns``: other processes' time slices on this shared 2-core machine do
not count); per round the median over its admissions, then the median over rounds; the
columns run in an order that rotates from round to round, and each ratio is the median
of the rounds' own ratios (paired). The load average is printed with the results.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import statistics
import sys
import threading
import time
from array import array
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, os.environ.get("PREFIXKV_SRC") or str(HERE.parent / "src"))
sys.path.insert(0, str(HERE.parent / "tests" / "engines"))

from vllm_engine import engine_core, engine_request  # noqa: E402

COLUMNS = ("ids", "prepared", "vLLM")
WORKLOADS = (("2k miss", 2048, False), ("2k hit", 2048, True), ("32k miss", 32768, False),
             ("32k hit", 32768, True))
NUM_BLOCKS = 10_000
MAX_LEN = 32768 + 64


def engines() -> dict[str, Any]:
    """The three engines of the module docstring."""
    prepared, ids = engine_core(num_blocks=NUM_BLOCKS, max_model_len=MAX_LEN), \
        engine_core(num_blocks=NUM_BLOCKS, max_model_len=MAX_LEN)
    ids.request_block_hasher = ids.request_block_hasher.vllm_hasher
    return {"ids": ids, "prepared": prepared,
            "vLLM": engine_core(None, num_blocks=NUM_BLOCKS, max_model_len=MAX_LEN)}


def prompts(rng: random.Random, n: int, count: int, hit: bool) -> list[list[int]]:
    """``count`` prompts of ``n`` tokens (ids below 2**15), unique or sharing 3/4 of
    their tokens (``hit``); with ``hit`` the first one seeds the cache."""
    shared = list(array("H", rng.randbytes(2 * n)))[: 3 * n // 4] if hit else []
    return [shared + [t & 0x7FFF for t in array("H", rng.randbytes(2 * (n - len(shared))))]
            for _ in range(count + hit)]


def built_on_input_thread(engine: Any, tag: str, batch: list[list[int]]) -> tuple[list[Any], float, float]:
    """The Requests, built by ``preprocess_add_request`` on a thread of its own, that
    thread's CPU µs per request, and of it the µs in prefixkv's prepare (0 without)."""
    out: list[Any] = []
    cpu: list[int] = []
    prompts = getattr(engine.request_block_hasher, "prompts", None)
    note = prompts.note if prompts is not None else None

    def timed_note(request: Any) -> None:
        t0 = time.thread_time_ns()
        assert note is not None
        note(request)
        cpu.append(time.thread_time_ns() - t0)

    def run() -> None:
        t0 = time.thread_time_ns()
        out.extend(engine.preprocess_add_request(engine_request(f"{tag}-{i}", p, max_tokens=1))[0]
                   for i, p in enumerate(batch))
        cpu.insert(0, time.thread_time_ns() - t0)

    if prompts is not None:
        prompts.note = timed_note  # this instance only, for this batch

    thread = threading.Thread(target=run, name="input")
    thread.start()
    thread.join()
    if prompts is not None:
        del prompts.note
    return out, cpu[0] / 1e3 / len(batch), sum(cpu[1:]) / 1e3 / len(batch)


def admissions(engine: Any, requests: list[Any], seeded: bool) -> list[float]:
    """Scheduler-thread CPU µs of each admission (the seeding request untimed)."""
    from vllm.v1.request import RequestStatus

    scheduler, times = engine.scheduler, []
    gc.collect()  # (a collection inside a timed admission is noise; one a round happens anyway)
    for i, r in enumerate(requests):
        t0 = time.thread_time_ns()
        scheduler.add_request(r)
        out = scheduler.schedule()
        t1 = time.thread_time_ns()
        assert out.num_scheduled_tokens.get(r.request_id), "the request was not admitted"
        scheduler.finish_requests(r.request_id, RequestStatus.FINISHED_ABORTED)
        if not (seeded and i == 0):
            times.append((t1 - t0) / 1e3)
    return times


Times = dict[tuple[str, str], list[float]]


def run(rounds: int, count: int) -> tuple[Times, Times, Times]:
    """Per (workload, column), each round's: median admission µs, the input thread's µs
    per request, and of it prefixkv's prepare."""
    rng = random.Random(7)
    eng = engines()
    sched: Times = {}
    built: Times = {}
    prep: Times = {}
    for k in range(rounds):
        order = COLUMNS[k % 3:] + COLUMNS[:k % 3]
        for name, n, hit in WORKLOADS:
            batch = prompts(rng, n, count if n < 32768 else max(4, count // 4), hit)
            for col in order:
                engine = eng[col]
                engine.scheduler.reset_prefix_cache()
                requests, per_request, preparing = built_on_input_thread(engine, f"{k}-{name}", batch)
                sched.setdefault((name, col), []).append(statistics.median(admissions(engine, requests, hit)))
                built.setdefault((name, col), []).append(per_request)
                prep.setdefault((name, col), []).append(preparing)
    return sched, built, prep


def table(sched: Times, built: Times, prep: Times) -> list[str]:
    med = statistics.median
    rows = ["| workload | scheduler µs: ids | prepared | vLLM | ids − prepared | ids / prepared "
            "| vLLM / prepared | input thread µs per Request: ids | prepared | vLLM "
            "| of which prefixkv's prepare |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, _, _ in WORKLOADS:
        s = {c: sched[(name, c)] for c in COLUMNS}
        ratio = med([i / p for i, p in zip(s["ids"], s["prepared"], strict=True)])
        vs = med([v / p for v, p in zip(s["vLLM"], s["prepared"], strict=True)])
        saved = med([i - p for i, p in zip(s["ids"], s["prepared"], strict=True)])
        rows.append(f"| {name} | {med(s['ids']):.1f} | {med(s['prepared']):.1f} | {med(s['vLLM']):.1f} "
                    f"| {saved:.1f} | {ratio:.2f}x | {vs:.1f}x | "
                    + " | ".join(f"{med(built[(name, c)]):.1f}" for c in COLUMNS)
                    + f" | {med(prep[(name, 'prepared')]):.1f} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--requests", type=int, default=24, help="admissions per workload and round "
                    "(a quarter of them for 32k prompts)")
    ap.add_argument("--out", type=Path, default=None, help="folder for vllm-plugin-prepare.md")
    args = ap.parse_args()
    load_before = os.getloadavg()
    sched, built, prep = run(args.rounds, args.requests)
    load_after = os.getloadavg()
    lines = [f"# vLLM 0.33.0's scheduler on prefixkv: prompts as ids or prepared on the input thread "
             f"({platform.machine()}, Python {platform.python_version()}, {os.cpu_count()} CPUs)", "",
             f"Command: `python benchmarks/bench_vllm_prepare.py --rounds {args.rounds} --requests "
             f"{args.requests}{' --out ' + str(args.out) if args.out else ''}`. "
             f"Load average (1, 5, 15 min) before: {', '.join(f'{x:.2f}' for x in load_before)}; "
             f"after: {', '.join(f'{x:.2f}' for x in load_after)}. "
             "Scheduler µs: this thread's CPU time for `add_request` + the `schedule()` that admits "
             "the request, median per round, median over rounds; ratios: the median of the rounds' "
             "own ratios. Input thread: CPU µs per `preprocess_add_request` (vLLM hashes the blocks "
             "there in every column; `prepared` adds prefixkv's prepare, timed apart in the last column). "
             "ids − prepared: the median of the rounds' differences.", "", *table(sched, built, prep)]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "vllm-plugin-prepare.md").write_text(text)


if __name__ == "__main__":
    main()

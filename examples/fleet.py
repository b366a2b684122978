"""Three example-engine processes behind prefixkv's router, for real, on loopback.

Each replica process runs the example engine (a tiny random-weight Llama on the CPU)
with a KVCacheManager (sha256 hashes), publishes its KV events in vLLM's wire format
(ZeroMQ PUB + replay ROUTER), serves Prometheus metrics on ``/metrics``, and takes
requests on a ZeroMQ PULL socket (msgpack; no pickle on any wire). The router process
subscribes to the three event streams, reads each replica's load (KV usage, queue depth)
from its ``/metrics`` with a ``MetricsPoller`` thread, and routes a multi-turn chat:
every turn re-sends the conversation so far. The same chat runs with ``prefix``
routing, ``cost`` routing (``CostScorer``, which weighs the polled loads) and
``round-robin`` (fresh replicas each time), and once on a single engine without a
cache, whose replies every routed run must reproduce token for token.

    python examples/fleet.py [--conversations 5] [--turns 4] [--replicas 3] [--timeout 120]
                             [--policies prefix,cost,round-robin]

Every wait has a deadline (``--timeout`` seconds, generous: a busy machine is slow, not
broken) and fails with what it waited for: the replicas' hello, their first heartbeat,
a reply, a replica's exit after its stop message.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable

import msgpack
import zmq

BLOCK_SIZE = 16


def replica(name: str, results: str, num_blocks: int, max_tokens: int) -> None:
    """A replica process: engine + event publisher + /metrics + request socket."""
    from prometheus_client import start_http_server

    from prefixkv import KVCacheManager
    from prefixkv.engine import LlamaConfig, SamplingParams, build_engine
    from prefixkv.fleet.metrics import CacheMetrics
    from prefixkv.fleet.publisher import EventPublisher

    config = LlamaConfig(num_layers=2)
    mgr = KVCacheManager(num_blocks, BLOCK_SIZE, hash_mode="sha256", enable_events=True,
                         vocab_size=config.vocab_size)
    engine = build_engine(config, allocator=mgr)
    metrics = CacheMetrics(model_name="tiny-llama", engine=name)
    server, _ = start_http_server(0, addr="127.0.0.1", registry=metrics.registry)
    ctx = zmq.Context.instance()
    inbox = ctx.socket(zmq.PULL)
    inbox.bind("tcp://127.0.0.1:*")
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(results)
    params = SamplingParams(max_tokens=max_tokens)
    # heartbeats every 0.1 s while idle (the default is 1 s): the router, which subscribes
    # after this replica's hello, hears it within 0.1 s instead of waiting out a second
    with EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", block_size=BLOCK_SIZE,
                        heartbeat=0.1) as pub:
        outbox.send(msgpack.packb({"hello": name, "requests": inbox.getsockopt_string(zmq.LAST_ENDPOINT),
                                   "events": pub.endpoint, "replay": pub.replay_endpoint,
                                   "metrics": f"http://127.0.0.1:{server.server_port}/metrics"}))
        while True:
            while inbox.poll(0 if engine.has_unfinished() else 20):
                msg = msgpack.unpackb(inbox.recv())
                if msg.get("stop"):  # exit promptly: nothing left to send waits on a peer
                    server.shutdown()
                    inbox.close(linger=0)
                    outbox.close(linger=1000)
                    return
                engine.add_request(msg["prompt"], params, request_id=msg["id"])
            if not engine.has_unfinished():
                continue
            rec = engine.step()
            pub.publish(rec.events)
            metrics.observe(rec.stats, rec.usage, rec.events, dropped_batches=pub.dropped_batches,
                            num_waiting=len(engine.scheduler.waiting),
                            num_running=len(engine.scheduler.running))
            for out in engine.take_finished():
                outbox.send(msgpack.packb({"id": out.request_id, "tokens": list(out.token_ids)}))


def scrape(url: str) -> tuple[float, float]:
    """(queries, hits) from one replica's /metrics."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    values = {}
    for line in text.splitlines():
        for key in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
            if line.startswith(key + "{"):
                values[key] = float(line.rsplit(" ", 1)[1])
    return values["vllm:prefix_cache_queries_total"], values["vllm:prefix_cache_hits_total"]


def wait_until(done: Callable[[], bool], what: str, timeout: float) -> None:
    """Poll ``done`` until it is true; TimeoutError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:.0f} s for {what}")
        time.sleep(0.05)


def receive(sock: zmq.Socket, what: str, timeout: float, procs: dict[str, subprocess.Popen]) -> dict:
    """The next message on ``sock``; TimeoutError naming ``what`` after ``timeout`` s, or
    RuntimeError as soon as a replica process has died (no message will come from it)."""
    deadline = time.monotonic() + timeout
    while not sock.poll(100):
        dead = [name for name, p in procs.items() if p.poll() is not None]
        if dead:
            raise RuntimeError(f"replica {', '.join(dead)} exited while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:.0f} s for {what}")
    return msgpack.unpackb(sock.recv())


def await_indexed(router, lock, served, timeout: float = 10.0) -> None:
    """Wait until the router indexes, for each ``(replica, prompt)`` answered this turn, the
    prompt's full blocks on that replica: the replica published them before its reply, but
    on another socket, and the next turn is routed on what the replicas hold. For at most
    ``timeout`` s and no error: a replica that evicted some of them meanwhile never gets
    there, and routing on less is only routing less well."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with lock:
            if all(router.cached_tokens(p)[r] >= len(p) // BLOCK_SIZE * BLOCK_SIZE for r, p in served):
                return
        time.sleep(0.01)


def await_first_heartbeats(router, names: list[str], timeout: float) -> None:
    """Wait until the router has heard every replica (its first heartbeat or event);
    TimeoutError naming the silent ones: routing without them would skew every number."""
    try:
        wait_until(lambda: len(router.live()) == len(names), "every replica's first heartbeat",
                   timeout)
    except TimeoutError as exc:
        silent = sorted(set(names) - set(router.live()))
        raise TimeoutError(f"{exc}: no heartbeat from {', '.join(silent)}") from None


def stop_replicas(procs: dict[str, subprocess.Popen], timeout: float) -> None:
    """Wait for each replica to exit after its stop message; kill the ones still running
    at the deadline and raise RuntimeError naming them."""
    deadline = time.monotonic() + timeout
    stuck = []
    for name, p in procs.items():
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            stuck.append(name)
    if stuck:
        raise RuntimeError(f"waited {timeout:.0f} s for replica {', '.join(stuck)} to exit "
                           f"after its stop message (killed)")


def run_fleet(policy: str, convs, system, args) -> dict:
    """Start the replicas, route the chat, return replies, per-replica counts, hit rate."""
    from prefixkv.router import CostScorer, Router
    from prefixkv.router.poller import MetricsPoller
    from prefixkv.router.subscriber import Subscriber

    ctx = zmq.Context.instance()
    results = ctx.socket(zmq.PULL)
    results.bind("tcp://127.0.0.1:*")
    endpoint = results.getsockopt_string(zmq.LAST_ENDPOINT)
    names = [f"r{i}" for i in range(args.replicas)]
    # plain processes with their settings on the command line: nothing is pickled
    procs = {n: subprocess.Popen([sys.executable, __file__, "--serve-replica", n, endpoint,
                                  str(args.num_blocks), str(args.max_tokens)]) for n in names}
    try:
        info: dict[str, dict] = {}
        while len(info) < len(names):
            msg = receive(results, f"the hello of {len(names) - len(info)} more replica(s)",
                          args.timeout, procs)
            info[msg["hello"]] = msg
        scorer = CostScorer(prefill_weight=2.0, balance=1.1) if policy == "cost" else None
        router = Router(names, block_size=BLOCK_SIZE, policy="prefix" if policy == "cost"
                        else policy, scorer=scorer, stale_after=5.0,
                        capacity=dict.fromkeys(names, args.num_blocks))
        sub = Subscriber(router, {n: (info[n]["events"], info[n]["replay"]) for n in names})
        sub.start()
        # a replica busy computing answers its /metrics late: a read may time out (counted)
        poller = MetricsPoller(router, {n: info[n]["metrics"] for n in names}, period=0.5,
                               timeout=0.5)
        poller.start()
        inboxes = {n: ctx.socket(zmq.PUSH) for n in names}
        for n, sock in inboxes.items():
            sock.connect(info[n]["requests"])
        await_first_heartbeats(router, names, args.timeout)
        histories = [list(system) for _ in convs]
        replies: list[list] = [[] for _ in convs]
        where = {}
        for t in range(args.turns):
            served = []
            for c, conv in enumerate(convs):
                histories[c] += conv[t]
                with sub.lock:  # the router's thread: the polled loads go in, then route
                    poller.apply()
                    where[c] = router.route(histories[c]).replica
                inboxes[where[c]].send(msgpack.packb({"id": c, "prompt": histories[c]}))
                served.append((where[c], list(histories[c])))
            for _ in convs:
                msg = receive(results, f"a reply of turn {t + 1}", args.timeout, procs)
                with sub.lock:
                    router.finish(where[msg["id"]])
                replies[msg["id"]].append(msg["tokens"])
                histories[msg["id"]] += msg["tokens"]
            await_indexed(router, sub.lock, served)  # before the next turn is routed
        counts = [scrape(info[n]["metrics"]) for n in names]
        with sub.lock:
            poller.apply()
            loads = poller.health()["replicas"]
        poller.close()
        for sock in inboxes.values():
            sock.send(msgpack.packb({"stop": True}))
        stop_replicas(procs, args.timeout)
        sub.close()
        results.close(linger=0)
        queries, hits = sum(q for q, _ in counts), sum(h for _, h in counts)
        return {"replies": replies, "routed": [router.routed[n] for n in names],
                "hit_rate": hits / queries, "gaps": sub.gaps_filled, "resyncs": sub.resyncs,
                "load_reads": sum(h["scrapes"] for h in loads.values()),
                "load_failures": sum(h["failures"] for h in loads.values())}
    finally:  # no replica outlives the run, whatever failed
        for p in procs.values():
            if p.poll() is None:
                p.kill()


def run_single(convs, system, args, caching: bool) -> dict:
    """The same chat on one in-process engine (the reference)."""
    from prefixkv import KVCacheManager
    from prefixkv.engine import LlamaConfig, SamplingParams, build_engine, run_chat

    config = LlamaConfig(num_layers=2)
    mgr = KVCacheManager(args.num_blocks, BLOCK_SIZE, hash_mode="sha256",
                         enable_caching=caching, vocab_size=config.vocab_size)
    chat = run_chat(build_engine(config, allocator=mgr), convs,
                    SamplingParams(max_tokens=args.max_tokens), system_prompt=system)
    return {"replies": [[list(r) for r in conv] for conv in chat.replies],
            "hit_rate": mgr.stats.hit_rate}


def main(argv: list[str] | None = None) -> None:
    from prefixkv.engine import LlamaConfig, synthetic_conversations

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve-replica"]:  # a replica process started by run_fleet
        name, results, num_blocks, max_tokens = argv[1:5]
        replica(name, results, int(num_blocks), int(max_tokens))
        return

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=3, help="engine processes behind the router")
    ap.add_argument("--conversations", type=int, default=5, help="chats routed")
    ap.add_argument("--turns", type=int, default=4, help="turns per chat")
    ap.add_argument("--message-len", type=int, default=24, help="tokens of each user message")
    ap.add_argument("--system-len", type=int, default=128, help="tokens of the shared system prompt")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens generated per reply")
    ap.add_argument("--num-blocks", type=int, default=256, help="KV blocks in each replica's pool")
    ap.add_argument("--policies", default="prefix,cost,round-robin",
                    help="comma-separated: prefix, cost, round-robin, least-loaded")
    ap.add_argument("--timeout", type=float, default=120.0,
                    help="seconds each wait (hello, heartbeat, reply, exit) may take")
    args = ap.parse_args(argv)
    vocab = LlamaConfig().vocab_size
    system = [1 + (i * 7919) % (vocab - 1) for i in range(args.system_len)]
    convs = synthetic_conversations(args.conversations, args.turns, args.message_len,
                                    vocab_size=vocab, seed=0)
    reference = run_single(convs, system, args, caching=False)
    single = run_single(convs, system, args, caching=True)
    print(f"{args.conversations} conversations x {args.turns} turns, system prompt "
          f"{args.system_len} tokens, {args.replicas} replica processes")
    print(f"one engine, cache on : hit rate {single['hit_rate']:.1%}")
    ok = single["replies"] == reference["replies"]
    for policy in args.policies.split(","):
        res = run_fleet(policy, convs, system, args)
        same = res["replies"] == reference["replies"]
        ok = ok and same
        print(f"fleet, {policy:<11}: hit rate {res['hit_rate']:.1%} (from /metrics), "
              f"requests per replica {res['routed']}, load reads {res['load_reads']} "
              f"(failed {res['load_failures']}), replies identical to no-cache run: {same}")
    if not ok:
        raise SystemExit("replies differ from the no-cache run")


if __name__ == "__main__":
    main()

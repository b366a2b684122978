"""MetricsPoller against real HTTP servers on loopback (http.server in threads): one
that serves vLLM's Prometheus text, one that hangs, one that trickles, one that answers
garbage, one that disappears. No mock stands in for a server."""

import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from prefixkv.router import ReplicaLoad, Router, RouterError
from prefixkv.router.poller import MetricsPoller
from waiting import LIVE, wait_until

BS = 16
METRICS = """# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} %s
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} %s
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
"""


class Server:
    """A real HTTP server on 127.0.0.1 in a thread; ``mode`` says how it answers:
    "ok" (METRICS with ``usage``/``waiting``), "hang" (never answers), "trickle" (headers,
    then one byte every 0.1 s), "slow-headers" (a header of one byte every 0.1 s),
    "garbage" (200 with bytes that are not Prometheus text),
    "binary" (not UTF-8), "error" (HTTP 500), "big" (a 64 KiB answer)."""

    def __init__(self, mode: str = "ok", port: int = 0) -> None:
        self.mode, self.usage, self.waiting = mode, 0.25, 2
        self.hits = 0
        self.release = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                outer.hits += 1
                mode = outer.mode
                if mode == "hang":
                    outer.release.wait(10)
                    return
                if mode == "slow-headers":  # a status line, then a header byte each 0.1 s
                    self.wfile.write(b"HTTP/1.1 200 OK\r\nX-Pad: ")
                    for _ in range(400):
                        self.wfile.flush()
                        if outer.release.wait(0.1):
                            return
                        self.wfile.write(b"x")
                    return
                body = {"ok": (METRICS % (outer.usage, outer.waiting)).encode(),
                        "trickle": (METRICS % (0.5, 0)).encode(),
                        "garbage": b"<html>502 Bad Gateway</html>\nvllm:kv_cache_usage_perc NaN\n",
                        "binary": b"\xff\xfe\x00garbage",
                        "big": b"# " + b"x" * 65536 + b"\n",
                        "error": b"boom"}[mode]
                self.send_response(500 if mode == "error" else 200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if mode == "trickle":
                    for i in range(len(body)):
                        if outer.release.wait(0.1):
                            return
                        self.wfile.write(body[i:i + 1])
                        self.wfile.flush()
                else:
                    self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/metrics"
        # serve_forever looks at its shutdown flag between polls: at its default 0.5 s,
        # each stop() waited up to 0.5 s for the loop to notice.
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Disappear: stop serving and close the listening socket (connections refused)."""
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def servers():
    made: list[Server] = []

    def make(mode: str = "ok", port: int = 0) -> Server:
        made.append(Server(mode, port))
        return made[-1]

    yield make
    for s in made:
        s.stop()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def router_for(names, clock=None):
    return Router(names, block_size=BS, capacity=dict.fromkeys(names, 1000),
                  clock=clock or time.monotonic)


def test_scraped_loads_reach_the_router_only_at_apply(servers):
    a, b = servers(), servers()
    b.usage, b.waiting = 0.75, 5
    router = router_for(["a", "b"])
    with MetricsPoller(router, {"a": a.url, "b": b.url}, timeout=LIVE, period=LIVE) as poller:
        poller.scrape()
        assert router.loads.reported == {}  # the router's thread has not applied it yet
        assert poller.apply() == 2
        assert router.loads.reported == {"a": ReplicaLoad(0.25, 2), "b": ReplicaLoad(0.75, 5)}
        assert router.loads.active_blocks("b") == 750
        assert poller.apply() == 0  # nothing new read
        h = poller.health()["replicas"]
        assert h["a"]["scrapes"] == h["b"]["scrapes"] == 1
        assert h["a"]["failures"] == 0 and h["a"]["last_error"] is None and not h["a"]["stale"]


@pytest.mark.parametrize("mode", ["hang", "trickle", "slow-headers"])
def test_a_slow_server_costs_one_timeout_and_delays_no_other_replica(servers, mode):
    slow, ok = servers(mode), servers()
    router = router_for(["slow", "ok"])
    # (the timeout is the healthy server's too: 2 s, which a busy machine needs, not 0.5)
    with MetricsPoller(router, {"slow": slow.url, "ok": ok.url}, timeout=2.0, period=2.0) as poller:
        t0 = time.monotonic()
        poller.scrape()
        took = time.monotonic() - t0
        assert 1.9 <= took < 12.0, took  # a trickle (40 s of bytes) does not stretch it
        poller.apply()
        assert "ok" in router.loads.reported and "slow" not in router.loads.reported
        h = poller.health()["replicas"]["slow"]
        assert h["failures"] == 1 and h["scrapes"] == 0
        assert "timed out" in h["last_error"]


@pytest.mark.parametrize("mode,error", [("garbage", "LoadError"), ("binary", "UnicodeDecodeError"),
                                        ("error", "HTTP 500"), ("big", "larger than")])
def test_bad_answers_are_counted_not_reported(servers, mode, error):
    bad = servers(mode)
    router = router_for(["bad"])
    with MetricsPoller(router, {"bad": bad.url}, max_bytes=4096, timeout=LIVE, period=LIVE) as poller:
        poller.scrape()
        poller.scrape()
        assert poller.apply() == 0 and router.loads.reported == {}
        h = poller.health()["replicas"]["bad"]
        assert h["failures"] == 2 and error in h["last_error"]


def test_a_replica_that_disappears_goes_stale_and_the_router_uses_its_own_estimate(servers):
    clock = Clock()
    gone = servers()
    router = router_for(["gone"], clock)
    period = LIVE  # (the clock is the test's: a period only bounds the timeout of a read)
    poller = MetricsPoller(router, {"gone": gone.url}, period=period, timeout=LIVE, stale_periods=3)
    try:
        poller.scrape()
        poller.apply()
        prompt = list(range(1, 33))  # 2 blocks
        router.route(prompt)
        assert router.loads.active_blocks("gone") == 250 + 2  # reported + routed since
        gone.stop()
        port = gone.port
        for _ in range(3):
            clock.now += period
            poller.scrape()
            poller.apply()
            assert not poller.health()["replicas"]["gone"]["stale"]  # not yet 3 periods
        clock.now += period / 2
        poller.scrape()
        poller.apply()
        h = poller.health()["replicas"]["gone"]
        assert h["stale"] and h["stale_spells"] == 1 and h["failures"] == 4
        assert h["age"] == pytest.approx(3.5 * period)
        assert "gone" not in router.loads.reported
        assert router.loads.active_blocks("gone") == 2  # the request in flight, alone
        poller.apply()
        assert poller.health()["replicas"]["gone"]["stale_spells"] == 1  # once per spell
        back = servers("ok", port)  # it comes back on the same address
        back.usage = 0.5
        poller.scrape()
        poller.apply()
        h = poller.health()["replicas"]["gone"]
        assert not h["stale"] and h["scrapes"] == 2 and router.loads.reported["gone"].kv_usage == 0.5
    finally:
        poller.close()


def test_a_replica_never_read_goes_stale_after_the_periods_from_start(servers):
    clock = Clock()
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{free.getsockname()[1]}/metrics"
    free.close()  # nothing listens there: connection refused
    router = router_for(["x"], clock)
    with MetricsPoller(router, {"x": url}, period=1.0, stale_periods=2) as poller:
        poller.scrape()
        poller.apply()
        assert not poller.health()["replicas"]["x"]["stale"]
        clock.now += 2.5
        poller.apply()
        h = poller.health()["replicas"]["x"]
        assert h["stale"] and h["age"] is None and h["failures"] == 1
        assert "Connection" in h["last_error"] or "refused" in h["last_error"]


def test_what_was_routed_after_the_read_still_counts(servers):
    """A load read at t knows nothing of requests routed after t: they stay in the
    router's estimate when the report is applied later; those routed before t do not."""
    clock = Clock()
    srv = servers()
    srv.usage = 0.0
    router = router_for(["a"], clock)
    prompt = list(range(1, 33))  # 2 blocks
    router.report_load("a", ReplicaLoad(0.0))
    router.route(prompt)  # at 100: before the read
    with MetricsPoller(router, {"a": srv.url}, timeout=LIVE, period=LIVE) as poller:
        clock.now = 101.0
        poller.scrape()  # read at 101
        clock.now = 102.0
        router.route(prompt + [7] * 16)  # 3 blocks, after the read
        poller.apply()
        assert router.loads.active_blocks("a") == 3 and router.loads.prefill_blocks("a") == 3


def test_the_thread_scrapes_every_period_until_closed(servers):
    srv = servers()
    router = router_for(["a"])
    poller = MetricsPoller(router, {"a": srv.url}, period=0.5, timeout=0.5)  # (a read may time out)
    poller.start()
    with pytest.raises(RouterError, match="twice"):
        poller.start()
    wait_until(lambda: poller.health()["replicas"]["a"]["scrapes"] >= 3, "three reads")
    assert poller.alive and poller.apply() == 1
    poller.close()
    assert not poller.alive and poller.health()["loop_errors"] == 0


def test_bad_options_are_refused_before_any_thread_starts():
    router = router_for(["a"])
    for urls, kw in [({}, {}), ({"z": "http://127.0.0.1:1/metrics"}, {}),
                     ({"a": "ftp://h/metrics"}, {}), ({"a": "127.0.0.1:9/metrics"}, {}),
                     ({"a": "http://h/m"}, dict(period=0)), ({"a": "http://h/m"}, dict(timeout=2.0)),
                     ({"a": "http://h/m"}, dict(stale_periods=0)),
                     ({"a": "http://h/m"}, dict(max_bytes=0)),
                     # found by audit-router-r8: a pool of 0 failed every scrape instead,
                     # and a str period raised TypeError
                     ({"a": "http://h/m"}, dict(num_blocks={"a": 0})),
                     ({"a": "http://h/m"}, dict(num_blocks={"a": True})),
                     ({"a": "http://h/m"}, dict(num_blocks={"z": 8})),
                     ({"a": "http://h/m"}, dict(period="1")),
                     ({"a": "http://h/m"}, dict(stale_periods=True))]:
        with pytest.raises(RouterError):
            MetricsPoller(router, urls, **kw)
    with pytest.raises(RouterError, match="unknown replica"):
        router.drop_load("z")


def test_a_step_back_of_the_clock_keeps_no_silent_replicas_load(servers):
    # found by audit: staleness compared raw readings, so after a step back of a day the
    # load of a replica never read again stayed reported for a day more
    clock = Clock()
    clock.now = 86400.0
    gone = servers()
    router = router_for(["gone"], clock)
    with MetricsPoller(router, {"gone": gone.url}, period=LIVE, timeout=LIVE,
                       stale_periods=2) as poller:
        poller.scrape()
        poller.apply()
        gone.stop()
        clock.now = 0.0  # back a day: no time passes
        poller.apply()
        assert not poller.health()["replicas"]["gone"]["stale"]
        clock.now = 2.5 * LIVE  # 2.5 periods of forward motion since the read
        poller.apply()
        h = poller.health()["replicas"]["gone"]
        assert h["stale"] and h["age"] == pytest.approx(2.5 * LIVE)
        assert "gone" not in router.loads.reported


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "1", None])
def test_a_clock_reading_that_is_not_a_finite_number_is_refused_before_any_change(servers, bad):
    clock = Clock()
    srv = servers()
    router = router_for(["a"], clock)
    with MetricsPoller(router, {"a": srv.url}, period=LIVE, timeout=LIVE) as poller:
        poller.scrape()
        clock.now = bad
        with pytest.raises(RouterError, match="finite"):
            poller.apply()  # (a NaN limit: nothing would go stale again)
        with pytest.raises(RouterError, match="finite"):
            poller.scrape()
        assert router.loads.reported == {}  # the load read before is not applied either
        clock.now = 101.0
        assert poller.apply() == 1 and poller.health()["replicas"]["a"]["scrapes"] == 1


def test_a_second_start_is_a_router_error(servers):
    """``start``'s documented Raises: a poller runs one thread, started once."""
    router = router_for(["a"])
    with MetricsPoller(router, {"a": servers().url}, timeout=LIVE, period=LIVE) as poller:
        poller.start()
        thread = poller._thread
        with pytest.raises(RouterError, match="called twice"):
            poller.start()
        assert poller._thread is thread

"""The sweep of test_bad_input_sweep.py, over the fleet's public constructors: the router
and its scorers and index (``prefixkv.router``), the ZeroMQ subscriber
(``prefixkv.router.subscriber``), the metrics poller and the event publisher
(``prefixkv.fleet.publisher``). Each parameter, given each value it must refuse: a
``PrefixKVError`` whose message names the parameter, raised before any thread starts,
never an untyped error or a silent acceptance. The router a subscriber or poller is
given is unchanged afterwards.

Cases marked xfail(strict=True) are defects found by this sweep in modules this file's
owner does not own (prefixkv/router/, prefixkv/fleet/, prefixkv/core/): each passes the
day its module checks the parameter, and strict makes that day fail the suite until the
mark is removed."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

import pytest

from prefixkv import PrefixKVError

pytest.importorskip("zmq", reason="the subscriber and publisher need prefixkv[events]")

NOT_COUNT: list[Any] = [None, -1, 0, 1.5, math.nan, True, "x", b"ab", [], object()]
NOT_SECONDS: list[Any] = [None, -1, 0, math.nan, math.inf, True, "1", b"ab", [], object()]
NOT_WEIGHT: list[Any] = [None, -1, math.nan, math.inf, True, "1", b"ab", [], object()]
NOT_FRACTION_OR_NONE: list[Any] = [-1, math.nan, True, "1", b"ab", [], object()]
NOT_TEXT: list[Any] = [None, 5, b"kv", True, [], object()]
NOT_OBJECT: list[Any] = [5, "x", b"ab", [], object()]
NOT_NAMES: list[Any] = [None, 5, "ab", b"ab", [], [5], [""], ["a", "a"], object()]
NOT_ENDPOINT: list[Any] = [None, "", "x", 5, b"tcp://127.0.0.1:*", object()]


def _router() -> Any:
    from prefixkv.router import Router
    return Router(["a", "b"], block_size=4)


def _state(router: Any) -> tuple[Any, ...]:
    return (router.replicas, dict(router.in_flight), dict(router.routed), dict(router.last_heard),
            router.index.prefix_runs([b"x" * 16], list(router.replicas)))


Constructor = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any], dict[str, list[Any]]]


def _constructors(router: Any) -> dict[str, Constructor]:
    """name -> (the constructor, valid positional and keyword arguments, each parameter's
    values to refuse)."""
    from prefixkv.fleet.publisher import EventPublisher
    from prefixkv.router import AffinityScorer, ApproxIndex, CostScorer, MetricsPoller, Router
    from prefixkv.router.subscriber import Subscriber

    return {
        # each parameter swept alone beside block_size (the scorer's keywords beside a scorer
        # are a mistake of their own)
        "Router": (Router, (["a", "b"],), dict(block_size=4),
                   dict(replicas=NOT_NAMES, block_size=NOT_COUNT, hash_mode=[None, "", "md5", 5],
                        hash_format=[None, "", "hex", 5], policy=[None, "", "best", 5],
                        # (None: the default scorer's own value, the documented default)
                        load_weight=NOT_WEIGHT[1:], balance=[0.5, math.nan, "1", True, object()],
                        cpu_weight=NOT_WEIGHT[1:], stale_after=[-1, math.nan, "1", True, object()],
                        index=NOT_OBJECT, scorer=NOT_OBJECT,
                        capacity=[5, "x", {"a": -1}, {"a": "x"}, {"zz": 5}, object()])),
        "AffinityScorer": (AffinityScorer, (), dict(load_weight=1.0, balance=1.25, cpu_weight=0.5,
                                                    lossy_weight=0.5),
                           dict(load_weight=NOT_WEIGHT, cpu_weight=NOT_WEIGHT, lossy_weight=NOT_WEIGHT,
                                balance=[None, 0.5, math.nan, "1", True, object()])),
        "CostScorer": (CostScorer, (), dict(prefill_weight=1.0, temperature=0.0, busy_threshold=0.95,
                                            cpu_weight=0.5, balance=None, hold=64, seed=0, lossy_weight=0.5),
                       dict(prefill_weight=NOT_WEIGHT, temperature=[v for v in NOT_WEIGHT if v != math.inf],
                            cpu_weight=NOT_WEIGHT,
                            lossy_weight=NOT_WEIGHT, busy_threshold=NOT_FRACTION_OR_NONE,
                            balance=[0.5, math.nan, "1", True, object()],
                            hold=[None, -1, 1.5, math.nan, True, "1", 2**70])),
        "ApproxIndex": (ApproxIndex, (120.0,), {}, dict(ttl=[v for v in NOT_SECONDS if v != math.inf])),
        "Subscriber": (Subscriber, (router, {"a": ("tcp://127.0.0.1:5999", None)}),
                       dict(topic="kv-events", replay_timeout=1.0),
                       dict(router=NOT_OBJECT + [None], endpoints=[None, 5, "x", {"a": "x"}, {"a": (5, None)},
                                                                   {"zz": ("tcp://127.0.0.1:5999", None)}],
                            topic=NOT_TEXT, replay_timeout=NOT_SECONDS)),
        "MetricsPoller": (MetricsPoller, (router, {"a": "http://127.0.0.1:1/metrics"}),
                          dict(period=1.0, timeout=0.5, stale_periods=3, max_bytes=4096, num_blocks=None),
                          dict(router=NOT_OBJECT + [None], urls=[None, 5, "x", {"a": 5}, {"zz": "http://x/"}],
                               period=[v for v in NOT_SECONDS if v != math.inf], timeout=NOT_SECONDS,
                               stale_periods=NOT_COUNT,
                               max_bytes=NOT_COUNT, num_blocks=[5, "x", {"a": -1}, {"a": "x"}, object()])),
        "EventPublisher": (EventPublisher, ("tcp://127.0.0.1:*", None),
                           dict(block_size=4, topic="kv-events", hash_format="int", dp_rank=0,
                                buffer_steps=100, max_queue=16, heartbeat=1.0, hwm=1000),
                           dict(endpoint=NOT_ENDPOINT, replay_endpoint=NOT_ENDPOINT[1:],
                                block_size=NOT_COUNT, topic=NOT_TEXT, hash_format=[None, "", "hex", 5],
                                # (2**64: no msgpack int; every batch then failed in the thread)
                                dp_rank=[None, -1, 1.5, "0", True, 2**64, 2**70],
                                buffer_steps=NOT_COUNT + [2**70],
                                max_queue=NOT_COUNT, heartbeat=[-1, 0, math.nan, "1", True],
                                hwm=[v for v in NOT_COUNT if v != 0])),
    }


def _close(obj: Any) -> None:
    close = getattr(obj, "close", None)
    if close is not None:
        close()


def _sweep(name: str, param: str) -> list[str]:
    router = _router()
    make, args, kw, bad = _constructors(router)[name]
    params = [p for p in make.__init__.__code__.co_varnames if p != "self"]
    before = _state(router)
    problems = []
    for v in bad[param]:
        i = params.index(param)
        if i < len(args):
            call_args, call_kw = args[:i] + (v,) + args[i + 1:], kw
        else:
            call_args, call_kw = args, {**kw, param: v}
        threads = threading.active_count()
        try:
            _close(make(*call_args, **call_kw))
        except PrefixKVError as e:
            if threading.active_count() != threads:
                problems.append(f"{param}={v!r}: raised after starting a thread")
            if not any(word in str(e) for word in (param, *ALIASES.get(param, ()))):
                problems.append(f"{param}={v!r}: the message does not name {param}: {e}")
        except Exception as e:  # noqa: BLE001 (the point: which untyped errors escape)
            problems.append(f"{param}={v!r}: {type(e).__name__}: {e}")
        else:
            problems.append(f"{param}={v!r}: accepted")
        if _state(router) != before:
            problems.append(f"{param}={v!r}: the router changed")
    return problems


# Words a message may name a parameter by: a mapping's bad key or value is named as what
# it stands for.
ALIASES = {"endpoints": ("replica",), "urls": ("URL",)}

# (constructor, parameter) -> the first value the sweep found wanting, for a defect known
# and not yet fixed (marked strict xfail). None left: the 26 this sweep found (untyped
# TypeError/AttributeError/ZMQError/OverflowError, bools and bad objects accepted) were
# fixed by router/options.py and fleet/options.py.
DEFECTS: dict[tuple[str, str], str] = {}


def _cases() -> list[Any]:
    names = {"Router": ["replicas", "block_size", "hash_mode", "hash_format", "policy", "load_weight",
                        "balance", "cpu_weight", "stale_after", "index", "scorer", "capacity"],
             "AffinityScorer": ["load_weight", "cpu_weight", "lossy_weight", "balance"],
             "CostScorer": ["prefill_weight", "temperature", "cpu_weight", "lossy_weight", "busy_threshold",
                            "balance", "hold"],
             "ApproxIndex": ["ttl"],
             "Subscriber": ["router", "endpoints", "topic", "replay_timeout"],
             "MetricsPoller": ["router", "urls", "period", "timeout", "stale_periods", "max_bytes",
                               "num_blocks"],
             "EventPublisher": ["endpoint", "replay_endpoint", "block_size", "topic", "hash_format",
                                "dp_rank", "buffer_steps", "max_queue", "heartbeat", "hwm"]}
    out = []
    for name, params in names.items():
        for param in params:
            marks = ([pytest.mark.xfail(strict=True, reason=f"{name}: {DEFECTS[name, param]}")]
                     if (name, param) in DEFECTS else [])
            out.append(pytest.param(name, param, id=f"{name}-{param}", marks=marks))
    return out


@pytest.mark.parametrize(("name", "param"), _cases())
def test_every_bad_argument_of_a_fleet_constructor_is_a_typed_error_before_any_change(name, param):
    assert _sweep(name, param) == []


@pytest.mark.parametrize(("param", "value"), [
    pytest.param("stats", None, id="stats-None"),
    pytest.param("usage", "x", id="usage-str"),
    pytest.param("usage", math.nan, id="usage-nan"),
    pytest.param("events", None, id="events-None"),
    pytest.param("dropped_batches", "x", id="dropped-str"),
    pytest.param("dropped_batches", -1, id="dropped-negative"),
    pytest.param("hits_by_source", {"device": -1}, id="hits-negative"),
    pytest.param("hits_by_source", {"device": "x"}, id="hits-str"),
    pytest.param("num_waiting", "x", id="waiting-str"),
    pytest.param("num_running", object(), id="running-object"),
    pytest.param("num_running", -1, id="running-negative"),
    pytest.param("usage", 1.5, id="usage-above-1"),
    pytest.param("usage", True, id="usage-bool"),
    pytest.param("events", 5, id="events-int"),
    pytest.param("hits_by_source", {5: 1}, id="hits-int-source"),
    pytest.param("stats", "negative", id="stats-negative-queries"),
])
def test_a_bad_observation_is_a_typed_error_before_any_metric_moves(param, value):
    """``CacheMetrics.observe`` given one bad argument: a ``PrefixKVError`` naming it,
    and the exposition (every counter and gauge) as it was."""
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry

    from prefixkv import PrefixCacheStats
    from prefixkv.fleet.metrics import CacheMetrics

    metrics = CacheMetrics(CollectorRegistry())
    metrics.observe(PrefixCacheStats(requests=1, queries=8, hits=4), 0.25)
    before = metrics.exposition()
    if value == "negative":
        value = PrefixCacheStats(requests=1, queries=-10, hits=5)
    kwargs: dict[str, Any] = {"stats": PrefixCacheStats(requests=1, queries=10, hits=5), "usage": 0.5,
                              param: value}
    with pytest.raises(PrefixKVError, match=param):
        metrics.observe(**kwargs)
    assert metrics.exposition() == before

"""The checks ``RedisStore`` makes of its arguments before it imports redis-py or
connects anywhere: every caller mistake a ``ConfigError`` (a ``PrefixKVError``), never a
redis-py error from deep inside a connection."""

from __future__ import annotations

import urllib.parse

from ..errors import ConfigError, check_flag

URL_SCHEMES = ("redis://", "rediss://", "unix://")
"""The URL schemes a ``RedisStore`` takes (redis-py's)."""
MAX_DEADLINE = 2.0**40
"""The largest ``read_into`` deadline magnitude (some 35,000 years of ``time.monotonic``):
2**63 overflowed the socket's timeout (OverflowError) after the connection was made."""


def check_store_args(url: object, timeout: object, ttl: object, cluster: object,
                     ca_certs: object) -> None:
    """``RedisStore(url, timeout=, ttl=, cluster=, ca_certs=)``: a str URL of
    ``URL_SCHEMES``, a finite timeout > 0 (seconds), an int ttl > 0 (seconds), a bool
    ``cluster``, ``ca_certs`` None or a non-empty path. Raises ConfigError."""
    if type(timeout) not in (int, float) or not 0 < timeout < float("inf"):  # type: ignore[operator]
        raise ConfigError(f"timeout must be a positive finite number of seconds, got {timeout!r}")
    if type(ttl) is not int or ttl <= 0:
        raise ConfigError(f"ttl must be a positive int (seconds), got {ttl!r}")
    if type(url) is not str or not url.startswith(URL_SCHEMES):
        raise ConfigError(f"url must be a str starting with one of {', '.join(URL_SCHEMES)}, "
                          f"got {url!r}")
    check_url(url)
    check_flag("cluster", cluster, ConfigError)
    if ca_certs is not None and (type(ca_certs) is not str or not ca_certs):
        raise ConfigError(f"ca_certs must be None or a PEM file's path, got {ca_certs!r}")


def check_url(url: str) -> None:
    """A URL of ``URL_SCHEMES`` whose parts name one server and one database: a port in
    1..65535 when given, a path (redis://, rediss://) that is empty or ``/<db>``, a
    non-empty socket path (unix://), and a ``db`` query, when given, a number (a
    database is an int >= 0). redis-py's own parser takes worse quietly (``/abc`` as
    database 0, ``/1/2`` as database 12) or raises a plain ValueError (a port past
    65535). Raises ConfigError."""
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = -1
    if port is not None and not 0 < port < 65536:
        raise ConfigError(f"url {url!r}: the port must be an int in 1..65535")
    dbs = urllib.parse.parse_qs(parts.query).get("db", [])
    if parts.scheme == "unix":
        if not parts.path:
            raise ConfigError(f"url {url!r}: a unix:// URL names the socket's path")
    elif parts.path not in ("", "/"):
        dbs.append(parts.path[1:])
    for db in dbs:
        if not (db.isascii() and db.isdigit()):
            raise ConfigError(f"url {url!r}: the database must be an int >= 0, got {db!r}")


def check_sentinels(sentinels: object, service: object) -> None:
    """``RedisStore.from_sentinel(sentinels, service)``: a non-empty list of ``(host,
    port)`` pairs (a non-empty str, an int in 1..65535) and a non-empty service name.
    Raises ConfigError."""
    ok = (isinstance(sentinels, (list, tuple)) and len(sentinels) > 0 and all(
        isinstance(s, (list, tuple)) and len(s) == 2 and type(s[0]) is str and s[0]
        and type(s[1]) is int and 0 < s[1] < 65536 for s in sentinels))
    if not ok:
        raise ConfigError(f"sentinels must be a non-empty list of (host, port) pairs, got {sentinels!r}")
    if type(service) is not str or not service:
        raise ConfigError(f"service must be a non-empty str (the master's name), got {service!r}")


def _shown(value: object) -> str:
    return repr(value)[:120]


def check_keys(call: str, keys: object) -> None:
    """``keys`` of ``RedisStore.<call>``: a list or tuple of bytes (a str, bytearray or
    number went to redis-py, which encodes some of them as other keys). Raises
    ConfigError."""
    if type(keys) is not list and type(keys) is not tuple or not all(
            [type(k) is bytes for k in keys]):
        raise ConfigError(f"{call}: keys must be a list of bytes, got {_shown(keys)}")


def check_runs(runs: object) -> None:
    """``RedisStore.held_runs``'s ``runs``: a list or tuple of lists or tuples of bytes
    keys. Raises ConfigError."""
    if type(runs) is not list and type(runs) is not tuple:
        raise ConfigError(f"held_runs: runs must be a list of lists of keys, got {_shown(runs)}")
    for keys in runs:
        check_keys("held_runs", keys)


def check_items(items: object) -> None:
    """``RedisStore.put``'s ``items``: a list or tuple of ``(key, value)`` pairs, each
    key bytes and each value bytes, a bytearray or a C-contiguous memoryview (sent from
    its own memory). Raises ConfigError."""
    if type(items) is not list and type(items) is not tuple or not all(
            [type(i) is tuple and len(i) == 2 and type(i[0]) is bytes
             and (type(i[1]) in (bytes, bytearray)
                  or type(i[1]) is memoryview and i[1].c_contiguous) for i in items]):
        raise ConfigError(f"put: items must be a list of (bytes key, bytes value) pairs, "
                          f"got {_shown(items)}")


def check_reads(keys: object, buffers: object, deadline: object) -> None:
    """``RedisStore.read_into``'s arguments: ``keys`` as ``check_keys``, ``buffers`` a
    list or tuple of as many lists (or tuples) of writable C-contiguous memoryviews, a
    ``deadline`` (an int or float) of magnitude below ``MAX_DEADLINE``. A view is of bytes
    (format ``"B"``, one dimension: ``memoryview(x).cast("B")``): a read copies what it
    receives into byte slices, and one of float32 items (or of two dimensions) failed
    mid-reply with a ValueError (NotImplementedError), after the GETs were sent, the
    connection lost and the call counted as the store's failure. Raises ConfigError."""
    check_keys("read_into", keys)
    if (type(buffers) is not list and type(buffers) is not tuple
            or len(buffers) != len(keys)  # type: ignore[arg-type]
            or not all([type(b) is list or type(b) is tuple for b in buffers])
            or not all([type(v) is memoryview and not v.readonly and v.c_contiguous
                        and v.format == "B" and v.ndim == 1 for b in buffers for v in b])):
        raise ConfigError(f"read_into: buffers must be one list of writable contiguous "
                          f"byte memoryviews (format 'B', one dimension) per key, got "
                          f"{_shown(buffers)}")
    if type(deadline) not in (int, float) or not abs(deadline) < MAX_DEADLINE:  # type: ignore[arg-type]
        raise ConfigError(f"read_into: deadline must be a time.monotonic() instant (a "
                          f"number of magnitude below 2**40), got {_shown(deadline)}")

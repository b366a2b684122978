"""The checks ``RedisStore`` makes of its arguments before it imports redis-py or
connects anywhere: every caller mistake a ``ConfigError`` (a ``PrefixKVError``), never a
redis-py error from deep inside a connection."""

from __future__ import annotations

import urllib.parse

from ..errors import ConfigError, check_flag

URL_SCHEMES = ("redis://", "rediss://", "unix://")
"""The URL schemes a ``RedisStore`` takes (redis-py's)."""


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

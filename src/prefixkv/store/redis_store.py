"""``RedisStore``: the store protocol on Redis or Valkey, through redis-py (the
``prefixkv[redis]`` extra, imported when a RedisStore is made, never by the core).

Each call is one pipelined round trip (``GET``/``EXISTS``/``SET ... EX`` per key, no
transaction), values are binary, keys are never scanned. Expiry is ``ttl`` seconds per
value; eviction is the server's (``maxmemory-policy allkeys-lru``). A failed call raises
(redis-py's error): ``SharedStore`` counts it as misses. The client does not retry within
a call (a down store costs one ``timeout`` at most) and reconnects on the next call.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import ConfigError


class RedisStore:
    """A Redis/Valkey server (or cluster) at ``url``: ``redis://host:port/db``,
    ``rediss://user:password@host:port`` (TLS, ACL user), ``unix:///path/redis.sock``.
    ``timeout``: seconds a connect or a call may take before it fails. ``ttl``: seconds a
    value lives. ``cluster``: the URL names a Redis Cluster node (keys spread over slots;
    a pipeline is split per node by redis-py).
    Raises ConfigError for a timeout or ttl out of range, ImportError without redis-py,
    ValueError (redis-py's) for a malformed URL."""

    def __init__(self, url: str, *, timeout: float = 0.25, ttl: int = 86400,
                 cluster: bool = False) -> None:
        if type(timeout) not in (int, float) or not 0 < timeout < float("inf"):
            raise ConfigError(f"timeout must be a positive finite number of seconds, got {timeout!r}")
        if type(ttl) is not int or ttl <= 0:
            raise ConfigError(f"ttl must be a positive int (seconds), got {ttl!r}")
        import redis
        from redis.backoff import NoBackoff
        from redis.cluster import RedisCluster
        from redis.retry import Retry

        options = dict(socket_timeout=timeout, socket_connect_timeout=timeout)
        self.client: redis.Redis | RedisCluster
        if cluster:
            self.client = RedisCluster.from_url(url, **options)
        else:
            self.client = redis.Redis.from_url(url, retry=Retry(NoBackoff(), 0), **options)
        self.ttl = ttl

    def held(self, keys: Sequence[bytes]) -> int:
        """``StoreBackend.held``: pipelined EXISTS. Raises redis-py's errors."""
        pipe = self.client.pipeline(transaction=False)
        for k in keys:
            pipe.exists(k)
        n = 0
        for found in pipe.execute():
            if not found:
                break
            n += 1
        return n

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """``StoreBackend.get``: pipelined GET. Raises redis-py's errors."""
        pipe = self.client.pipeline(transaction=False)
        for k in keys:
            pipe.get(k)
        values: list[bytes | None] = pipe.execute()
        return values

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        """``StoreBackend.put``: pipelined SET with EX ttl. Raises redis-py's errors (an
        OOM error when the server is full under ``noeviction``)."""
        pipe = self.client.pipeline(transaction=False)
        for k, v in items:
            pipe.set(k, v, ex=self.ttl)
        pipe.execute()

    def close(self) -> None:
        """Close the connections (a later call opens new ones)."""
        self.client.close()

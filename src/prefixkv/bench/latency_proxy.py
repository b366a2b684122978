"""``LatencyProxy``: a Unix socket in front of a store that delays what each client
sends by a fixed time: a store one network round trip away (``delay`` seconds), for the
bench and the examples. Each accepted client gets a thread per direction."""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import time


class LatencyProxy:
    """Listens at ``url`` (``unix://...``) and forwards to the Unix socket ``target``
    (a path), delaying each chunk a client sends by ``delay`` seconds."""

    def __init__(self, target: str, delay: float) -> None:
        self.target, self.delay = target, delay
        self._dir = tempfile.mkdtemp(prefix="prefixkv-proxy-")
        self.path = os.path.join(self._dir, "proxy.sock")
        self.url = f"unix://{self.path}"
        self._listener = socket.socket(socket.AF_UNIX)
        self._listener.bind(self.path)
        self._listener.listen(64)
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="prefixkv-proxy").start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.socket(socket.AF_UNIX)
            server.connect(self.target)
            for src, dst, delay in ((client, server, self.delay), (server, client, 0.0)):
                threading.Thread(target=self._pipe, args=(src, dst, delay), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, delay: float) -> None:
        try:
            while data := src.recv(1 << 20):
                if delay:
                    time.sleep(delay)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        try:
            os.unlink(self.path)
            os.rmdir(self._dir)
        except OSError:
            pass

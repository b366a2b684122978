"""A TCP relay on loopback whose connections can be made to vanish without closing: the
router's view of a publisher host that crashed, lost power or was cut off by the network
(nothing tells the router's end that the connection is gone: no FIN, no RST)."""

import socket
import threading


class Blackhole:
    """Relays ``127.0.0.1:port`` (``self.endpoint``) to ``127.0.0.1:target``. ``swallow()``:
    the connections open now drop all they carry from then on, and their ends are not
    passed on; connections made later are relayed. ``close()`` ends the relay."""

    def __init__(self, target: int) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._open: list[dict] = []  # per connection: {"dead": bool, "socks": [...]}
        self._all: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self._listener.accept()
            except OSError:
                return
            try:
                up = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                down.close()
                continue
            conn = {"dead": False, "socks": [down, up]}
            with self._lock:
                self._open.append(conn)
                self._all += [down, up]
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(conn, a, b), daemon=True).start()

    def _pump(self, conn: dict, src: socket.socket, dst: socket.socket) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            if conn["dead"]:
                if not data:
                    return  # (the other end never hears of it)
                continue
            if not data:
                dst.close()
                return
            try:
                dst.sendall(data)
            except OSError:
                return

    def swallow(self) -> None:
        with self._lock:
            for conn in self._open:
                conn["dead"] = True
            self._open = []

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            for s in self._all:
                s.close()
